"""config.json's quantization_config in compressed-tensors' layout (`fp8-channel`, `nvfp4`, `mxfp4`), made by the
compressed-tensors library's own classes (the `quantize` extra: `pip install 'distmerge[quantize]'`). Called only
by those schemes' `config`, on rank 0 when finalize writes config.json: the import alone costs seconds (it imports
transformers).

fp8-channel is compressed-tensors' FP8_DYNAMIC preset (what llm-compressor writes for it): per-channel float8 weights,
static, symmetric, and per-token float8 activations quantized at run time, stored in the float-quantized format.
The wrapper keys are the ones its ModelCompressor.update_config writes (tests/test_quantize.py checks the two agree).
nvfp4 and mxfp4 are its NVFP4A16 and MXFP4A16 presets, in one config group named after the preset and with the
format set on it, as llm-compressor's model_free_ptq writes them (tests/test_quantize_fp4.py compares the two).
"""

from __future__ import annotations

from typing import Any

from distmerge.errors import DistmergeError
from distmerge.quantize.scheme import INSTALL


def _missing(scheme: str) -> DistmergeError:
    return DistmergeError(f"--quantize {scheme} writes compressed-tensors' layout and needs the library: {INSTALL} "
                          "(or pip install compressed-tensors)")


def fp8_dynamic(ignore: list[str], scheme: str) -> dict[str, Any]:
    """FP8_DYNAMIC on every Linear but `ignore` (the modules whose weights stay in the merge's dtype); `scheme`: the
    --quantize choice, for the message when the library is missing."""
    try:
        import compressed_tensors
        import torch
        from compressed_tensors.base import (
            COMPRESSION_VERSION_NAME,
            QUANTIZATION_METHOD,
            QUANTIZATION_METHOD_NAME,
            SPARSITY_CONFIG_NAME,
            TRANSFORM_CONFIG_NAME,
        )
        from compressed_tensors.config import CompressionFormat
        from compressed_tensors.quantization import (
            QuantizationArgs,
            QuantizationConfig,
            QuantizationScheme,
            QuantizationStatus,
            QuantizationStrategy,
            QuantizationType,
        )
    except ImportError:
        raise _missing(scheme) from None
    weights = QuantizationArgs(num_bits=8, type=QuantizationType.FLOAT, strategy=QuantizationStrategy.CHANNEL,
                               symmetric=True, dynamic=False, scale_dtype=torch.float32)
    activations = QuantizationArgs(num_bits=8, type=QuantizationType.FLOAT, strategy=QuantizationStrategy.TOKEN,
                                   symmetric=True, dynamic=True)
    scheme = QuantizationScheme(targets=["Linear"], weights=weights, input_activations=activations)
    quant = QuantizationConfig(config_groups={"group_0": scheme}, format=CompressionFormat.float_quantized.value,
                               quantization_status=QuantizationStatus.COMPRESSED, ignore=ignore)
    return {
        COMPRESSION_VERSION_NAME: compressed_tensors.__version__,
        QUANTIZATION_METHOD_NAME: QUANTIZATION_METHOD,
        SPARSITY_CONFIG_NAME: {},
        TRANSFORM_CONFIG_NAME: {},
        **quant.model_dump(exclude=["quant_method"]),
    }


def preset(name: str, format: str, ignore: list[str], scheme: str) -> dict[str, Any]:
    """A weight-only preset `name` (NVFP4A16, MXFP4A16) on every Linear but `ignore`, compressed in `format`;
    `scheme`: the --quantize choice, for the message when the library is missing."""
    try:
        import compressed_tensors
        from compressed_tensors.base import COMPRESSION_VERSION_NAME, QUANTIZATION_METHOD_NAME, TRANSFORM_CONFIG_NAME
        from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus, preset_name_to_scheme
    except ImportError:
        raise _missing(scheme) from None
    group = preset_name_to_scheme(name, ["Linear"])
    group.format = format
    quant = QuantizationConfig(config_groups={name: group}, format=format,
                               quantization_status=QuantizationStatus.COMPRESSED, ignore=ignore)
    return {
        COMPRESSION_VERSION_NAME: compressed_tensors.__version__,
        QUANTIZATION_METHOD_NAME: "compressed-tensors",
        TRANSFORM_CONFIG_NAME: {},
        **quant.model_dump(),
    }

"""The separate quantizer bench_quantize.py compares with: compressed-tensors' own path to its FP8_DYNAMIC layout
(per-channel float8 weights, dynamic per-token activations) of a merged bf16 Hugging Face folder, as llm-compressor
runs it for that scheme (no calibration data: weight scales from each row's min and max):

    load the model with transformers -> apply_quantization_config -> each Linear's weight_scale from
    calculate_qparams -> ModelCompressor.compress_model -> save_pretrained -> ModelCompressor.update_config

    python tests/bench/peer_ct_quantize.py --input MERGED_BF16 --output OUT [--json-summary FILE]

llm-compressor itself (0.14.0.1) pins transformers <= 5.17 and compressed-tensors 0.19, which this venv's
transformers 5.24 rules out; its FP8_DYNAMIC path is these library calls.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input", type=Path, required=True)
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--json-summary", type=Path)
    args = parser.parse_args()
    start = time.perf_counter()
    import torch
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig,
        QuantizationScheme,
        QuantizationStatus,
        apply_quantization_config,
        preset_name_to_scheme,
    )
    from compressed_tensors.quantization.utils import calculate_qparams
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(args.input, dtype=torch.bfloat16)
    scheme: QuantizationScheme = preset_name_to_scheme("FP8_DYNAMIC", ["Linear"])
    config = QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"], format="float-quantized")
    apply_quantization_config(model, config)
    with torch.no_grad():
        for module in model.modules():
            if getattr(module, "quantization_scheme", None) is None:
                continue
            w = module.weight
            scale, zero = calculate_qparams(w.amin(dim=1, keepdim=True), w.amax(dim=1, keepdim=True), scheme.weights)
            module.weight_scale.data.copy_(scale)
            module.quantization_status = QuantizationStatus.CALIBRATION
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format="float-quantized")
    compressor.compress_model(model)
    shutil.rmtree(args.output, ignore_errors=True)
    model.save_pretrained(args.output)
    compressor.update_config(str(args.output))
    seconds = time.perf_counter() - start
    if args.json_summary:
        args.json_summary.write_text(json.dumps({
            "seconds": seconds, "ranks": [{"rank": 0, "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
                                           * 1024}]}))


if __name__ == "__main__":
    main()

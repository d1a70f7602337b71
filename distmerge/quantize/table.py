"""`--quantize`: which Hugging Face tensors are written in FP8, as a table, and the units that write them.

Applied to any family's units (their targets carry Hugging Face names by then), in prepare.py:

    unit  sources -> transform -> [t0, t1]          t1 in the table
      ->  sources -> quantized(transform) -> [t0, fp8(t1), scale(t1)]

so the safetensors headers (dtype F8_E4M3, the added scale tensors) are known from the plan before any byte is read,
and the FP8 bytes are made where the unit is assembled (transforms.quantized, fp8.py). What the table leaves alone
keeps the merge's dtype; the Linear modules among those are named in config.json (modules_to_not_convert, or
compressed-tensors' ignore) so that loaders do not expect FP8 weights for them.
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any

import torch

from distmerge import dtypes
from distmerge.errors import InputError
from distmerge.families.base import FamilyResult, ModelTraits, Target, Unit, register_quantizer
from distmerge.families.transforms import TRANSFORMS, after, transform
from distmerge.quantize import fp8, fp8_compressed

# A decoder layer of the text model, under the names save_pretrained writes (hub_names.py: a Qwen2-VL language
# model's layers are `model.layers`, LLaVA's `language_model.model.layers`; vision towers never match).
LAYER = r"(?:model\.|model\.language_model\.|language_model\.model\.)layers\.\d+\."
# The linear layers of attention and MLP blocks, experts included: the weights written in FP8. Everything else
# stays in the merge's dtype, as DeepSeek-V3's and Qwen3's FP8 checkpoints keep it: embeddings, norms, biases,
# routers (mlp.gate, Qwen2-MoE's shared_expert_gate) and their bias, the LM head, value heads, the multi-token
# prediction block's own eh_proj (vLLM builds it as a plain Linear), vision towers.
QUANTIZED_MODULES = (
    r"self_attn\.(?:q|k|v|o)_proj",  # Llama, Mistral, Mixtral, Qwen2/3 (MoE), DeepSeek-V3's o_proj
    r"self_attn\.(?:q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj)",  # DeepSeek-V3's multi-latent attention
    r"mlp\.(?:gate|up|down)_proj",  # dense MLPs
    r"mlp\.experts\.\d+\.(?:gate|up|down)_proj",  # Qwen MoE, DeepSeek-V3 routed experts
    r"mlp\.shared_experts?\.(?:gate|up|down)_proj",  # DeepSeek-V3 shared_experts, Qwen2-MoE shared_expert
    r"block_sparse_moe\.experts\.\d+\.w[123]",  # Mixtral
)
QUANTIZED = re.compile(LAYER + "(?:" + "|".join(QUANTIZED_MODULES) + r")\.weight")


@register_quantizer
def quantize(result: FamilyResult, scheme: str, traits: ModelTraits, config: dict[str, Any]) -> tuple[
        FamilyResult, fp8.Quantized]:
    """The family's result with the table's weights in FP8, and what config.json must say about it."""
    if scheme == "fp8-channel":
        fp8_compressed.require()
    units = [_quantize_unit(u, scheme) for u in result.units]
    targets = [t for u in units for t in u.targets if t.group == "model"]
    count = sum(t.dtype == fp8.FP8 for t in targets)
    if not count:
        raise InputError(f"--quantize {scheme}: no tensor of this model is a linear layer of an attention or MLP "
                         "block (distmerge/quantize/table.py lists them); merge without --quantize")
    kept = _unconverted(targets, traits, config)
    quantized = fp8.Quantized(scheme=scheme, unconverted=kept)
    note = (f"--quantize {scheme}: {count} linear weights in float8_e4m3fn ({fp8.SCHEMES[scheme].layout}); "
            f"{len(kept)} modules kept in the merge's dtype ({', '.join(kept[:4])}{', ...' * (len(kept) > 4)})")
    return replace(result, units=units, notes=[*result.notes, note]), quantized


def _quantize_unit(unit: Unit, scheme: str) -> Unit:
    which = [i for i, t in enumerate(unit.targets) if _quantizes(t)]
    if not which:
        return unit
    grid = fp8.SCHEMES[scheme]
    targets: list[Target] = []
    for i, t in enumerate(unit.targets):
        if i in which:
            targets += [replace(t, dtype=fp8.FP8),
                        Target(name=grid.scale_name(t.name), shape=grid.scale_shape(t.shape), dtype=fp8.SCALE,
                               group=t.group)]
        else:
            targets.append(t)
    params = (("inner", unit.transform), ("inner_params", unit.params), ("scheme", scheme),
              ("weights", tuple((i, unit.targets[i].dtype) for i in which)))
    return Unit(sources=unit.sources, targets=tuple(targets), transform="quantized", params=params)


def _quantizes(target: Target) -> bool:
    return (target.group == "model" and len(target.shape) == 2 and dtypes.is_float(target.dtype)
            and QUANTIZED.fullmatch(target.name) is not None)


def _unconverted(targets: list[Target], traits: ModelTraits, config: dict[str, Any]) -> tuple[str, ...]:
    """Modules with a 2-D weight the table leaves alone, and heads the model re-creates from a tied embedding
    (written nowhere, yet a Linear module of the model all the same)."""
    names = {t.name for t in targets}
    kept = {t.name.removesuffix(".weight") for t in targets if t.name.endswith(".weight") and len(t.shape) == 2
            and dtypes.is_float(t.dtype) and t.dtype != fp8.FP8}
    if traits.ties(config):
        kept |= {head.removesuffix(".weight") for head, embed in traits.tied_heads if embed in names
                 and head not in names}
    return tuple(sorted(kept, key=_natural))


def _natural(name: str) -> list:
    return [int(t) if i % 2 else t for i, t in enumerate(re.split(r"(\d+)", name))]


@transform
def quantized(sources: list[torch.Tensor], inner: str, inner_params: tuple[tuple[str, object], ...], scheme: str,
              weights: tuple[tuple[int, str], ...]) -> list[torch.Tensor]:
    """`inner`'s targets with some weights in FP8 (--quantize, fp8.py), each followed by its scales:

        inner(sources) = [t0, t1, t2]   weights ((1, "BF16"),)   ->   [t0, fp8(t1), scale(t1), t2]

    A weight is first cast to the dtype it would have had unquantized (the merge's --dtype), so the FP8 output is
    the quantization of the model the same merge writes without --quantize. On the device the unit was assembled on.
    """
    return quantize_targets(TRANSFORMS[inner](sources, **dict(inner_params)), scheme, weights)


def quantize_targets(out: list[torch.Tensor], scheme: str, weights: tuple[tuple[int, str], ...]) -> list[torch.Tensor]:
    """The inner transform's targets, the weights among them in FP8, each followed by its scales."""
    dtype_of = dict(weights)
    result: list[torch.Tensor] = []
    for i, tensor in enumerate(out):
        if i in dtype_of:
            result.extend(fp8.SCHEMES[scheme].quantize(tensor.to(dtypes.torch_dtype(dtype_of[i]))))
        else:
            result.append(tensor)
    return result


after("quantized", quantize_targets)  # a fold's unit wrapped by it (an average) is still built an input at a time

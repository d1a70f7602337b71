"""`--quantize`: which Hugging Face tensors are quantized, as a table, and the units that write them.

Applied to any family's units (their targets carry Hugging Face names by then), in prepare.py:

    unit  sources -> transform -> [t0, t1]          t1 in the table
      ->  sources -> quantized(transform) -> [t0, fp8(t1), scale(t1)]                     (fp8-block, fp8-channel)
      ->  sources -> quantized(transform) -> [t0, packed(t1), scale(t1), global(t1)]      (nvfp4; mxfp4: no global)

so the safetensors headers (the quantized dtypes, the added scale tensors) are known from the plan before any byte
is read, and the quantized bytes are made where the unit is assembled (quantized below; the math: the scheme's).
A scheme whose fused weights share a scale (nvfp4) first joins the units of each fused set into one (fused.py). What
the table leaves alone, or the scheme cannot take (4-bit: inputs not a whole number of groups), keeps the merge's
dtype; the Linear modules among those are named in config.json (modules_to_not_convert, or compressed-tensors'
ignore) so that loaders do not expect quantized weights for them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any

import torch

from distmerge import dtypes
from distmerge.errors import InputError
from distmerge.families.base import FamilyResult, ModelTraits, Target, Unit
from distmerge.families.transforms import TRANSFORMS, Params
from distmerge.natural_order import natural_key
from distmerge.quantize import fused, schemes
from distmerge.quantize.scheme import Scheme

# A decoder layer of the text model, under the names save_pretrained writes (hub_names.py: a Qwen2-VL language
# model's layers are `model.layers`, LLaVA's `language_model.model.layers`; vision towers never match).
LAYER = r"(?:model\.|model\.language_model\.|language_model\.model\.)layers\.\d+\."
# The linear layers of attention and MLP blocks, experts included: the weights quantized. Everything else
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


def quantize(result: FamilyResult, scheme: str, traits: ModelTraits, config: dict[str, Any]) -> FamilyResult:
    """The family's result with the table's weights quantized, and what config.json must say about it: its
    quantization_config, made by finalize on rank 0 (schemes.Quantized.config: the scheme's own)."""
    row = schemes.scheme(scheme)
    row.require()
    units, sets = result.units, {}
    if row.fused:
        units, sets = fused.join(units, lambda t: _quantizes(t, row))
    units = [_quantize_unit(u, scheme, row, sets) for u in units]
    targets = [t for u in result.units for t in u.targets if t.group == "model"]
    count = sum(len(u.params.weights) for u in units if isinstance(u.params, Quantized))
    if not count:
        raise InputError(f"--quantize {scheme}: no tensor of this model is a linear layer of an attention or MLP "
                         "block (distmerge/quantize/table.py lists them) that the scheme can take; merge without "
                         "--quantize")
    kept = _unconverted(targets, row, traits, config)
    quantized = schemes.Quantized(scheme=scheme, unconverted=kept)
    note = (f"--quantize {scheme}: {count} linear weights quantized ({row.description}); {len(kept)} modules kept in "
            f"the merge's dtype ({', '.join(kept[:4])}{', ...' * (len(kept) > 4)})")
    return replace(result, units=units, notes=[*result.notes, note],
                   config_later={**result.config_later, "quantization_config": quantized})


def _quantize_unit(unit: Unit, scheme: str, row: Scheme, sets: dict[str, str]) -> Unit:
    which = [i for i, t in enumerate(unit.targets) if _quantizes(t, row)]
    if not which:
        return unit
    targets: list[Target] = []
    for i, t in enumerate(unit.targets):
        if i in which:
            targets += [Target(name=name, shape=shape, dtype=code, group=t.group)
                        for name, shape, code in row.parts(t.name, t.shape)]
        else:
            targets.append(t)
    # each weight: its index among the inner targets, its dtype unquantized, the set whose scale it shares
    weights = tuple((i, unit.targets[i].dtype, sets.get(unit.targets[i].name, unit.targets[i].name) if row.fused
                     else None) for i in which)
    params = Quantized(inner=unit.transform, inner_params=unit.params, scheme=scheme, weights=weights)
    return Unit(sources=unit.sources, targets=tuple(targets), transform="quantized", params=params)


def _quantizes(target: Target, row: Scheme) -> bool:
    return (target.group == "model" and len(target.shape) == 2 and dtypes.is_float(target.dtype)
            and QUANTIZED.fullmatch(target.name) is not None and row.takes(target.shape))


def _unconverted(targets: list[Target], row: Scheme, traits: ModelTraits, config: dict[str, Any]) -> tuple[str, ...]:
    """Modules with a 2-D floating weight left as it is (the table leaves it alone, or the scheme cannot take it),
    and heads the model re-creates from a tied embedding (written nowhere, yet a Linear module of the model all the
    same). `targets`: the model's, before quantization."""
    kept = {t.name.removesuffix(".weight") for t in targets if t.name.endswith(".weight") and len(t.shape) == 2
            and dtypes.is_float(t.dtype) and not _quantizes(t, row)}
    names = {t.name for t in targets}
    if traits.ties(config):
        kept |= {head.removesuffix(".weight") for head, embed in traits.tied_heads if embed in names
                 and head not in names}
    return tuple(sorted(kept, key=natural_key))


@dataclass(frozen=True)
class Quantized(Params):
    """quantized's keywords: the transform it wraps and that one's params, the scheme, and the weights among the
    inner targets it quantizes: (index, dtype unquantized, the fused set whose scale it shares or None)."""

    inner: str
    inner_params: Params
    scheme: str
    weights: tuple[tuple[int, str, str | None], ...]


def quantized(sources: list[torch.Tensor], inner: str, inner_params: Params, scheme: str,
              weights: tuple[tuple[int, str, str | None], ...]) -> list[torch.Tensor]:
    """`inner`'s targets with some weights quantized (--quantize, schemes.py), each as the scheme's parts:

        inner(sources) = [t0, t1, t2]   weights ((1, "BF16", None),)   ->   [t0, fp8(t1), scale(t1), t2]

    A weight is first cast to the dtype it would have had unquantized (the merge's --dtype), so the output is the
    quantization of the model the same merge writes without --quantize. Weights of one fused set (the same third
    field; nvfp4) share a scale made from all of them: from their extremes, cast as the weights are (rounding is
    monotonic, so the cast's extremes are the extremes cast). On the device the unit was assembled on.
    """
    return quantize_targets(TRANSFORMS[inner](sources, **dict(inner_params)), scheme, weights)


def quantize_targets(out: list[torch.Tensor], scheme: str,
                     weights: tuple[tuple[int, str, str | None], ...]) -> list[torch.Tensor]:
    """The inner transform's targets, the weights among them quantized, each as the scheme's parts (quantized)."""
    row = schemes.scheme(scheme)
    extremes: dict[str, list[torch.Tensor]] = {}
    for i, dtype, key in weights:
        if key is not None:
            pair = torch.stack([out[i].amax(), out[i].amin()]).to(dtypes.torch_dtype(dtype))
            extremes.setdefault(key, []).append(pair)
    shared = {key: row.shared(pairs) for key, pairs in extremes.items()}
    spec = {i: (dtype, key) for i, dtype, key in weights}
    result: list[torch.Tensor] = []
    for i, tensor in enumerate(out):
        if i in spec:
            dtype, key = spec[i]
            result.extend(row.quantize(tensor.to(dtypes.torch_dtype(dtype)), shared.get(key)))
        else:
            result.append(tensor)
    return result


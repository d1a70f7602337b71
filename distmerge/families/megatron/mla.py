"""Multi-latent attention (DeepSeek-V2/V3) on Megatron: each projection's shape from config.json, and the rotary
layout of its output rows.

megatron-core's MLA (transformer/multi_latent_attention.py) lays the rows out as Hugging Face's DeepseekV3
attention does: per head [qk_nope | qk_rope] for linear_q_proj / linear_q_up_proj (q_proj / q_b_proj), [kv latent
| qk_rope] for linear_kv_down_proj (kv_a_proj_with_mqa), per head [k_nope | v] for linear_kv_up_proj
(kv_b_proj). It rotates the rope rows as interleaved pairs (x0, y0, x1, y1, ...), which is Hugging Face's
`rope_interleave: true` (the DeepseekV3Config default): the bytes are copied as they are. A config that says
`rope_interleave: false` rotates the halves (x0 x1 ... | y0 y1 ...): the rope rows are permuted to that order
(transforms.mla_rope_halves), so the model gives the same logits; copying them as they are would load and
silently give others.

Multi-token prediction blocks (`mtp.layers.{j}.*`) are found by the decoder's rows (mtp_aliases) and written as
layer num_hidden_layers + j, as DeepSeek-V3's checkpoint has them (mtp.py).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection
from typing import Any

from distmerge.errors import InputError, LayoutError
from distmerge.families.base import SourceMeta, config_int
from distmerge.families.megatron.tables import MTP_LAYERS
from distmerge.families.megatron.transforms import MlaRopeHalves
from distmerge.families.transforms import NO_PARAMS, Params

MLA = "mla"  # the table's transform name for every MLA projection: resolved here to identity or the permutation

Sizes = dict[str, int | None]
MTP_SOURCE = re.compile(r"^mtp\.layers\.(\d+)\.(.*)$")
MEGATRON_LAYER = re.compile(r"^(decoder|mtp)\.layers\.(\d+)\.(.*)$")


def _sizes(config: dict[str, Any]) -> Sizes:
    need = ("hidden_size", "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
    out: Sizes = {key: config_int(config, key, "Megatron multi-latent attention") for key in need}
    q_lora = config.get("q_lora_rank")
    out["q_lora_rank"] = q_lora if isinstance(q_lora, int) else None
    return out


def _q_rows(s: Sizes) -> int:
    return s["num_attention_heads"] * (s["qk_nope_head_dim"] + s["qk_rope_head_dim"])


# Megatron suffix -> (its shape from the sizes, or a reason it cannot be there; its rope rows: (heads, rows before
# the rope rows in each head) or None)
SHAPES: dict[str, Callable[[Sizes], tuple[int, int] | str]] = {
    "linear_q_proj.weight": lambda s: (_q_rows(s), s["hidden_size"]) if s["q_lora_rank"] is None else
    f"config.json has q_lora_rank {s['q_lora_rank']} (q_a_proj, q_b_proj) but the checkpoint has no query LoRA",
    "linear_q_down_proj.weight": lambda s: (s["q_lora_rank"], s["hidden_size"]) if s["q_lora_rank"] else
    "config.json has no q_lora_rank (a single q_proj) but the checkpoint has a query LoRA",
    "linear_q_up_proj.weight": lambda s: (_q_rows(s), s["q_lora_rank"]) if s["q_lora_rank"] else
    "config.json has no q_lora_rank (a single q_proj) but the checkpoint has a query LoRA",
    "linear_kv_down_proj.weight": lambda s: (s["kv_lora_rank"] + s["qk_rope_head_dim"], s["hidden_size"]),
    "linear_kv_up_proj.weight": lambda s: (s["num_attention_heads"] * (s["qk_nope_head_dim"] + s["v_head_dim"]),
                                           s["kv_lora_rank"]),
    "linear_proj.weight": lambda s: (s["hidden_size"], s["num_attention_heads"] * s["v_head_dim"]),
}
ROPE_ROWS: dict[str, Callable[[Sizes], tuple[int, int]]] = {
    "linear_q_proj.weight": lambda s: (s["num_attention_heads"], s["qk_nope_head_dim"]),
    "linear_q_up_proj.weight": lambda s: (s["num_attention_heads"], s["qk_nope_head_dim"]),
    "linear_kv_down_proj.weight": lambda s: (1, s["kv_lora_rank"]),
}


def resolve(meta: SourceMeta, config: dict[str, Any]) -> tuple[str, Params]:
    """The transform and its parameters for one MLA projection, after checking its shape against config.json."""
    suffix = next(s for s in SHAPES if meta.name.endswith("." + s))
    sizes = _sizes(config)
    want = SHAPES[suffix](sizes)
    if isinstance(want, str):
        raise LayoutError(f"{meta.name}: {want}: wrong config.json?")
    if tuple(meta.shape) != want:
        shown = ", ".join(f"{k}={v}" for k, v in sizes.items())
        raise LayoutError(f"{meta.name} has shape {list(meta.shape)}, but config.json's attention sizes ({shown}) "
                          f"make {list(want)}: wrong config.json, or a TP split the files do not show?")
    if suffix not in ROPE_ROWS or rope_interleaved(config):
        return "identity", NO_PARAMS
    heads, keep = ROPE_ROWS[suffix](sizes)
    return "mla_rope_halves", MlaRopeHalves(heads=heads, keep=keep, rope=sizes["qk_rope_head_dim"])


def mtp_aliases(names: Collection[str], config: dict[str, Any], has_rows: bool) -> dict[str, str]:
    """Each multi-token prediction source (megatron-core `mtp.layers.{j}.*`) -> the name its table row is found
    by: the block's transformer layer (either spelling of tables.MTP_LAYERS) as decoder layer
    num_hidden_layers + j (it is built from the decoder's layer spec, so the decoder's rows map it), its own
    parts (enorm, hnorm, eh_proj, final_layernorm) as `mtp.layers.{num_hidden_layers + j}.*`. `has_rows`: the
    architecture has MTP rows (tables.MTP)."""
    found = {n: m for n in names if (m := MTP_SOURCE.match(n))}
    if not found:
        return {}
    if not has_rows:
        first = min(found)
        raise InputError(f"{len(found)} multi-token prediction tensors ({first}, ...): distmerge maps Megatron's MTP "
                         "layers for DeepSeek-V3 only; is config.json's architecture this model's?")
    layers = config_int(config, "num_hidden_layers", "Megatron multi-token prediction")
    out = {}
    for name, m in found.items():
        number, rest = layers + int(m[1]), m[2]
        layer = next((p for p in MTP_LAYERS if rest.startswith(p)), None)
        out[name] = f"decoder.layers.{number}.{rest[len(layer):]}" if layer else f"mtp.layers.{number}.{rest}"
    return out


def mtp_megatron_name(name: str, layers: int) -> str:
    """mtp_aliases backwards, for the import: the name a decoder row makes for Hugging Face layer
    num_hidden_layers + j -> megatron-core 0.16's name in MTP block j (`mtp.layers.{j}.transformer_layer.*`), and
    an MTP row's (`mtp.layers.{num_hidden_layers + j}.*`) -> `mtp.layers.{j}.*`; any other name as it is."""
    m = MEGATRON_LAYER.match(name)
    if m is None or int(m[2]) < layers:
        return name
    inner = MTP_LAYERS[0] if m[1] == "decoder" else ""
    return f"mtp.layers.{int(m[2]) - layers}.{inner}{m[3]}"


def rope_interleaved(config: dict[str, Any]) -> bool:
    """Hugging Face's DeepseekV3 rotates interleaved pairs unless config.json says `rope_interleave: false`."""
    value = config.get("rope_interleave", True)
    if not isinstance(value, bool):
        raise LayoutError(f"config.json's rope_interleave is {value!r}, not true or false")
    return value

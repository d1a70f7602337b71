"""Multi-token prediction (MTP) layers in Hugging Face names: one convention for every family that writes them.

DeepSeek-V3's published checkpoint (deepseek-ai/DeepSeek-V3: README_WEIGHTS.md, model.safetensors.index.json)
keeps MTP module j as decoder layer `num_hidden_layers + j`, and config.json's `num_nextn_predict_layers` counts
them. For the 61-layer model:

    model.layers.61.enorm.weight, hnorm.weight        RMSNorms of the next token's embedding and of the hidden state
    model.layers.61.eh_proj.weight                    [hidden, 2 * hidden], applied to [enorm(embedding); hnorm(h)]
    model.layers.61.input_layernorm, self_attn.*, post_attention_layernorm, mlp.*    a decoder layer
    model.layers.61.shared_head.norm.weight           the norm before the output head
    model.layers.61.embed_tokens.weight               the same values as model.embed_tokens.weight
    model.layers.61.shared_head.head.weight           the same values as lm_head.weight

transformers' DeepseekV3ForCausalLM builds no module for them (its loader ignores model.layers.61.*); vLLM and
SGLang load them, the two copies included, for speculative decoding. So a family that finds MTP layers writes
all of it: the copies come from the embedding's and the head's own unit (transforms.copies: read once, written
under each name), and config.json's count must agree with the layers found (set when it has none).
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any

from distmerge.errors import LayoutError
from distmerge.families.base import Target, Unit, config_int
from distmerge.families.transforms import Copies

COUNT = "num_nextn_predict_layers"
EMBEDDING, HEAD = "model.embed_tokens.weight", "lm_head.weight"
# The main model's tensor -> its copy in each MTP layer
SHARED = ((EMBEDDING, "embed_tokens.weight"), (HEAD, "shared_head.head.weight"))
# The MTP module's own parts (beside its decoder layer), and their shapes in hidden sizes
OWN = {"enorm.weight": (1,), "hnorm.weight": (1,), "eh_proj.weight": (1, 2), "shared_head.norm.weight": (1,)}
LAYER = re.compile(r"^model\.layers\.(\d+)\.(.*)$")


def finish(units: list[Unit], mtp: set[int], config: dict[str, Any]) -> tuple[list[Unit], dict[str, Any], list[str]]:
    """The family's units with the MTP layers checked and the shared copies added, config.json's updates, a note.

    `mtp`: the Hugging Face layer numbers the family gave MTP layers (num_hidden_layers + j). Checked: they
    follow the decoder's layers one by one; config.json's count agrees (or is set); each has its own parts, of the
    right shape, and the same tensors as the last decoder layer (megatron-core builds it from that layer's spec).
    """
    if not mtp:
        return units, {}, []
    first = config_int(config, "num_hidden_layers", "multi-token prediction")
    count = len(mtp)
    declared = config.get(COUNT)
    if mtp != set(range(first, first + count)) or declared not in (None, count):
        raise LayoutError(f"the checkpoint has {count} multi-token prediction layers (Hugging Face layers "
                          f"{sorted(mtp)[:4]}) but config.json's {COUNT} is {declared} and num_hidden_layers "
                          f"{first}: fix config.json")
    parts = _parts(units)
    hidden = config_int(config, "hidden_size", "multi-token prediction")
    for layer in sorted(mtp):
        _check_layer(layer, parts, first - 1, hidden)
    updates = {} if declared is not None else {COUNT: count}
    note = (f"multi-token prediction: {count} layer(s) written as model.layers.{first}"
            f"{f'-{first + count - 1}' if count > 1 else ''} with copies of the embedding and output head, as "
            f"DeepSeek-V3's checkpoint carries them" + (f"; config.json's {COUNT} set to {count}" if updates else ""))
    return _with_copies(units, range(first, first + count)), updates, [note]


def _parts(units: list[Unit]) -> dict[int, dict[str, tuple[int, ...]]]:
    """layer -> {name within the layer: shape} of every target."""
    out: dict[int, dict[str, tuple[int, ...]]] = {}
    for unit in units:
        for t in unit.targets:
            if m := LAYER.match(t.name):
                out.setdefault(int(m[1]), {})[m[2]] = t.shape
    return out


def _check_layer(layer: int, parts: dict[int, dict[str, tuple[int, ...]]], last: int, hidden: int) -> None:
    mine = parts.get(layer, {})
    for part, sizes in OWN.items():
        want = tuple(hidden * s for s in sizes)
        if mine.get(part) != want:
            found = "missing" if part not in mine else f"of shape {list(mine[part])}"
            raise LayoutError(f"multi-token prediction layer {layer}: {part} is {found}, not {list(want)} "
                              "(config.json's hidden_size): an incomplete save or another model's config.json?")
    decoder = {k: v for k, v in mine.items() if k not in OWN}
    if decoder != parts.get(last, {}):
        diff = sorted(set(decoder).symmetric_difference(parts.get(last, {})) or
                      (k for k in decoder if decoder[k] != parts[last][k]))
        raise LayoutError(f"multi-token prediction layer {layer} differs from decoder layer {last}, whose spec "
                          f"it is built from ({', '.join(diff[:4])}): an incomplete save?")


def _with_copies(units: list[Unit], layers: range) -> list[Unit]:
    """The embedding's and the head's units also write their tensor into each MTP layer. A tied config writes
    no head: the MTP layer's head is then the embedding's copy too (what the tied head is)."""
    owner = {t.name: i for i, u in enumerate(units) for t in u.targets}
    if EMBEDDING not in owner:
        raise LayoutError("the checkpoint has multi-token prediction layers but no word embeddings to share")
    extra: dict[int, list[str]] = {}
    for main, part in SHARED:
        i = owner.get(main, owner[EMBEDDING])
        extra.setdefault(i, []).extend(f"model.layers.{layer}.{part}" for layer in layers)
    out = list(units)
    for i, names in extra.items():
        unit, target = units[i], units[i].targets[0]
        assert len(unit.targets) == 1 and unit.transform != "copies", unit  # one tensor, written again
        copies = tuple(Target(name=n, shape=target.shape, dtype=target.dtype, group=target.group) for n in names)
        out[i] = replace(unit, targets=(target, *copies), transform="copies",
                         params=Copies(of=unit.transform, count=1 + len(copies), inner=unit.params))
    return out


def layer_prefixes(config: dict[str, Any]) -> tuple[str, ...]:
    """The names under which config.json's MTP layers live (`model.layers.<n + j>.`), none when it counts none."""
    n, count = config.get("num_hidden_layers"), config.get(COUNT)
    if type(n) is not int or type(count) is not int or not 0 < count <= 64:
        return ()
    return tuple(f"model.layers.{n + j}." for j in range(count))

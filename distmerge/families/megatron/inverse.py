"""Hugging Face tensors -> megatron-core's global tensors: the family's table (tables.py) read backwards.

A row says which Hugging Face tensors one Megatron tensor becomes, and through which transform (family.py walks it
that way, for a merge). Read from its targets to its source, with the transform's inverse (families/transforms.py
INVERSES, each declared beside its transform), the same row says which Megatron tensor the Hugging Face tensors
make, and how: as rows of them (Segment), so that a TP shard is read as row ranges of the Hugging Face tensors.
The forward direction's own checks judge the result: the forward transform's target shapes (family.target_shapes)
computed from the Megatron tensor made here must be the Hugging Face tensors' shapes.

Global means as megatron-core's torch_dist save holds it, TP shards put together: linear_qkv per query group
[q heads; k; v], linear_fc1 [gate; up], the vocabulary padded for TP (Megatron-LM's _vocab_size_with_padding), an
expert under its global number (local_experts.{e}, SequentialMLP's spelling: the table's grouped GEMM rows are
another spelling of the same tensors, which torch_dist saves under the same keys). How a global tensor is cut
into TP x PP x EP chunks is the format's (formats/megatron/dist_layout.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from distmerge.errors import ConfigError, InputError, LayoutError
from distmerge.families import base
from distmerge.families import transforms as tf
from distmerge.families.base import SourceMeta
from distmerge.families.megatron import family
from distmerge.families.megatron.tables import FAMILIES, Row
from distmerge.formats.base import Hints

# The architectures whose import is written and tested: dense GPTs, and MoE ones whose every layer routes over
# experts (a shared expert beside them for Qwen2-MoE). MLA and MTP tables are not walked back yet.
IMPORTED = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
            "Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM", "MixtralForCausalLM")
# config.json's count of routed experts per MoE layer: Qwen2/3-MoE's num_experts, Mixtral's num_local_experts
EXPERT_COUNTS = ("num_experts", "num_local_experts")
# Transforms whose target is made of parts that megatron-core's torch_dist save splits over TP each on its own:
# apply_swiglu_sharded_factory (mlp.py) saves a TP rank's [gate_r; up_r] as two chunks of the global [gate; up].
TP_PARTS = {"split_gate_up": 2}
HEAD = family.HEAD


@dataclass(frozen=True, kw_only=True)
class Imported:
    """One megatron-core tensor, global, and the Hugging Face rows it is made of."""

    name: str  # megatron-core's name, global layer number: decoder.layers.3.self_attention.linear_qkv.weight
    sources: tuple[str, ...]  # Hugging Face names, in the row's target order (Segment.source indexes them)
    shape: tuple[int, ...]
    dtype: str  # safetensors code, the Hugging Face tensors' own (no cast)
    segments: tuple[tf.Segment, ...]  # its rows, in order, as rows of the sources
    parts: int = 1  # TP splits each of this many equal runs of rows on its own (TP_PARTS)


@dataclass(frozen=True, kw_only=True)
class Sizes:
    """The model's sizes that the Megatron layout depends on, from config.json."""

    layers: int
    heads: int
    groups: int
    vocab: int
    padded_vocab: int
    tied: bool
    experts: int = 0  # routed experts per layer; 0 for a dense model


def padded_vocab(vocab: int, tp: int, divisible_by: int) -> int:
    """Megatron-LM's _vocab_size_with_padding (training/tokenizer): up to a multiple of divisible_by x TP."""
    multiple = divisible_by * tp
    return -(-vocab // multiple) * multiple


def sizes(config: dict[str, Any], tp: int, divisible_by: int) -> Sizes:
    """The sizes, after refusing an architecture not written yet and a TP that does not divide the attention."""
    arch = family.architecture(config)
    if arch not in IMPORTED:
        raise ConfigError(f"config.json's architecture {arch} cannot be imported yet: distmerge import writes "
                          f"{', '.join(IMPORTED)} (MLA and MTP come later)")
    block = base.CAUSAL_LM.sizes(config)
    heads = base.config_int(block, "num_attention_heads", "Megatron import")
    groups = block.get("num_key_value_heads") or heads
    for what, count in (("attention heads", heads), ("query groups (num_key_value_heads)", groups)):
        if count % tp:
            raise ConfigError(f"--tp {tp} does not divide the model's {count} {what}: megatron-core gives each "
                              f"TP rank whole ones; pick a TP that divides {count}")
    vocab = base.config_int(block, "vocab_size", "Megatron import")
    experts = next((base.config_int(block, k, "Megatron import") for k in EXPERT_COUNTS if block.get(k)), 0)
    return Sizes(layers=base.config_int(block, "num_hidden_layers", "Megatron import"), heads=heads, groups=groups,
                 vocab=vocab, padded_vocab=padded_vocab(vocab, tp, divisible_by), tied=base.CAUSAL_LM.ties(config),
                 experts=experts)


def megatron_tensors(hf: dict[str, SourceMeta], config: dict[str, Any], size: Sizes) -> list[Imported]:
    """Every megatron-core tensor the Hugging Face tensors `hf` make, in the table's order, layer by layer.
    A Hugging Face tensor no row takes is refused: nothing is dropped silently (a tied lm_head aside)."""
    rows = [r for r in FAMILIES[family.architecture(config)] if not (r.local or r.grouped)]
    out: list[Imported] = []
    taken: set[str] = set()
    for row in rows:
        for numbers in _numbers(row, hf):
            names = tuple(t.format(*numbers) for t in row.targets)
            missing = [n for n in names if n not in hf]
            if missing:
                raise LayoutError(f"{names[0]} is there but not {missing[0]}: the model's files are incomplete")
            taken.update(names)
            if size.tied and names == (HEAD,):
                continue  # the embedding is the head (megatron-core ties it: no output_layer is saved)
            out.append(_imported(row, numbers, [hf[n] for n in names], config, size))
    _refuse_untaken(hf, taken, size)
    _refuse_mixed_layers(out, size)
    return out


def _numbers(row: Row, hf: dict[str, SourceMeta]) -> list[tuple[int, ...]]:
    """The layer numbers for which the row's first target is among the Hugging Face names, in numeric order."""
    pattern = base.row_pattern(row.targets[0])
    found = [tuple(int(g) for g in m.groups()) for n in hf if (m := pattern.fullmatch(n))]
    return sorted(found)


def _imported(row: Row, numbers: tuple[int, ...], metas: list[SourceMeta], config: dict[str, Any],
              size: Sizes) -> Imported:
    """One row backwards: the Megatron tensor, its segments, and the forward transform's shapes checked."""
    name = row.source.format(*numbers)
    dtypes = {m.dtype for m in metas}
    if len(dtypes) > 1:
        raise LayoutError(f"{name} would fuse tensors of several dtypes ({', '.join(sorted(dtypes))})")
    rows_of = tuple(m.shape[0] for m in metas)
    rest = tuple(metas[0].shape[1:])
    extra = {"padded": size.padded_vocab} if row.transform == "trim_rows" else {}
    probe = SourceMeta(name=name, dtype=metas[0].dtype, shape=(0, *rest))
    params = family._params(row.transform, probe, base.CAUSAL_LM.sizes(config), Hints())
    segments = tf.inverse_segments(row.transform, rows_of, params, **extra)
    meta = SourceMeta(name=name, dtype=metas[0].dtype, shape=(sum(s.rows for s in segments), *rest))
    want = [tuple(s) for s in family.target_shapes(row.transform, meta, params)]
    have = [tuple(m.shape) for m in metas]
    if want != have:
        raise LayoutError(f"{', '.join(m.name for m in metas)} have shapes {have}, but config.json's sizes make "
                          f"{want}: wrong config.json?")
    return Imported(name=name, sources=tuple(m.name for m in metas), shape=meta.shape, dtype=meta.dtype,
                    segments=segments, parts=TP_PARTS.get(row.transform, 1))


def _refuse_untaken(hf: dict[str, SourceMeta], taken: set[str], size: Sizes) -> None:
    left = sorted(set(hf) - taken)
    if left:
        raise InputError(f"{len(left)} tensor(s) of the model have no Megatron name ({left[0]}, ...): not a "
                         f"model of this architecture, or one distmerge import does not write yet")
    layers = {int(m[1]) for n in hf if (m := re.match(r"model\.layers\.(\d+)\.", n))}
    if layers != set(range(size.layers)):
        raise LayoutError(f"config.json has {size.layers} layers but the model's tensors have "
                          f"{len(layers)}: config.json is another model's, or files are missing")


def _refuse_mixed_layers(made: list[Imported], size: Sizes) -> None:
    """A model whose layers are not all alike (some dense, some MoE: Qwen's mlp_only_layers or
    decoder_sparse_step) is saved by megatron-core layer by layer, not stacked: not written yet. And every MoE
    layer must hold config.json's number of experts."""
    if not size.experts:
        return
    experts: dict[int, set[int]] = {layer: set() for layer in range(size.layers)}
    for t in made:
        if (m := re.match(r"decoder\.layers\.(\d+)\.mlp\.experts\.local_experts\.(\d+)\.", t.name)):
            experts[int(m[1])].add(int(m[2]))
    for layer, found in experts.items():
        if not found:
            raise ConfigError(f"layer {layer} of the model has no experts while config.json has "
                              f"{size.experts}: models mixing dense and MoE layers cannot be imported yet")
        if found != set(range(size.experts)):
            raise LayoutError(f"layer {layer} has experts {sorted(found)[:8]}, but config.json has "
                              f"{size.experts}: config.json is another model's, or files are missing")

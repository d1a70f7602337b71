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
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

from distmerge.errors import ConfigError, InputError, LayoutError
from distmerge.families import base
from distmerge.families import transforms as tf
from distmerge.families.base import SourceMeta
from distmerge.families.megatron import family, mla, mtp
from distmerge.families.megatron.tables import FAMILIES, MTP, Row
from distmerge.formats.base import Hints

# The architectures whose import is written and tested: dense GPTs, MoE ones whose every layer routes over
# experts (a shared expert beside them for Qwen2-MoE), and DeepSeek-V3: multi-latent attention, its first
# first_k_dense_replace layers dense and the others MoE, and its multi-token prediction layers.
IMPORTED = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
            "Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM", "MixtralForCausalLM", "DeepseekV3ForCausalLM")
# config.json's count of routed experts per MoE layer: Qwen2/3-MoE's num_experts, Mixtral's num_local_experts,
# DeepSeek-V3's n_routed_experts
EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts")
# config.json's count of dense layers before the first MoE one (DeepSeek-V3)
FIRST_DENSE = "first_k_dense_replace"
# Architectures written under the local spec's names: megatron-core 0.16.1's local MLA layer spec has no
# sharded_state_dict_keys_map, so its save holds q_layernorm / kv_layernorm / pre_mlp_layernorm as they are (the
# save of tests/fixtures/make_megatron_mla.py), and the TE spelling (a norm fused into the next linear,
# TE_FUSED_NORM) is another layout. The other families' local spec maps its norms to the TE names, which the
# import writes.
LOCAL_NAMES = ("DeepseekV3ForCausalLM",)
TE_FUSED_NORM = ".layer_norm_weight"
# The parts of an MTP layer beside its transformer layer, as megatron-core names them (tables.MTP_OWN)
MTP_OWN_PARTS = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "final_layernorm.weight")
HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
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
    dense_layers: int = 0  # the first layers of an MoE model that keep a dense MLP (DeepSeek-V3's)

    @property
    def per_layer(self) -> bool:
        """Whether megatron-core saves each decoder layer on its own: its layers differ (dense, then MoE)."""
        return bool(self.experts and self.dense_layers)


def padded_vocab(vocab: int, tp: int, divisible_by: int) -> int:
    """Megatron-LM's _vocab_size_with_padding (training/tokenizer): up to a multiple of divisible_by x TP."""
    multiple = divisible_by * tp
    return -(-vocab // multiple) * multiple


def sizes(config: dict[str, Any], tp: int, divisible_by: int) -> Sizes:
    """The sizes, after refusing an architecture not written yet and a TP that does not divide the attention."""
    arch = family.architecture(config)
    if arch not in IMPORTED:
        raise ConfigError(f"config.json's architecture {arch} cannot be imported yet: distmerge import writes "
                          f"{', '.join(IMPORTED)}")
    block = base.CAUSAL_LM.sizes(config)
    heads = base.config_int(block, "num_attention_heads", "Megatron import")
    # multi-latent attention has no query groups: every head has its own keys and values (from the shared latent)
    groups = heads if block.get("kv_lora_rank") else block.get("num_key_value_heads") or heads
    for what, count in (("attention heads", heads), ("query groups (num_key_value_heads)", groups)):
        if count % tp:
            raise ConfigError(f"--tp {tp} does not divide the model's {count} {what}: megatron-core gives each "
                              f"TP rank whole ones; pick a TP that divides {count}")
    vocab = base.config_int(block, "vocab_size", "Megatron import")
    experts = next((base.config_int(block, k, "Megatron import") for k in EXPERT_COUNTS if block.get(k)), 0)
    return Sizes(layers=base.config_int(block, "num_hidden_layers", "Megatron import"), heads=heads, groups=groups,
                 vocab=vocab, padded_vocab=padded_vocab(vocab, tp, divisible_by), tied=base.CAUSAL_LM.ties(config),
                 experts=experts, dense_layers=(block.get(FIRST_DENSE) or 0) if experts else 0)


def megatron_tensors(hf: dict[str, SourceMeta], config: dict[str, Any], size: Sizes) -> list[Imported]:
    """Every megatron-core tensor the Hugging Face tensors `hf` make, in the table's order, layer by layer.
    A Hugging Face tensor no row takes is refused: nothing is dropped silently (a tied lm_head aside, and the copies
    of the embedding and head in multi-token prediction layers: megatron-core's MTP uses the model's own).
    Multi-token prediction layers (Hugging Face layers num_hidden_layers + j) become megatron-core's mtp.layers.{j}."""
    arch = family.architecture(config)
    rows = [r for r in FAMILIES[arch] + MTP.get(arch, ()) if written(r, arch)]
    extra = mtp_layers(hf, config, size)
    out: list[Imported] = []
    taken: set[str] = set(mtp_copies(hf, extra))
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
    _refuse_untaken(hf, taken, size, extra)
    _check_moe_layers(out, size, extra)
    _check_mtp_layers(out, size, extra)
    return [replace(t, name=mla.mtp_megatron_name(t.name, size.layers)) for t in out]


def written(row: Row, arch: str) -> bool:
    """Whether the import writes the row's Megatron name: never grouped GEMM's spelling (torch_dist saves the
    sequential one); the local spec's names for LOCAL_NAMES, the TE names (no `local` row) for the others."""
    if row.grouped:
        return False
    return not row.source.endswith(TE_FUSED_NORM) if arch in LOCAL_NAMES else not row.local


def mtp_layers(hf: dict[str, SourceMeta], config: dict[str, Any], size: Sizes) -> range:
    """The Hugging Face layer numbers of the multi-token prediction layers: num_hidden_layers + j for config.json's
    num_nextn_predict_layers, when the architecture has them (tables.MTP) and the model holds layers past
    num_hidden_layers (a model saved by transformers has none: it builds no module for them, mtp.py)."""
    count = config.get(mtp.COUNT)
    if family.architecture(config) not in MTP or type(count) is not int or count < 1:
        return range(0)
    if not any((m := HF_LAYER.match(n)) and int(m[1]) >= size.layers for n in hf):
        return range(0)
    return range(size.layers, size.layers + count)


def mtp_copies(hf: dict[str, SourceMeta], layers: range) -> Iterator[str]:
    """The copies of the embedding and output head each MTP layer carries (mtp.SHARED), their shapes checked:
    not written, megatron-core's MTP block uses the model's own embedding and output layer."""
    for layer in layers:
        for main, part in mtp.SHARED:
            name = f"model.layers.{layer}.{part}"
            if name not in hf:
                continue
            if main in hf and hf[name].shape != hf[main].shape:
                raise LayoutError(f"{name} has shape {list(hf[name].shape)}, but {main}, which it copies, "
                                  f"{list(hf[main].shape)}: the model's files are inconsistent")
            yield name


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
    transform, params = _forward(row, name, metas[0], config)
    segments = tf.inverse_segments(transform, rows_of, params, **extra)
    meta = SourceMeta(name=name, dtype=metas[0].dtype, shape=(sum(s.rows for s in segments), *rest))
    want = [tuple(s) for s in family.target_shapes(transform, meta, params)]
    have = [tuple(m.shape) for m in metas]
    if want != have:
        raise LayoutError(f"{', '.join(m.name for m in metas)} have shapes {have}, but config.json's sizes make "
                          f"{want}: wrong config.json?")
    return Imported(name=name, sources=tuple(m.name for m in metas), shape=meta.shape, dtype=meta.dtype,
                    segments=segments, parts=TP_PARTS.get(row.transform, 1))


def _forward(row: Row, name: str, first: SourceMeta, config: dict[str, Any]) -> tuple[str, tf.Params]:
    """The forward transform of the row and its parameters, as the export resolves them (family._units): an MLA
    projection's (identity, or the rope permutation) from its shape, which the Hugging Face tensor shares; the
    others' from config.json alone."""
    sizes = base.CAUSAL_LM.sizes(config)
    if row.transform == mla.MLA:
        return mla.resolve(SourceMeta(name=name, dtype=first.dtype, shape=first.shape), sizes)
    probe = SourceMeta(name=name, dtype=first.dtype, shape=(0, *first.shape[1:]))
    return row.transform, family._params(row.transform, probe, sizes, Hints())


def _refuse_untaken(hf: dict[str, SourceMeta], taken: set[str], size: Sizes, extra: range) -> None:
    """The layers first (a layer config.json does not count says more than the names it leaves untaken), then any
    tensor no row took."""
    layers = {int(m[1]) for n in hf if (m := HF_LAYER.match(n))}
    if layers != set(range(size.layers)) | set(extra):
        mtps = f" and {len(extra)} multi-token prediction layer(s)" if extra else ""
        raise LayoutError(f"config.json has {size.layers} layers{mtps} but the model's tensors have "
                          f"{len(layers)}: config.json is another model's, or files are missing")
    left = sorted(set(hf) - taken)
    if left:
        raise InputError(f"{len(left)} tensor(s) of the model have no Megatron name ({left[0]}, ...): not a "
                         f"model of this architecture, or one distmerge import does not write yet")


def _check_moe_layers(made: list[Imported], size: Sizes, extra: range) -> None:
    """Every MoE layer holds config.json's number of experts, and the layers that route are the ones config.json
    says: all of them, or all after the first first_k_dense_replace (DeepSeek-V3; its MTP layers route, built
    like the last decoder layer). Other mixes of dense and MoE layers (Qwen's mlp_only_layers or
    decoder_sparse_step) are refused: not written yet."""
    if not size.experts:
        return
    experts: dict[int, set[int]] = {layer: set() for layer in (*range(size.layers), *extra)}
    for t in made:
        if (m := re.match(r"decoder\.layers\.(\d+)\.mlp\.experts\.local_experts\.(\d+)\.", t.name)):
            experts[int(m[1])].add(int(m[2]))
    for layer, found in experts.items():
        if layer < size.dense_layers:
            if found:
                raise LayoutError(f"layer {layer} has experts, but config.json's {FIRST_DENSE} "
                                  f"{size.dense_layers} makes it dense: config.json is another model's")
            continue
        if not found and size.dense_layers:
            raise LayoutError(f"layer {layer} has no experts, but config.json's {FIRST_DENSE} "
                              f"{size.dense_layers} makes only the layers before it dense: config.json is "
                              "another model's")
        if not found:
            raise ConfigError(f"layer {layer} of the model has no experts while config.json has "
                              f"{size.experts}: models mixing dense and MoE layers cannot be imported yet")
        if found != set(range(size.experts)):
            raise LayoutError(f"layer {layer} has experts {sorted(found)[:8]}, but config.json has "
                              f"{size.experts}: config.json is another model's, or files are missing")


def _check_mtp_layers(made: list[Imported], size: Sizes, extra: range) -> None:
    """Each MTP layer holds the tensors of the last decoder layer (megatron-core builds it from that layer's spec)
    and its own (mtp.OWN): a part missing would load into nothing."""
    def parts(prefix: str) -> set[str]:
        return {t.name[len(prefix):] for t in made if t.name.startswith(prefix)}

    last = parts(f"decoder.layers.{size.layers - 1}.")
    for layer in extra:
        mine = parts(f"decoder.layers.{layer}.")
        own = parts(f"mtp.layers.{layer}.")
        differ = sorted(last ^ mine) or sorted(set(MTP_OWN_PARTS) - own)
        if differ:
            raise LayoutError(f"multi-token prediction layer {layer} (model.layers.{layer}.*) differs from the last "
                              f"decoder layer or lacks its own parts at {differ[0]}: the model's files are incomplete")

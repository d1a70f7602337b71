"""Hugging Face tensors -> torchtitan's tensors: the family's table (tables.py) read backwards.

A row says which Hugging Face tensor a torchtitan tensor becomes, and through which transform (family.py walks it
that way, for a merge). Read from its target to its source, with the transform's inverse (catalog.INVERSES:
rope_interleave_rows beside rope_permute), the same row says which torchtitan tensor the Hugging Face tensor makes,
as rows of it (transforms.Segment). Only the names torchtitan 0.3.0 saves are written (the rows of generation
"0.3" or of both); the forward direction's shape check (family._check_shape) judges each Hugging Face tensor.

torchtitan saves `lm_head.weight` beside `tok_embeddings.weight` when the model ties them (its state dict holds
both names), so a tied model's head is written as a copy of the embedding: the inverse of family._tie, which
drops that copy on export.

MoE (Qwen3-MoE): torchtitan stacks a layer's experts on a leading axis (`w1_EFD` [E, F, D], `w3_EFD`, `w2_EDF`
[E, D, F]); a merge reads them one expert at a time (`<name>.<e>`, formats/torchtitan.py). Backwards, the row's E
Hugging Face tensors make one stacked tensor, expert e's rows after expert e-1's, none transposed. The
load-balancing bias `expert_bias_E`, which Hugging Face has no place for, is written as torchtitan initializes it
(the row's `init`): a tensor with no sources (the writer makes it, write.py).

DeepSeek-V3 (torchtitan's deepseek_v3): MLA's rows as they are, or with their rotary rows put in pairs when
config.json's rope_interleave is false (family.row_transform); the first first_k_dense_replace layers dense, the
others MoE with stacked experts, a shared expert and Hugging Face's e_score_correction_bias as expert_bias_E; the
multi-token prediction layers, Hugging Face layer num_hidden_layers + j, as torchtitan's mtp_layers.{j} (its
state_dict_adapter), without their copies of the embedding and head (its MTP uses the model's own).
"""

from __future__ import annotations

import re
from typing import Any

from distmerge.errors import ConfigError, InputError, LayoutError
from distmerge.families import base
from distmerge.families import transforms as tf
from distmerge.families.base import SourceMeta
from distmerge.families.megatron import mtp
from distmerge.families.megatron.inverse import Imported, mtp_copies
from distmerge.families.torchtitan import family
from distmerge.families.torchtitan.tables import FAMILIES, Row

# The architectures whose import is written and tested: torchtitan 0.3.0's llama3, qwen3 and its MoE flavors,
# deepseek_v3.
IMPORTED = ("LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "DeepseekV3ForCausalLM")
DEEPSEEK = "DeepseekV3ForCausalLM"
STACKED = ".{}"  # a row source's tail that numbers the expert of a stacked tensor (tables.py)
ROUTER = "model.layers.{}.mlp.gate.weight"  # the Hugging Face router: its layers are the MoE layers
DENSE = "model.layers.{}.mlp.gate_proj.weight"  # a dense layer's MLP
HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
FIRST_DENSE = "first_k_dense_replace"  # DeepSeek-V3's count of dense first layers
HEAD, EMBEDDING = family.HEAD, family.EMBEDDING


def architecture(config: dict[str, Any]) -> str:
    """The table's architecture, or ConfigError in one line for a model torchtitan (or this import) lacks."""
    archs = config.get("architectures") or [config.get("model_type")]
    try:
        arch = family.architecture(config)
    except ConfigError:
        raise ConfigError(f"config.json's architecture {archs[0]} has no torchtitan model: --to torchtitan writes "
                          f"{', '.join(IMPORTED)}") from None
    if arch not in IMPORTED:
        raise ConfigError(f"config.json's architecture {arch} cannot be imported to torchtitan yet: --to torchtitan "
                          f"writes {', '.join(IMPORTED)}")
    return arch


def torchtitan_tensors(hf: dict[str, SourceMeta], config: dict[str, Any]) -> list[Imported]:
    """Every torchtitan tensor the Hugging Face tensors `hf` make, in the table's order, layer by layer. A Hugging
    Face tensor no row takes is refused: nothing is dropped silently."""
    arch = architecture(config)
    size = family.sizes(config, arch)
    _refuse_head_dim(arch, size)
    tied = base.CAUSAL_LM.ties(config)
    layers = base.config_int(size, "layers", "torchtitan")
    extra = mtp_layers(hf, config, layers)
    _refuse_dense_layers(arch, hf, config, layers)
    out: list[Imported] = []
    taken: set[str] = set(mtp_copies(hf, extra))  # torchtitan's MTP layers use the model's own embedding and head
    for row in FAMILIES[arch]:
        if row.gen == "0.2":
            continue  # torchtitan 0.3.0 saves the 0.3 names
        if row.target is None:
            out += _initialized(row, hf, size)
            continue
        found = [n for n in _numbers(row.target, hf) if row.mtp == _in_mtp(n, layers)]
        shift = layers if row.mtp else 0  # Hugging Face layer num_hidden_layers + j is torchtitan's mtp_layers.j
        taken.update(row.target.format(*n) for n in found)
        if row.source.endswith(STACKED):
            out += _stacked(row, found, hf, size, shift)
        else:
            out += [_imported(row, numbers, hf[row.target.format(*numbers)], size, config, shift)
                    for numbers in found]
        if row.target == HEAD and HEAD not in hf and tied and EMBEDDING in hf:
            out.append(_imported(row, (), hf[EMBEDDING], size, config))  # torchtitan's tied head: the embedding again
    _refuse_untaken(hf, taken, layers, extra)
    return out


def mtp_layers(hf: dict[str, SourceMeta], config: dict[str, Any], layers: int) -> range:
    """The Hugging Face layer numbers of DeepSeek-V3's multi-token prediction layers, num_hidden_layers + j for
    config.json's num_nextn_predict_layers, when the model holds layers past num_hidden_layers (a model saved by
    transformers has none: it builds no module for them, families/megatron/mtp.py). torchtitan's deepseek_v3 keeps
    them as mtp_layers.{j} (its state_dict_adapter: _map_from_hf_layer_key)."""
    count = config.get(mtp.COUNT)
    if family.architecture(config) != DEEPSEEK or type(count) is not int or count < 1:
        return range(0)
    if not any((m := HF_LAYER.match(n)) and int(m[1]) >= layers for n in hf):
        return range(0)
    return range(layers, layers + count)


def _in_mtp(numbers: tuple[int, ...], layers: int) -> bool:
    """Whether a row's numbers (the layer first) are past the decoder's layers: an MTP layer's."""
    return bool(numbers) and numbers[0] >= layers


def _refuse_head_dim(arch: str, size: dict[str, int | None]) -> None:
    """torchtitan's llama3 has no head_dim of its own: its attention heads are dim / n_heads wide."""
    hidden, heads, hd = size["hidden"], size["heads"], size["head_dim"]
    if arch == "LlamaForCausalLM" and hidden and heads and hd != hidden // heads:
        raise ConfigError(f"config.json's head_dim {hd} is not hidden_size / num_attention_heads = {hidden // heads}: "
                          "torchtitan's llama3 makes each head dim / n_heads wide, so it cannot hold this model")


def _refuse_dense_layers(arch: str, hf: dict[str, SourceMeta], config: dict[str, Any], layers: int) -> None:
    """torchtitan's qwen3 MoE flavors make every layer MoE (qwen3/__init__.py, _build_qwen3_moe_layers): a
    Qwen3-MoE with dense layers (mlp_only_layers, decoder_sparse_step) has no torchtitan model. Its deepseek_v3
    makes the first n_dense_layers dense and every later one MoE (_build_dsv3_layers), as Hugging Face's
    first_k_dense_replace does: a DeepSeek-V3 whose dense decoder layers are not exactly those is another model."""
    dense = [n[0] for n in _numbers(DENSE, hf)]
    if arch == "Qwen3MoeForCausalLM" and dense:
        raise ConfigError(f"layer {dense[0]} of this Qwen3-MoE is dense (mlp_only_layers or decoder_sparse_step): "
                          "torchtitan's qwen3 makes every layer of a MoE model MoE, so it cannot hold this model")
    if arch != DEEPSEEK:
        return
    first = config.get(FIRST_DENSE, 0)
    routed = {n[0] for n in _numbers(ROUTER, hf) if n[0] < layers}
    dense_main = {layer for layer in dense if layer < layers}
    if dense_main != set(range(first)) or routed != set(range(first, layers)):
        odd = min((dense_main ^ set(range(first))) | (routed ^ set(range(first, layers))))
        raise LayoutError(f"layer {odd} is {'dense' if odd in dense_main else 'MoE'} but config.json's "
                          f"{FIRST_DENSE} {first} makes the first {first} layers dense and the rest MoE, as "
                          "torchtitan's deepseek_v3 does: config.json is another model's")


def _numbers(target: str, hf: dict[str, SourceMeta]) -> list[tuple[int, ...]]:
    """The layer numbers for which the row's Hugging Face name is among `hf`, in numeric order."""
    pattern = base.row_pattern(target)
    return sorted(tuple(int(g) for g in m.groups()) for n in hf if (m := pattern.fullmatch(n)))


def _imported(row: Row, numbers: tuple[int, ...], meta: SourceMeta, size: dict[str, int | None],
              config: dict[str, Any], shift: int = 0) -> Imported:
    """One row backwards: the torchtitan tensor made of the rows of one Hugging Face tensor, through the inverse of
    the row's transform (family.row_transform); `shift`: what the Hugging Face layer number is past torchtitan's
    (an MTP layer's, num_hidden_layers)."""
    name = row.source.format(*_shifted(numbers, shift))
    family._check_shape(meta, row.target.format(*numbers) if row.target else name, row, size)
    transform, params = family.row_transform(row, size, config)
    segments = tf.inverse_segments(transform, (meta.shape[0],), params)
    return Imported(name=name, sources=(meta.name,), shape=tuple(meta.shape), dtype=meta.dtype, segments=segments)


def _shifted(numbers: tuple[int, ...], shift: int) -> tuple[int, ...]:
    """A row's Hugging Face numbers as torchtitan's: the layer less `shift`, the expert as it is."""
    return (numbers[0] - shift, *numbers[1:]) if numbers else numbers


def _stacked(row: Row, found: list[tuple[int, ...]], hf: dict[str, SourceMeta],
             size: dict[str, int | None], shift: int = 0) -> list[Imported]:
    """One stacked tensor per layer: its experts' Hugging Face tensors one after another on a new leading axis.
    Every expert 0..E-1 of config.json must be there: torchtitan's tensor is E experts long."""
    experts = base.config_int(size, "experts", "torchtitan")
    by_layer: dict[int, list[int]] = {}
    for layer, expert in found:
        by_layer.setdefault(layer, []).append(expert)
    out = []
    for layer, numbers in sorted(by_layer.items()):
        if numbers != list(range(experts)):
            raise LayoutError(f"config.json has {experts} experts but layer {layer} has {len(numbers)} of "
                              f"{row.target.format(layer, '{}')}: config.json is another model's, or files are "
                              "missing")
        metas = [hf[row.target.format(layer, e)] for e in numbers]
        for meta in metas:
            family._check_shape(meta, meta.name, row, size)
        first = metas[0]
        segments = tuple(tf.Segment(source=e, start=0, count=first.shape[0]) for e in range(experts))
        name = row.source[: -len(STACKED)].format(layer - shift)
        out.append(Imported(name=name, sources=tuple(m.name for m in metas),
                            shape=(experts, *first.shape), dtype=first.dtype, segments=segments))
    return out


def _initialized(row: Row, hf: dict[str, SourceMeta], size: dict[str, int | None]) -> list[Imported]:
    """A row Hugging Face has no tensor for, in each MoE layer (those with a router), as torchtitan initializes
    it; a row with no `init` (one torchtitan 0.3.0 does not keep) makes nothing."""
    if not row.init:
        return []
    assert row.init == "zeros", row.init  # the one init a table declares (tables._moe's expert_bias_E)
    layers = [n[0] for n in _numbers(ROUTER, hf)]
    experts = base.config_int(size, "experts", "torchtitan")
    # float32 whatever the model's dtype: torchtitan registers the buffer so (common/moe.py)
    return [Imported(name=row.source.format(layer), sources=(), shape=(experts,), dtype="F32", segments=())
            for layer in layers]


def _refuse_untaken(hf: dict[str, SourceMeta], taken: set[str], want: int, extra: range) -> None:
    left = sorted(set(hf) - taken)
    if left:
        raise InputError(f"{len(left)} tensor(s) of the model have no torchtitan name ({left[0]}, ...): not a "
                         "model of this architecture, or one distmerge import does not write yet")
    layers = {int(m[1]) for n in hf if (m := HF_LAYER.match(n))}
    if layers != set(range(want)) | set(extra):
        mtps = f" and {len(extra)} multi-token prediction layer(s)" if extra else ""
        raise LayoutError(f"config.json has {want} layers{mtps} but the model's tensors have {len(layers)}: "
                          "config.json is another model's, or files are missing")

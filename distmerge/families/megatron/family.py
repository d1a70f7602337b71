"""Megatron-core tensors (global, as the Megatron formats present them) -> Hugging Face units.

The family's table (tables.py) says which Hugging Face tensors each Megatron tensor becomes and
through which transform; this module finds the row of every source, fills in the layer/expert numbers,
computes the transform's parameters from config.json (and the format's details), and checks the shapes
so that a wrong config is an error before anything is read.
"""

from __future__ import annotations

import re
from functools import cache
from typing import Any

from distmerge.errors import InputError, LayoutError
from distmerge.families import base, value_head
from distmerge.families.base import FamilyContext, FamilyResult, SourceMeta, Target, Unit, output_dtype
from distmerge.families.megatron import mla, mtp
from distmerge.families.megatron.tables import FAMILIES, FLOAT32_TARGETS, LAYERS, MODEL_TYPES, MTP, Row
from distmerge.families.megatron.transforms import SplitGateUp, SplitQkv
from distmerge.families.transforms import NO_PARAMS, Params, TrimRows
from distmerge.formats.base import Hints

HEAD = base.CAUSAL_LM.tied_heads[0][0]



def units(sources: dict[str, SourceMeta], ctx: FamilyContext) -> FamilyResult:
    refuse_vision_language(sources, ctx.config)
    head = value_head.megatron_head(sources)  # a critic's one-row output layer: written as a value head
    if not head:
        refuse_head_config(sources, ctx.config)
        return _units(sources, ctx, lm_head=True)
    body = _units({n: s for n, s in sources.items() if n not in head}, ctx, lm_head=False)
    hidden = base.CAUSAL_LM.sizes(ctx.config).get("hidden_size")
    return value_head.with_megatron_head(body, sources, ctx, hidden if isinstance(hidden, int) else None)


def refuse_vision_language(sources: dict[str, SourceMeta], config: dict[str, Any]) -> None:
    """Megatron's vision-language models keep the tower (`vision_model.*`, `vision_projection.*`) beside
    `language_model.*`, with the tower's layers numbered apart from the language model's pipeline stages: no
    table maps them yet, and a text-only merge would silently write half a model."""
    tower = sorted(n for n in sources if n.startswith(("vision_model.", "vision_projection.")))
    if tower or isinstance(config.get("vision_config"), dict):
        what = f"its vision tower ({tower[0]}, ...)" if tower else "config.json's vision_config"
        raise InputError(f"a Megatron vision-language save ({what}): distmerge has no mapping for Megatron's "
                         "vision tower and projector yet (Megatron-Bridge's export converts it)")


def refuse_head_config(sources: dict[str, SourceMeta], config: dict[str, Any]) -> None:
    """A config.json that names a value model (Qwen2ForTokenClassification) over a language model's weights:
    the written model would not load as either."""
    arch = (config.get("architectures") or [""])[0]
    if base.body_class(arch) != arch:
        out = sources.get(value_head.MEGATRON_WEIGHT)
        what = f"an output layer of {out.shape[0]} rows" if out else "no output layer (tied embeddings)"
        raise LayoutError(f"config.json names {arch}, a value model, but the checkpoint has {what}: a language "
                          "model's; pass the actor's config.json with --hf-config")


def _units(sources: dict[str, SourceMeta], ctx: FamilyContext, lm_head: bool) -> FamilyResult:
    arch = architecture(ctx.config)
    rows = _compiled(arch)
    tied = base.CAUSAL_LM.ties(ctx.config)
    sizes = base.CAUSAL_LM.sizes(ctx.config)
    # multi-token prediction layers are found by the rows of the decoder layer they are built like
    aliases = mla.mtp_aliases(sources, sizes, arch in MTP)
    out, notes = [], []
    for meta, row, numbers in base.matched_rows(sources, rows, "Megatron", arch, aliases):
        names = tuple(t.format(*numbers) for t in row.targets)
        if tied and names == (HEAD,):
            notes.append("output_layer.weight not written: config.json ties it to the embedding")
            continue
        transform, params = (mla.resolve(meta, sizes) if row.transform == mla.MLA
                             else (row.transform, _params(row.transform, meta, sizes, ctx.hints)))
        shapes = target_shapes(transform, meta, params)
        float32 = ctx.cast and names[0].endswith(FLOAT32_TARGETS.get(arch, ()))
        dtype = output_dtype(meta.dtype, "F32" if float32 else ctx.cast)
        targets = tuple(Target(name=n, shape=s, dtype=dtype) for n, s in zip(names, shapes, strict=True))
        out.append(Unit(sources=(meta.name,), targets=targets, transform=transform, params=params))
    _check_complete([u for u in out if u.sources[0] not in aliases], sizes, tied or not lm_head, arch)
    layers = {int(m[1]) for u in out if u.sources[0] in aliases for t in u.targets if (m := mtp.LAYER.match(t.name))}
    out, updates, mtp_notes = mtp.finish(out, layers, sizes)
    padded = sources.get("embedding.word_embeddings.weight")
    if padded and padded.shape[0] != sizes.get("vocab_size"):
        notes.append(f"vocabulary padding trimmed: {padded.shape[0]} -> {sizes['vocab_size']} rows")
    return FamilyResult(units=out, notes=notes + mtp_notes, config_updates=updates)


def architecture(config: dict[str, Any]) -> str:
    return base.table_for(config, FAMILIES, MODEL_TYPES, "Megatron", heads=True)


@cache
def _compiled(arch: str) -> list[tuple[Row, re.Pattern[str]]]:
    return base.compile_rows(FAMILIES[arch] + MTP.get(arch, ()))


def _params(transform: str, meta: SourceMeta, config: dict[str, Any], hints: Hints) -> Params:
    """The transform's parameters: attention sizes and vocabulary from config.json, shard layout from the format."""
    if transform == "split_qkv":
        heads = base.config_int(config, "num_attention_heads", "Megatron")
        groups = config.get("num_key_value_heads") or heads
        head_dim = config.get("head_dim") or base.config_int(config, "hidden_size", "Megatron") // heads
        return SplitQkv(heads=heads, groups=groups, head_dim=head_dim)
    if transform == "split_gate_up":
        return SplitGateUp(shards=hints.expert_fc1_shards if ".experts." in meta.name else hints.fc1_shards)
    if transform == "trim_rows":
        return TrimRows(rows=base.config_int(config, "vocab_size", "Megatron"))
    return NO_PARAMS


def target_shapes(transform: str, meta: SourceMeta, params: Params) -> list[tuple[int, ...]]:
    """Shapes the transform will produce, checked against the source before any byte moves."""
    rows, *rest = meta.shape
    rest = tuple(rest)
    if isinstance(params, SplitQkv):
        heads, groups, head_dim = params.heads, params.groups, params.head_dim
        per_group = heads // groups
        if rows != groups * (per_group + 2) * head_dim or heads % groups:
            raise LayoutError(f"{meta.name} has {rows} rows, but config.json's {heads} heads, {groups} "
                              f"key/value heads and head_dim {head_dim} need "
                              f"{(heads + 2 * groups) * head_dim}: wrong config.json?")
        kv = (groups * head_dim, *rest)
        return [(heads * head_dim, *rest), kv, kv]
    if isinstance(params, SplitGateUp):
        if rows % (2 * params.shards):
            raise LayoutError(f"{meta.name} has {rows} rows: not gate and up halves of {params.shards} shards")
        return [(rows // 2, *rest)] * 2
    if isinstance(params, TrimRows):
        if rows < params.rows:
            raise LayoutError(f"{meta.name} has {rows} rows but config.json's vocab_size is {params.rows}: "
                              "wrong config.json?")
        return [(params.rows, *rest)]
    return [meta.shape]


def _check_complete(out: list[Unit], config: dict[str, Any], tied: bool, arch: str) -> None:
    names = {t.name for u in out for t in u.targets}
    layer = base.row_pattern(LAYERS)
    layers = {int(m[1]) for n in names if (m := layer.match(n))}
    expected = config.get("num_hidden_layers")
    if isinstance(expected, int) and layers != set(range(expected)):
        missing = sorted(set(range(expected)) - layers)[:8]
        extra = sorted(layers - set(range(expected)))[:8]
        raise LayoutError(f"config.json has {expected} layers but the checkpoint's layers differ (missing "
                          f"{missing or 'none'}, beyond {extra or 'none'}): a pipeline stage is missing or "
                          "config.json is another model's")
    if not tied and HEAD not in names:
        raise LayoutError(f"config.json does not tie embeddings but the checkpoint has no output_layer ({arch}): "
                          "was it trained with tied embeddings? fix tie_word_embeddings in config.json")



MEGATRON = base.NamingFamily(name="megatron", naming="megatron", order=20, build=units)

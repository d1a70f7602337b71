"""torchtitan tensors (as formats/torchtitan.py presents them: stacked experts one per expert) -> Hugging Face units.

The table (tables.py) is picked from config.json's architecture; every source must find a row
(or the merge stops naming it), every target's shape is checked against config.json's sizes, the layers
and each MoE layer's experts are counted, all before any byte moves. Rows with no target are left out with
their reason; a head the config ties is not written but declared a copy of the embedding: the engine
reports the first with their largest magnitude and checks the second for equality (unwritten.py).
"""

from __future__ import annotations

import re
from collections import defaultdict
from functools import cache
from typing import Any

from distmerge.errors import InputError, LayoutError
from distmerge.families import base
from distmerge.families.base import FamilyContext, FamilyResult, SourceMeta, Target, Unit, output_dtype
from distmerge.families.megatron import mla, mtp
from distmerge.families.megatron.transforms import MlaRopeHalves
from distmerge.families.torchtitan.tables import FAMILIES, MODEL_TYPES, SHAPES, Row
from distmerge.families.torchtitan.transforms import RopePermute
from distmerge.families.transforms import NO_PARAMS, Params

HEAD, EMBEDDING = base.CAUSAL_LM.tied_heads[0]
LAYER = re.compile(r"^model\.layers\.(\d+)\.(.*)$")
EXPERT = re.compile(r"^(.*\bexperts\.)(\d+)(\..*)$")



def units(sources: dict[str, SourceMeta], ctx: FamilyContext) -> FamilyResult:
    arch = architecture(ctx.config)
    size = sizes(ctx.config, arch)
    tied = base.CAUSAL_LM.ties(ctx.config)
    out, left_out, written = [], {}, {}
    for meta, row, groups in base.matched_rows(sources, _compiled(arch), "torchtitan", arch):
        numbers = tuple(int(g) for g in groups)
        if row.target is None:
            left_out[meta.name] = row.why
            continue
        if row.mtp:
            numbers = (base.config_int(size, "layers", "torchtitan") + numbers[0], *numbers[1:])
        target = row.target.format(*numbers)
        if target in written:
            raise InputError(f"{meta.name} and {written[target]} both map to {target}: mixed name generations?")
        written[target] = meta.name
        _check_shape(meta, target, row, size)
        transform, params = row_transform(row, size, ctx.config)
        out.append(Unit(sources=(meta.name,), targets=(Target(name=target, shape=meta.shape,
                                                               dtype=output_dtype(meta.dtype, ctx.cast)),),
                        transform=transform, params=params))
    out, must_equal = _tie(out, written, tied)
    _check_counts(written, size, arch)
    # MTP layers also carry the embedding and the head, as DeepSeek-V3's checkpoint does (families/megatron/mtp.py)
    layers = {int(m[1]) for t, s in written.items() if s.startswith("mtp_") and (m := LAYER.match(t))}
    out, updates, notes = mtp.finish(out, layers, base.CAUSAL_LM.sizes(ctx.config))
    return FamilyResult(units=out, left_out=left_out, must_equal=must_equal, config_updates=updates, notes=notes)


def row_transform(row: Row, size: dict[str, int | None], config: dict[str, Any]) -> tuple[str, Params]:
    """A row's transform (torchtitan -> Hugging Face) and its parameters: llama3's wq and wk from interleaved rotary
    pairs to halves (rope_permute, over the row's heads); DeepSeek-V3's MLA rows with rotary ones (row.rope_rows)
    from interleaved pairs, which torchtitan's ComplexRoPE rotates, to halves when config.json says
    rope_interleave false (mla_rope_halves, the permutation megatron-core's MLA needs too: families/megatron/
    mla.py); otherwise the row's transform as it is."""
    if row.heads:
        return row.transform, RopePermute(heads=base.config_int(size, row.heads, "torchtitan"))
    if row.rope_rows and not mla.rope_interleaved(config):
        heads, keep = (size["heads"], size["nope"]) if row.rope_rows == "q" else (1, size["kv_lora"])
        rope = base.config_int(size, "rope", "torchtitan")
        return "mla_rope_halves", MlaRopeHalves(heads=heads, keep=keep, rope=rope)
    return row.transform, NO_PARAMS


def architecture(config: dict[str, Any]) -> str:
    return base.table_for(config, FAMILIES, MODEL_TYPES, "torchtitan")


def sizes(config: dict[str, Any], arch: str) -> dict[str, int | None]:
    """The sizes SHAPES and the transforms speak of, from config.json (None where it does not say)."""
    c = base.CAUSAL_LM.sizes(config)
    heads, hidden = c.get("num_attention_heads"), c.get("hidden_size")
    kv = c.get("num_key_value_heads") or heads
    hd = c.get("head_dim") or (hidden // heads if hidden and heads else None)
    out = dict(vocab=c.get("vocab_size"), hidden=hidden, heads=heads, kv_heads=kv, head_dim=hd,
               layers=c.get("num_hidden_layers"), ffn=c.get("intermediate_size"),
               moe_ffn=c.get("moe_intermediate_size"),
               experts=c.get("num_experts") or c.get("num_local_experts") or c.get("n_routed_experts"),
               two_hidden=2 * hidden if hidden else None)
    out.update(q_rows=_mul(heads, hd), kv_rows=_mul(kv, hd), o_cols=_mul(heads, hd))
    if arch == "DeepseekV3ForCausalLM":  # latent attention: per-head widths of its own, no head_dim
        nope, rope, v = c.get("qk_nope_head_dim"), c.get("qk_rope_head_dim"), c.get("v_head_dim")
        out.update(q_rows=_mul(heads, nope + rope if nope and rope else None), o_cols=_mul(heads, v),
                   q_lora=c.get("q_lora_rank"), kv_lora=c.get("kv_lora_rank"), nope=nope, rope=rope,
                   kv_a_rows=(c.get("kv_lora_rank") or 0) + rope if rope else None,
                   kv_b_rows=_mul(heads, nope + v if nope and v else None),
                   shared_ffn=_mul(c.get("moe_intermediate_size"), c.get("n_shared_experts")),
                   mtp=c.get("num_nextn_predict_layers"))
    return out


def _mul(a: int | None, b: int | None) -> int | None:
    return a * b if isinstance(a, int) and isinstance(b, int) else None


@cache
def _compiled(arch: str) -> list[tuple[Row, re.Pattern[str]]]:
    return base.compile_rows(FAMILIES[arch])


def shape_key(target: str) -> str:
    """The SHAPES key of a target: no layer prefix, `{}` for the expert number."""
    m = LAYER.match(target)
    rest = m[2] if m else target
    e = EXPERT.match(rest)
    return f"{e[1]}{{}}{e[3]}" if e else rest


def _check_shape(meta: SourceMeta, target: str, row: Row, size: dict[str, int | None]) -> None:
    names = SHAPES[shape_key(target)]
    want = tuple(size.get(n) for n in names)
    if len(meta.shape) != len(want) or any(w is not None and w != s for w, s in zip(want, meta.shape, strict=True)):
        shown = ", ".join(f"{n}={w}" for n, w in zip(names, want, strict=True))
        raise LayoutError(f"{meta.name} has shape {list(meta.shape)}, but config.json's sizes make {target} "
                          f"[{shown}]: wrong config.json?")
    if row.transform == "rope_permute":
        n, hd = size[row.heads], size["head_dim"]
        if not hd or hd % 2 or meta.shape[0] != n * hd:
            raise LayoutError(f"{meta.name}: {meta.shape[0]} rows are not {n} heads of an even head_dim {hd}: "
                              "wrong config.json?")


def _tie(out: list[Unit], written: dict[str, str], tied: bool) -> tuple[list[Unit], tuple[tuple[str, str], ...]]:
    """A tied config writes no head: torchtitan saves it beside the embedding, so it must be a copy of it."""
    if not tied:
        if HEAD not in written:
            raise LayoutError("config.json does not tie embeddings but the checkpoint has no lm_head (output) "
                              "weight: was it trained tied? set tie_word_embeddings in config.json")
        return out, ()
    if HEAD not in written:
        return out, ()
    if EMBEDDING not in written:
        raise LayoutError("config.json ties the head to the embedding, but the checkpoint has no tok_embeddings")
    head = written.pop(HEAD)
    return [u for u in out if u.sources != (head,)], ((head, written[EMBEDDING]),)


def _check_counts(written: dict[str, str], size: dict[str, int | None], arch: str) -> None:
    """Layers 0..n-1 (then the MTP layers n..), and every expert of every MoE layer, each projection."""
    n = base.config_int(size, "layers", "torchtitan")
    main = _layers(t for t, s in written.items() if not s.startswith("mtp_"))
    mtp = _layers(t for t, s in written.items() if s.startswith("mtp_"))
    if main != set(range(n)):
        missing, extra = sorted(set(range(n)) - main)[:8], sorted(main - set(range(n)))[:8]
        raise LayoutError(f"config.json has {n} layers but the checkpoint's differ (missing {missing or 'none'}, "
                          f"beyond {extra or 'none'}): config.json is another model's ({arch})")
    if mtp and (mtp != set(range(n, n + len(mtp))) or size.get("mtp") not in (None, len(mtp))):
        raise LayoutError(f"the checkpoint has {len(mtp)} multi-token-prediction layers but config.json's "
                          f"num_nextn_predict_layers is {size.get('mtp')}: fix config.json")
    experts: dict[str, set[int]] = defaultdict(set)  # stacked source -> the experts found in it
    for t, source in written.items():
        if (m := LAYER.match(t)) and (e := EXPERT.match(m[2])):
            experts[source.rsplit(".", 1)[0]].add(int(e[2]))
    want = set(range(base.config_int(size, "experts", "torchtitan"))) if experts else set()
    for stacked, found in sorted(experts.items()):
        if found != want:
            raise LayoutError(f"{stacked} holds experts {sorted(found)[:8]}, but config.json has {len(want)}: "
                              "every expert must be in the checkpoint (is config.json this model's?)")


def _layers(targets) -> set[int]:
    return {int(m[1]) for t in targets if (m := LAYER.match(t))}



TORCHTITAN = base.NamingFamily(name="torchtitan", naming="torchtitan", order=25, build=units)

"""PEFT LoRA state dicts (verl saves the PEFT-wrapped model): a base model plus an adapter, or fused weights.

    base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight       W (out, in)
    base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight   A (r, in)
    base_model.model.model.layers.0.self_attn.q_proj.lora_B.default.weight   B (out, r)
    base_model.model.model.embed_tokens.weight                               (not adapted)

--lora adapter (the default): the base model under Hugging Face names (`base_model.model.` and
`.base_layer` removed) + lora_adapter/adapter_model.safetensors (PEFT's saved names: the adapter name
dropped) + adapter_config.json. --lora merge: one tensor per adapted module, W + (B @ A) * scale fused on
the owning rank in float32, scale = alpha / r (alpha / sqrt(r) with rsLoRA).

LoRA-only saves (verl's checkpoint.save_lora_only keeps the keys holding `lora_`; the HF Trainer's DeepSpeed
save of a PEFT model keeps the trainable parameters) hold A and B but no W. Their base comes from
--base-model DIR (FamilyContext.base_weights, lora/base.py); without it only the adapter is written.
"""

from __future__ import annotations

import math
import re
from collections.abc import Collection
from dataclasses import replace
from typing import Any

from distmerge.errors import InputError
from distmerge.families.base import (
    CAUSAL_LM,
    FamilyContext,
    FamilyResult,
    ModelTraits,
    SourceMeta,
    Target,
    Unit,
    claim,
)
from distmerge.families.lora import base as lora_base
from distmerge.families.lora.base import PEFT_PREFIX
from distmerge.families.lora.transforms import LoraFuse
from distmerge.formats.base import Hints

LORA = re.compile(r"^(?P<module>.+)\.lora_(?P<ab>[AB])\.(?P<adapter>[^.]+)\.weight$")
ADAPTER_DIR = "lora_adapter"
# PEFT variants whose tensors this family does not turn into a model: refused, never silently dropped.
UNSUPPORTED = {
    ".lora_embedding_": "LoRA on embedding layers",
    ".lora_magnitude_vector": "DoRA (magnitude vectors)",
    ".modules_to_save.": "modules_to_save (fully trained module copies)",
}


def has_lora(names: Collection[str]) -> bool:
    return any(LORA.match(n) for n in names)


def hf_name(name: str) -> str:
    return name.removeprefix(PEFT_PREFIX).replace(".base_layer.", ".")


def adapter_name(name: str) -> str:
    """PEFT's saved name: the adapter name (`default`) is not part of adapter_model.safetensors."""
    m = LORA.match(name)
    return f"{m['module']}.lora_{m['ab']}.weight"


class LoraFamily:
    """Wraps the family that claims the base model's names: that family's units, read from the PEFT names."""

    name = "lora"
    order = 10

    def claims(self, names: Collection[str], config: dict[str, Any], hints: Hints) -> bool:
        return has_lora(names)

    def traits(self, config: dict[str, Any]) -> ModelTraits:
        return CAUSAL_LM  # what verify meets is the base model, written by the wrapped family

    def units(self, sources: dict[str, SourceMeta], ctx: FamilyContext) -> FamilyResult:
        for sign, what in UNSUPPORTED.items():
            if found := [n for n in sources if sign in n]:
                raise InputError(f"{what} is not supported yet ({found[0]}, ...); merge without it or fuse it in "
                                 "training")
        modules = _modules(sources)
        meta = dict(ctx.hints.lora_meta or {})
        rank, alpha = _rank(modules, sources, meta), _alpha(ctx, meta)
        rslora = bool(meta.get("use_rslora", False))
        own = {hf_name(n): s for n, s in sources.items() if not LORA.match(n)}
        found = lora_base.find(modules, sources, own, ctx)
        if found is None:  # a LoRA-only save and no --base-model folder: the adapter is all there is to write
            return self._adapter_only(modules, sources, rank, alpha, rslora, meta, ctx)
        weights, origin = found
        base = _base(origin, ctx, skip=self)
        notes = [*base.notes, *lora_base.notes(origin, ctx)]
        if ctx.lora.mode == "merge":
            scale = alpha / math.sqrt(rank) if rslora else alpha / rank
            out = _fused(base.units, modules, weights, scale)
            note = f"LoRA fused into the weights of {len(modules)} modules (scale {scale:g})"
            return replace(base, units=out, notes=[*notes, note])
        out = base.units + [_adapter(sources[n]) for ab in modules.values() for n in ab.values()]
        config = adapter_config(modules, rank, alpha, rslora, meta, ctx)
        note = f"LoRA adapter (r={rank}, alpha={alpha:g}) for {len(modules)} modules written to {ADAPTER_DIR}/"
        return replace(base, units=out, extra_files={**base.extra_files, f"{ADAPTER_DIR}/adapter_config.json": config},
                       notes=[*notes, note])

    def _adapter_only(self, modules, sources, rank: int, alpha: float, rslora: bool, meta: dict[str, Any],
                      ctx: FamilyContext) -> FamilyResult:
        if ctx.lora.mode == "merge":
            raise InputError(f"the checkpoint holds LoRA weights only ({lora_base.SAVES}), no base model: "
                             "--lora merge needs the base weights; pass --base-model DIR (the base model's "
                             "Hugging Face folder)")
        units = [_adapter(sources[n]) for ab in modules.values() for n in ab.values()]
        config = adapter_config(modules, rank, alpha, rslora, meta, ctx, base=ctx.lora.base_model
                                or ctx.config.get("_name_or_path") or None)
        note = (f"LoRA-only save: only the adapter (r={rank}, alpha={alpha:g}, {len(modules)} modules) was written, "
                f"to {ADAPTER_DIR}/; no base model (pass --base-model DIR for the base weights, or with --lora "
                "merge a fused model)")
        return FamilyResult(units=units, extra_files={f"{ADAPTER_DIR}/adapter_config.json": config}, notes=[note])


def _base(origin: dict[str, SourceMeta], ctx: FamilyContext, skip: LoraFamily) -> FamilyResult:
    """The wrapped family's units for the base weights (`origin`: Hugging Face name -> the source holding it,
    in the checkpoint under its PEFT name or in the --base-model folder), sources under their own names again."""
    source_of = {name: meta.name for name, meta in origin.items()}
    renamed = {name: replace(meta, name=name) for name, meta in origin.items()}
    inner = claim(list(renamed), ctx.config, ctx.hints, skip=skip)
    result = inner.units(renamed, ctx)
    units = [replace(u, sources=tuple(source_of[s] for s in u.sources)) for u in result.units]
    return replace(result, units=units, left_out={source_of[n]: why for n, why in result.left_out.items()},
                   must_equal=tuple((source_of[a], source_of[b]) for a, b in result.must_equal))


def _fused(units: list[Unit], modules: dict[str, dict[str, str]], weights: dict[str, str],
           scale: float) -> list[Unit]:
    """Each adapted module's base unit (`weights`: module -> the source of its W) becomes W + (B @ A) * scale,
    with the same target."""
    fused = {weights[m]: ab for m, ab in modules.items()}
    out = []
    for unit in units:
        ab = fused.pop(unit.sources[0], None) if len(unit.sources) == 1 else None
        if ab is None:
            out.append(unit)
        elif unit.transform != "identity":
            raise InputError(f"{unit.sources[0]}: LoRA can only be fused into a weight written as it is")
        else:
            out.append(Unit(sources=(*unit.sources, ab["A"], ab["B"]), targets=unit.targets, transform="lora_fuse",
                            params=LoraFuse(scale=scale)))
    if fused:
        raise InputError(f"{next(iter(fused))}: its LoRA cannot be fused, the model does not write this weight "
                         "(a tied head?); use --lora adapter")
    return out



def _modules(sources: dict[str, SourceMeta]) -> dict[str, dict[str, str]]:
    """Adapted module -> {"A": source name, "B": source name}; one adapter name only."""
    modules: dict[str, dict[str, str]] = {}
    adapters = set()
    for name in sources:
        if m := LORA.match(name):
            modules.setdefault(m["module"], {})[m["ab"]] = name
            adapters.add(m["adapter"])
    if len(adapters) > 1:
        raise InputError(f"the checkpoint holds several LoRA adapters ({', '.join(sorted(adapters))}): not supported")
    for module, ab in modules.items():
        if set(ab) != {"A", "B"}:
            raise InputError(f"{module}: the LoRA A or B weight is missing; the checkpoint is incomplete")
    return modules


def _rank(modules: dict[str, dict[str, str]], sources: dict[str, SourceMeta], meta: dict[str, Any]) -> int:
    ranks = {sources[ab["A"]].shape[0] for ab in modules.values()}
    ranks |= {sources[ab["B"]].shape[1] for ab in modules.values()}
    if len(ranks) != 1:
        raise InputError(f"LoRA tensors disagree on the rank r: {sorted(ranks)}")
    rank = ranks.pop()
    if "r" in meta and int(meta["r"]) != rank:
        raise InputError(f"lora_train_meta.json says r={meta['r']} but the LoRA tensors have r={rank}")
    return rank


def _alpha(ctx: FamilyContext, meta: dict[str, Any]) -> float:
    alpha = ctx.lora.alpha if ctx.lora.alpha is not None else meta.get("lora_alpha")
    if alpha is None:
        raise InputError("LoRA weights found but no lora_alpha: no lora_train_meta.json; pass --lora-alpha")
    if float(alpha) == 0:
        raise InputError("lora_alpha is 0, which would turn the adapter off: pass the training value with --lora-alpha")
    return float(alpha)


def _adapter(s: SourceMeta) -> Unit:
    return Unit(sources=(s.name,), targets=(Target(name=adapter_name(s.name), shape=s.shape, dtype=s.dtype,
                                                   group="adapter"),))


def adapter_config(modules, rank: int, alpha: float, rslora: bool, meta: dict[str, Any], ctx: FamilyContext,
                   base: str | None = "") -> dict:
    """What PEFT's save_pretrained writes for a plain LoRA, with the values this checkpoint implies. `base`:
    base_model_name_or_path when given (None: unknown); else the option, the config's, or the output folder
    (which then holds the base model)."""
    if base == "":
        base = ctx.lora.base_model or ctx.config.get("_name_or_path") or ctx.output
    return {
        "peft_type": "LORA",
        "task_type": meta.get("task_type", "CAUSAL_LM"),
        "base_model_name_or_path": base,
        "r": rank,
        "lora_alpha": alpha if not float(alpha).is_integer() else int(alpha),
        "target_modules": sorted({m.rsplit(".", 1)[-1] for m in modules}),
        "lora_dropout": 0.0,
        "bias": "none",
        "use_rslora": rslora,
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "modules_to_save": None,
        "use_dora": False,
    }


LORA_FAMILY = LoraFamily()

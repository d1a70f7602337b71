"""Model families: name and layout rules as tables, turned into units of work for the engine.

A format says which naming its tensors use; LoRA keys (PEFT's) switch to the LoRA family, which wraps it.
"""

from __future__ import annotations

from distmerge.families import hf, lora
from distmerge.families.hf import check_names_are_hf
from distmerge.mapping import FamilyContext, FamilyResult, SourceMeta

NAMINGS = {"hf": hf.units}


def units_for(naming: str, sources: dict[str, SourceMeta], ctx: FamilyContext) -> FamilyResult:
    if lora.has_lora(sources):
        return lora.units(sources, ctx)
    if naming == "hf":
        check_names_are_hf(list(sources))
    return FamilyResult(units=NAMINGS[naming](sources, ctx.config, ctx.cast))


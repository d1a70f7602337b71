"""Model families: name and layout rules as tables, turned into units of work for the engine.

A format says which naming its tensors use; LoRA keys (PEFT's) switch to the LoRA family, which wraps it.
"""

from __future__ import annotations

from distmerge.families import hf, lora, megatron
from distmerge.families.hf import check_names_are_hf
from distmerge.mapping import FamilyContext, FamilyResult, SourceMeta


def units_for(naming: str, sources: dict[str, SourceMeta], ctx: FamilyContext) -> FamilyResult:
    """`naming` is the format's word for its tensor names: "hf" (FSDP, DCP of HF models) or "megatron"."""
    if naming == "megatron":
        return megatron.units(sources, ctx)
    if lora.has_lora(sources):
        return lora.units(sources, ctx)
    check_names_are_hf(list(sources))
    return FamilyResult(units=hf.units(sources, ctx.config, ctx.cast))


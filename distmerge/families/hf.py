"""Sources that already carry Hugging Face names (FSDP, DCP of HF models): one unit per tensor.

The only rule is the tied head: when config.json ties word embeddings, `lm_head.weight` is a copy of
the embedding in the state dict, and transformers 5 refuses to load a checkpoint that stores both.
This family comes last: it takes any Hugging Face-named tensors no other family claimed.
"""

from __future__ import annotations

from collections.abc import Collection

from distmerge.errors import InputError
from distmerge.families import hub_names
from distmerge.families.base import (
    CAUSAL_LM,
    FamilyContext,
    FamilyResult,
    NamingFamily,
    SourceMeta,
    Target,
    Unit,
    output_dtype,
)

# Names that give away another trainer's own naming: merging them as if they were Hugging Face names
# would write a model no library loads. Each maps to what is missing.
FOREIGN_NAMES = {
    "tok_embeddings.weight": "torchtitan's naming",
    "decoder.layers.": "Megatron-core's naming (merge the save with --format megatron-dist)",
    "embedding.word_embeddings.weight": "Megatron-core's naming (merge the save with --format megatron-dist)",
    "language_model.encoder.layers.": "legacy Megatron-LM's naming",
}


def check_names_are_hf(names: Collection[str]) -> None:
    for sign, what in FOREIGN_NAMES.items():
        if any(n.startswith(sign) for n in names):  # at the root only: BART has model.decoder.layers.*
            shown = ", ".join(sorted(names)[:4])
            raise InputError(
                f"the tensors use {what} ({shown}, ...), not Hugging Face names, and distmerge has no mapping "
                "for it in this format yet"
            )


def units(sources: dict[str, SourceMeta], ctx: FamilyContext) -> FamilyResult:
    check_names_are_hf(list(sources))
    drop = CAUSAL_LM.dropped_heads({n: s.shape for n, s in sources.items()}, ctx.config)
    rules = hub_names.rules_for(ctx.config)
    return FamilyResult(units=[as_is(s, ctx.cast, rules) for s in sources.values() if s.name not in drop])


def as_is(source: SourceMeta, cast: str | None, rules: hub_names.Rules = ()) -> Unit:
    """The tensor under its own name, or the hub name `save_pretrained` gives it (cast when asked)."""
    name = hub_names.to_hub(source.name, rules)
    target = Target(name=name, shape=source.shape, dtype=output_dtype(source.dtype, cast))
    return Unit(sources=(source.name,), targets=(target,))


HF = NamingFamily(name="hf", naming="hf", order=90, build=units)

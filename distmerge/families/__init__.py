"""Model families: name and layout rules as tables, turned into units of work for the engine.

A format says which naming its tensors use; this table says which module turns them into units.
"""

from __future__ import annotations

from typing import Any

from distmerge.errors import InputError
from distmerge.families import hf
from distmerge.mapping import SourceMeta, Unit

NAMINGS = {"hf": hf.units}

# Names that give away another trainer's own naming: merging them as if they were Hugging Face names
# would write a model no library loads. Each maps to what is missing.
FOREIGN_NAMES = {
    "tok_embeddings.weight": "torchtitan's naming",
    "decoder.layers.": "Megatron-core's naming",
    "embedding.word_embeddings.weight": "Megatron-core's naming",
    "language_model.encoder.layers.": "legacy Megatron-LM's naming",
}


def units_for(naming: str, sources: dict[str, SourceMeta], config: dict[str, Any], cast: str | None) -> list[Unit]:
    if naming == "hf":
        check_hf_names(list(sources))
    return NAMINGS[naming](sources, config, cast)


def check_hf_names(names: list[str]) -> None:
    for sign, what in FOREIGN_NAMES.items():
        if any(n.startswith(sign) for n in names):  # at the root only: BART has model.decoder.layers.*
            shown = ", ".join(sorted(names)[:4])
            raise InputError(
                f"the tensors use {what} ({shown}, ...), not Hugging Face names, and distmerge has no mapping "
                "for it in this format yet"
            )

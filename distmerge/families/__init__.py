"""Model families: name and layout rules as tables, turned into units of work for the engine.

A format says which naming its tensors use; this table says which module turns them into units.
"""

from __future__ import annotations

from typing import Any

from distmerge.families import hf
from distmerge.mapping import SourceMeta, Unit

NAMINGS = {"hf": hf.units}


def units_for(naming: str, sources: dict[str, SourceMeta], config: dict[str, Any], cast: str | None) -> list[Unit]:
    return NAMINGS[naming](sources, config, cast)

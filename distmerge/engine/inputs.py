"""Several inputs in one merge: an average (`merge --input A --input B ... --average`), several checkpoints of one
model, each read by its own format through its own source, in one plan.

    rank 0      check_inputs: each input's source walked once and joined to the merge's session (input/source.py)
    rank 0      discover_inputs: the first input discovered as a single input is (config, tokenizer, --hf-config,
                --base-model), each other one scanned by its own format (detected, or --format) with the same
                format options; their scans combined (combine) and broadcast as one Scan
    every rank  the engine opens, reads and plans the combined scan as one input: input i's files follow the first
                input's in Scan.files (each with `root` = its input's root), its tensors are named
                `input-i:<name>` (formats/registry.open_file), so the inventories, coverage, replicas and the
                rounds are the one-input code's; prepare.py hands each input's tensors to its family and the
                average (average/units.py) joins their units

One input is exactly a merge as before: check_inputs and discover_inputs of one input are check_input and discover.

InputSpec is what the user says of an input (where it lives, how to read it): merge's input (engine/run.MergeOptions)
and each side of a verify (verifier/listing.VerifyOptions) hold one, so it is written once.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from distmerge.average import units as average
from distmerge.engine import discover as disc
from distmerge.errors import InputError
from distmerge.formats.base import Part, Scan
from distmerge.input import source


@dataclass(frozen=True, kw_only=True)
class InputSpec:
    """An input and how to read it: --input (or verify's --merged, --reference), --format, --hf-config, the format's
    own options, --base-model. Several locations are an average's inputs, in the order given."""

    locations: tuple[Any, ...]  # each a folder, s3://bucket/prefix, or a Source (input/source.py)
    format: str = "auto"
    hf_config: Path | None = None
    format_options: dict[str, Any] = field(default_factory=dict)  # the format's own (Megatron's iteration ...)
    base_model: Path | None = None  # a second input root: a LoRA-only save's base folder

    def __post_init__(self) -> None:
        # a caller's one location, or a str, works too (a URL stays a str: a Path would fold s3://b into s3:/b)
        many = self.locations if isinstance(self.locations, (tuple, list)) else (self.locations,)
        object.__setattr__(self, "locations", tuple(_location(each) for each in many))
        for name in ("hf_config", "base_model"):
            if isinstance(getattr(self, name), str):
                object.__setattr__(self, name, Path(getattr(self, name)))

    @property
    def location(self) -> Any:
        """The first (an average's first input: its config, tokenizer and notes are the output's)."""
        return self.locations[0]

    @property
    def named(self) -> str:
        """As reports name it: each location (a Source by its url), an average's joined by " + "."""
        return " + ".join(source.name_of(each) for each in self.locations)


def _location(value: Any) -> Any:
    """A local folder as a Path; a URL (a str) and a Source as they are."""
    return Path(value) if isinstance(value, os.PathLike) or (isinstance(value, str) and not source.is_url(value)) \
        else value


def discover_spec(spec: InputSpec, averaging: average.AverageOptions) -> disc.Discovery:
    """Rank 0, for a merge in memory (verify): the inputs checked against the averaging options, each walked, and
    discovered as merge discovers them (engine/run.py does the same steps around its output's lock)."""
    notes = average.check(averaging, len(spec.locations))
    found = discover_inputs(check_inputs(spec.locations), spec.format, spec.hf_config, spec.format_options,
                            spec.base_model)
    return replace(found, scan=replace(found.scan, notes=(*found.scan.notes, *notes))) if notes else found


def check_inputs(locations: Sequence[Any]) -> list[Path]:
    """Each input's source walked once and made an input of this merge (the first replaces any earlier merge's).
    Returns where the formats look, in the order given; an input named twice is refused."""
    roots: list[Path] = []
    for i, location in enumerate(locations):
        if i == 0:
            roots.append(disc.check_input(location))
            continue
        src = source.open_source(location)
        src.walk()
        if src.root in roots:
            raise InputError(f"--input {source.name_of(location)} is given twice: each input of an average is a "
                             "checkpoint of its own (weight one more than another with --average-weights)")
        roots.append(source.session().add(src).root)
    return roots


def discover_inputs(roots: Sequence[Path], fmt_name: str, hf_config: Path | None, options: Mapping[str, Any],
                    base_model: Path | None = None) -> disc.Discovery:
    """The first input as discover finds it, the others scanned by their own format and joined to its scan."""
    found = disc.discover(roots[0], fmt_name, hf_config, options, base_model)
    if len(roots) == 1:
        return found
    others = [disc.scan_input(source.looking_at(root), fmt_name, options) for root in roots[1:]]
    return replace(found, scan=combine(found.scan, others))


def combine(first: Scan, others: Sequence[Scan]) -> Scan:
    """`first` with each other input's files after its own (and after a --base-model folder's), as Parts."""
    files = list(first.files)
    parts, notes = [], list(first.notes)
    for i, scan in enumerate(others, start=1):
        at = len(files)
        files += [replace(f, index=at + f.index, root=scan.root) for f in scan.files]
        parts.append(Part(index=i, scan=scan, first=at))
        notes += [f"input {i + 1} ({scan.root}, {scan.format}): {note}" for note in scan.notes]
    return replace(first, files=tuple(files), parts=tuple(parts), notes=tuple(notes))


def scans(scan: Scan) -> list[Scan]:
    """Each input's own scan, in the order given (the combined one stands for the first)."""
    return [scan, *(p.scan for p in scan.parts)]

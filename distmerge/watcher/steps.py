"""The steps of a run: the folders under RUN a trainer saved (markers.MARKERS claims them by name or content),
whether each is finished by its trainer's marker, and the checkpoints each holds: the folder itself, or its
subfolders (verl's `actor/`, `critic/`), as the formats' own detection finds them (formats.registry.detect). Rank 0,
once a pass; nothing is read but names, sizes and the small marker files.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path

from distmerge.errors import DistmergeError
from distmerge.formats import registry
from distmerge.watcher import markers

MAX_DEPTH = 3  # a step folder lies at most this many folders below RUN (torchtitan's checkpoint/step-N: 2)
MARKER_CAP = 4096  # bytes read of a marker beside the steps (it holds a number or a tag)


@dataclass(frozen=True, kw_only=True)
class Step:
    """One saved step: its folder under RUN and what its trainer says of it."""

    rel: str  # the step folder, relative to RUN (`global_step_300`, `checkpoint/step-10`)
    number: int | None  # from its name (None: a DCP folder found by its files)
    trainer: str  # markers.Marker.trainer
    finished: bool
    as_hf: bool = False  # the trainer saved it as a Hugging Face model: nothing to merge
    checkpoints: tuple[str, ...] = ()  # the folders a format detects, relative to RUN (the step's own, or its
    # subfolders'); empty while nothing detectable is written yet

    def names(self) -> tuple[str, ...]:
        """What the summary names: its checkpoints, or the step folder while none is found."""
        return self.checkpoints or (self.rel,)


def find(run: Path, skip: Path | None = None) -> list[Step]:
    """Every step folder under `run` (not under `skip`, the output when it lies inside the run), by number."""
    found: list[Step] = []
    _visit(run, run, 0, skip.resolve() if skip is not None else None, found)
    return sorted(found, key=lambda s: (s.number is None, s.number or 0, s.rel))


def joined(views: list[list[Step]]) -> list[Step]:
    """The steps of a run whose nodes each hold some of its files, as each node's first rank found them: a step is
    finished when any node finds its trainer's marker (written once every rank's files are), and holds every
    checkpoint some node's files make detectable."""
    by_rel: dict[str, Step] = {}
    for view in views:
        for s in view:
            seen = by_rel.get(s.rel)
            by_rel[s.rel] = s if seen is None else replace(
                seen, finished=seen.finished or s.finished, as_hf=seen.as_hf or s.as_hf,
                checkpoints=tuple(sorted({*seen.checkpoints, *s.checkpoints})))
    return sorted(by_rel.values(), key=lambda s: (s.number is None, s.number or 0, s.rel))


def _visit(run: Path, folder: Path, depth: int, skip: Path | None, found: list[Step]) -> None:
    beside: dict[str, str | None] = {}  # the markers of this folder, read once
    for sub in subfolders(folder):
        if skip is not None and sub.resolve() == skip:
            continue
        files = _files(sub)
        row = markers.claiming(sub, files)
        if row is not None:
            found.append(_step(run, sub, files, row, beside))
        elif depth + 1 < MAX_DEPTH:
            _visit(run, sub, depth + 1, skip, found)


def _step(run: Path, folder: Path, files: list[str], row: markers.Marker, beside: dict[str, str | None]) -> Step:
    text = _beside(folder.parent, row, beside) if row.beside else None
    done = markers.finished(row, folder, files, text)
    as_hf = bool(row.as_hf) and row.as_hf in files
    found = () if as_hf else tuple(_rel(run, p) for p in checkpoints(folder))
    return Step(rel=_rel(run, folder), number=row.number(folder.name), trainer=row.trainer, finished=done,
                as_hf=as_hf, checkpoints=found)


def checkpoints(step: Path) -> list[Path]:
    """The step folder when a format detects it, else its subfolders a format detects."""
    if _detects(step):
        return [step]
    return [sub for sub in subfolders(step) if _detects(sub)]


def _detects(folder: Path) -> bool:
    try:
        return registry.detect(folder) is not None
    except (DistmergeError, OSError):  # a folder changing under the walk: not a checkpoint yet
        return False


def _beside(folder: Path, row: markers.Marker, read: dict[str, str | None]) -> str | None:
    """The text of the row's marker in `folder` (None: there is none)."""
    for name in row.marker:
        if name not in read:
            try:
                with open(folder / name, "rb") as f:
                    read[name] = f.read(MARKER_CAP).decode(errors="replace")
            except OSError:
                read[name] = None
        if read[name] is not None:
            return read[name]
    return None


def subfolders(folder: Path) -> list[Path]:
    """The folders in `folder`, by name: not hidden ones (distmerge's `.distmerge/`), not links."""
    try:
        entries = list(os.scandir(folder))
    except OSError:  # gone meanwhile (a trainer removing old steps)
        return []
    return sorted(Path(e.path) for e in entries if not e.name.startswith(".") and e.is_dir(follow_symlinks=False))


def _files(folder: Path) -> list[str]:
    try:
        return [e.name for e in os.scandir(folder) if e.is_file(follow_symlinks=False)]
    except OSError:
        return []


def _rel(run: Path, path: Path) -> str:
    return path.relative_to(run).as_posix()


def signature(folder: Path) -> tuple[tuple[str, int, int], ...]:
    """Every file under `folder`: path, size, mtime. A step whose merge failed is tried again once this changes."""
    out = []
    for root, dirs, files in os.walk(folder):
        dirs.sort()
        for name in sorted(files):
            path = Path(root, name)
            try:
                st = path.lstat()
            except OSError:
                continue
            out.append((path.relative_to(folder).as_posix(), st.st_size, st.st_mtime_ns))
    return tuple(out)

"""Whether a step's output is already its merge, judged without reading the checkpoint: rank 0, before a merge.

A step at RUN/<rel> merged into OUT/<rel> is done when, there,
    model.safetensors.index.json is (the commit marker: finalize writes it last), and
    .distmerge/run.json (engine/resume.py: what shaped the output) names the options this watch merges with, and
    input files of the sizes and modification times they have now.
Such a step is skipped untouched. Anything else is handed to the merge with --resume, whose own check is the
authority (it plans, and keeps every file it can prove): an interrupted merge is finished, a complete one with
other options merged again, and one complete with these options left as it is. The config's digest is the one part
of run.json not judged here (it needs the format's scan to find the config); the merge's check judges it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from distmerge.engine import resume
from distmerge.engine.run import MergeOptions
from distmerge.errors import DistmergeError
from distmerge.formats import registry
from distmerge.output import open_store, read_json
from distmerge.output.names import INDEX_NAME, RUN_RECORD

CONFIG = "config.json"  # run.json's key of the config's digest
DEPTH = 2  # how far below the step folder a recorded input may lie (DeepSpeed's tag folder in checkpoint-N/)


def merged_bytes(opts: MergeOptions) -> int | None:
    """The model bytes of `opts.output` when it holds this very merge of `opts.input` (the module docstring's
    rule), else None."""
    store = open_store(opts.output)
    index, run = read_json(store, INDEX_NAME), read_json(store, RUN_RECORD)
    if index is None or run is None or not isinstance(run.get("inputs"), dict) or not run["inputs"]:
        return None
    if _mine(run.get("options")) != _mine(expected_options(opts)):
        return None
    if not _inputs_unchanged(opts, run["inputs"]):
        return None
    size = (index.get("metadata") or {}).get("total_size")
    return size if isinstance(size, int) else 0


def expected_options(opts: MergeOptions) -> dict[str, Any] | None:
    """run.json's options for a merge with `opts` (less the config's digest); None when no format detects the
    input."""
    fmt = opts.input.format
    if fmt == "auto":
        try:
            found = registry.detect(Path(opts.input.location))
        except (DistmergeError, OSError):  # the merge says what is wrong with it
            found = None
        if found is None:
            return None
        fmt = found.name
    return resume.output_options(opts.settings, fmt, opts.input.format_options, {})


def _mine(options: Any) -> dict | None:
    return {k: v for k, v in options.items() if k != CONFIG} if isinstance(options, dict) else None


def _inputs_unchanged(opts: MergeOptions, recorded: dict[str, Any]) -> bool:
    """Every recorded input file unchanged, and every input of `opts` among them: an average's (watch
    --average-last) other inputs are recorded by their own folder's absolute path (engine/resume.py), so a record of
    other steps is never taken for these."""
    inputs = [Path(p) for p in opts.input.locations]
    covered = set()
    for path, seen in recorded.items():
        if not Path(path).is_absolute():
            if not _unchanged(inputs[0], path, seen):
                return False
            covered.add(0)
            continue
        owner = next((i for i, root in enumerate(inputs) if i and Path(path).is_relative_to(root.resolve())), None)
        if owner is None or not _same(Path(path), seen):
            return False
        covered.add(owner)
    return covered == set(range(len(inputs)))


def _same(place: Path, seen: Any) -> bool:
    try:
        st = os.stat(place)
    except OSError:
        return False
    return isinstance(seen, list) and [st.st_size, st.st_mtime_ns] == seen


def _unchanged(step: Path, path: str, seen: Any) -> bool:
    """The recorded input `path` (relative to the folder its format read, at or below the step folder) is there,
    of the recorded [size, mtime_ns]."""
    if not isinstance(seen, list) or len(seen) != 2 or Path(path).is_absolute() or ".." in Path(path).parts:
        return False
    places = [step / path]
    for depth in range(1, DEPTH + 1):
        places += sorted(step.glob("/".join(["*"] * depth) + "/" + path))
    for place in places:
        try:
            st = os.stat(place)
        except OSError:
            continue
        if [st.st_size, st.st_mtime_ns] == seen:
            return True
    return False

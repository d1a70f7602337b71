"""Any checkpoint distmerge merges as the import's input (issue #45, item 3): a Megatron legacy TP save written as
torch_dist at another TP, an FSDP or DCP save, ... Such an input is merged first, by the merge engine with the
import's own processes (engine/run.merge: its discovery, plan, bounded memory, every format it reads), into a
Hugging Face folder beside the output; the import reads that folder, and it is removed when the import ends,
finished or not.

    OUT/../.OUT.distmerge-import-source/   the merge's output (config.json from --hf-config or the checkpoint's)
    OUT/                                   the import of it

A staged version: it reads the input once and the staged folder once, and holds a copy of the model on disk
meanwhile. Reading the checkpoint's fragments straight into the import's chunks (one pass, no copy) is not written
yet. A Hugging Face folder is read as it is; an input no format detects is left to the import's own discovery,
whose refusal says what a model folder holds. Before the merge, what the import would refuse after it is refused
(refuse_early): an output it may not write, and, with --hf-config, a layout config.json does not allow.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from distmerge.distributed.comm import Comm
from distmerge.formats import registry
from distmerge.formats.registry import HF_MODEL_FILES

STAGE_SUFFIX = ".distmerge-import-source"


def staged_folder(output: Path) -> Path:
    """Where a checkpoint input is merged: beside the output, hidden, named after it."""
    return output.parent / f".{output.name}{STAGE_SUFFIX}"


def is_checkpoint(location: Path) -> bool:
    """Rank 0: whether the input is a training checkpoint that a format detects, not a Hugging Face folder."""
    if not location.is_dir() or any((location / name).is_file() for name in HF_MODEL_FILES):
        return False
    return registry.detect(location) is not None


@contextmanager
def as_hf_model(location: Path, output: Path, hf_config: Path | None, comm: Comm,
                refuse_early: Callable[[], None]) -> Iterator[Path]:
    """Collective: the Hugging Face folder the import reads: `location` itself, or a checkpoint merged into
    staged_folder(output) by every rank (removed on the way out), once rank 0's `refuse_early` has passed."""

    def staged() -> bool:
        if not is_checkpoint(location):
            return False
        refuse_early()
        return True

    if not comm.root_only(staged):
        yield location
        return
    from distmerge.engine.inputs import InputSpec
    from distmerge.engine.run import MergeOptions, merge
    from distmerge.report import Progress

    stage = staged_folder(output)
    try:
        merge(MergeOptions(input=InputSpec(locations=(location,), hf_config=hf_config), output=stage,
                           overwrite=True), comm, Progress(enabled=False))
        yield stage
    finally:
        # no collective here: after an error on one rank it would wait for the others. A normal end is past the
        # import's last collective (finalize), so no rank still reads the folder.
        if comm.rank == 0:
            shutil.rmtree(stage, ignore_errors=True)

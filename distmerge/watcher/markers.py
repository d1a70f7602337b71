"""How each trainer says a save is finished: MARKERS, one row per trainer, as the trainer's own code writes them.

Two kinds of marker:

    beside  a file in the folder holding the step folders, written once a save is complete, naming the last
            finished one (a number, or the folder's name): every step up to it is finished; a later one is
            still being written
    inside  a file in the step folder itself, written last: there, the step is finished

A step folder is found by its name (`folder`, the step's number in its first group), or, for a plain
`torch.distributed.checkpoint` save, by what it holds (`holds`). Rows are tried in order; the first whose folder
matches claims the folder, and nothing inside a step folder is looked at for more steps (the Hugging Face Trainer's
`checkpoint-N/` holds DeepSpeed's `global_stepN/` and `latest`: one step, the Trainer's).

What each row relies on, in the trainer's code (read for these facts; docs/watch.md names the versions):
    verl          RayPPOTrainer._save_checkpoint writes `global_step_{N}/actor` (and `critic`, `data.pt`), then
                  `latest_checkpointed_iteration.txt` holding N (with async_save, the Megatron checkpoint manager
                  writes it once the save is finalized)
    Megatron-LM   save_checkpoint writes `iter_{N:07d}/` (or `release/`), then rank 0 writes
                  `latest_checkpointed_iteration.txt` holding N or `release` (for an async save, in its finalize
                  function, once every rank's part is written)
    DeepSpeed     engine.save_checkpoint writes `global_step{N}/` (the default tag), then rank 0 writes `latest`
                  holding the tag (before the barrier that ends the save: another rank's last bytes may still be
                  landing; passes.py retries a step whose merge failed once its files change)
    HF Trainer    Trainer._save_checkpoint writes model, optimizer, scheduler and RNG state into `checkpoint-{N}/`,
                  then `trainer_state.json`
    torchtitan    CheckpointManager saves `step-{N}/` with dcp.save (or dcp.async_save): `.metadata` last; it
                  takes a step folder as valid when it holds `.metadata` (or `model.safetensors.index.json`,
                  its last step saved in HF form)
    DCP           FileSystemWriter.finish writes `.metadata` (through a temporary name) after every rank's
                  `__R_I.distcp` is written
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

TRACKER = "latest_checkpointed_iteration.txt"
HF_INDEX = "model.safetensors.index.json"


@dataclass(frozen=True, kw_only=True)
class Marker:
    trainer: str  # as the summary and the docs name it
    marker: tuple[str, ...]  # the file(s): any one of them there is the mark
    beside: bool = False  # True: in the folder of the step folders, naming the last finished step; else inside
    folder: re.Pattern | None = None  # a step folder's name (group 1: its number; None: a step without one)
    names: str = "{}"  # beside: the folder a number in the marker names (`global_step_{}`)
    holds: re.Pattern | None = None  # no `folder`: a step folder is one holding a file of this name
    as_hf: str = ""  # a file that says the trainer saved this step as a Hugging Face model: nothing to merge

    def claims(self, folder: Path, files: list[str]) -> bool:
        """Whether `folder` (holding `files`, by name) is a step folder of this trainer."""
        if self.folder is not None:
            return self.folder.fullmatch(folder.name) is not None
        return self.holds is not None and any(self.holds.search(name) for name in files)

    def number(self, name: str) -> int | None:
        m = self.folder.fullmatch(name) if self.folder is not None else None
        return int(m[1]) if m and m[1] is not None else None

    def named(self, text: str) -> str:
        """beside: the step folder the marker's text names ("300" -> `global_step_300`; `release`, a tag)."""
        text = text.strip()
        return self.names.format(int(text)) if text.isdigit() else text


MARKERS: tuple[Marker, ...] = (
    Marker(trainer="verl", folder=re.compile(r"global_step_(\d+)"), marker=(TRACKER,), beside=True,
           names="global_step_{}"),
    Marker(trainer="Megatron-LM", folder=re.compile(r"iter_(\d+)|release"), marker=(TRACKER,), beside=True,
           names="iter_{:07d}"),
    Marker(trainer="DeepSpeed", folder=re.compile(r"global_step(\d+)"), marker=("latest",), beside=True),
    Marker(trainer="HF Trainer", folder=re.compile(r"checkpoint-(\d+)"), marker=("trainer_state.json",)),
    Marker(trainer="torchtitan", folder=re.compile(r"step-(\d+)"), marker=(".metadata", HF_INDEX),
           as_hf=HF_INDEX),
    Marker(trainer="DCP", holds=re.compile(r"\.distcp$"), marker=(".metadata",)),
)


def claiming(folder: Path, files: list[str]) -> Marker | None:
    """The first row that takes `folder` for a step folder."""
    return next((m for m in MARKERS if m.claims(folder, files)), None)


def finished(row: Marker, step: Path, files: list[str], beside_text: str | None) -> bool:
    """Whether the trainer marked the step folder `step` (holding `files`) finished. `beside_text`: the marker
    beside it, read (None: there is none)."""
    if not row.beside:
        return any(name in files for name in row.marker)
    if beside_text is None:
        return False
    named = row.named(beside_text)
    if named == step.name:
        return True
    mine, last = row.number(step.name), row.number(named)
    return mine is not None and last is not None and mine <= last

"""What a watch reports: each step's outcome in a pass, and the whole watch's result (the same on every rank)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class Status(StrEnum):
    """A step's outcome in a pass, as the table prints it (a str: compares and prints as its text)."""

    MERGED = "merged"
    RESUMED = "resumed"  # an interrupted merge finished: the files it had finished kept
    DONE = "merged earlier"  # its output is this merge already: untouched
    WAITING = "still being written"  # no finished marker yet
    TOO_FEW = "waiting for steps"  # --average-last K: fewer than K finished steps so far
    ELSEWHERE = "being merged by another watcher"  # its output's lock is held by a live merge
    FAILED = "failed"
    UPLOAD_FAILED = "upload failed"  # merged, but --hf_upload_path could not send it
    AS_HF = "saved as a Hugging Face model"  # the trainer saved it in that form: nothing to merge
    NOTHING = "no checkpoint found"  # finished, but no folder of it is a checkpoint distmerge reads
    INTERRUPTED = "interrupted"  # stopped in its merge (SIGTERM, Ctrl-C): the next watch resumes it


# The statuses by their short names, as the watcher's modules and the tests import them.
MERGED, RESUMED, DONE, WAITING, TOO_FEW = Status.MERGED, Status.RESUMED, Status.DONE, Status.WAITING, Status.TOO_FEW
ELSEWHERE, FAILED, UPLOAD_FAILED = Status.ELSEWHERE, Status.FAILED, Status.UPLOAD_FAILED
AS_HF, NOTHING, INTERRUPTED = Status.AS_HF, Status.NOTHING, Status.INTERRUPTED
PROBLEMS = (FAILED, UPLOAD_FAILED)  # what makes the watch end with status 1


@dataclass(frozen=True, kw_only=True)
class Outcome:
    name: str  # the checkpoint under RUN (`global_step_300/actor`), or the step folder while none is found
    status: Status
    nbytes: int = 0  # the model's bytes (merged, resumed, merged earlier)
    seconds: float = 0.0  # the merge's time
    detail: str = ""  # the error, what --resume kept, where it was uploaded
    number: int | None = None  # the step's number


@dataclass(frozen=True, kw_only=True)
class WatchResult:
    passes: int
    outcomes: tuple[Outcome, ...]  # every pass's, in order
    stopped: bool = False  # a watch without `once`, ended by SIGTERM or Ctrl-C

    def last(self) -> dict[str, Outcome]:
        """Each step's latest outcome."""
        return {o.name: o for o in self.outcomes}

    def with_status(self, *statuses: Status) -> list[str]:
        return [name for name, o in self.last().items() if o.status in statuses]

    @property
    def merged(self) -> list[str]:
        """The steps this watch merged (or finished merging)."""
        return sorted({o.name for o in self.outcomes if o.status in (MERGED, RESUMED)})

    @property
    def failed(self) -> list[str]:
        return self.with_status(*PROBLEMS)

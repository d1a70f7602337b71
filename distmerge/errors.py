"""User-facing errors. Each message says what went wrong and what to do about it."""


class DistmergeError(Exception):
    """Base class: shown to the user as one line, exit status 1."""


class InputError(DistmergeError):
    """The input folder is missing, empty, incomplete or not a checkpoint distmerge understands."""


class CorruptInputError(InputError):
    """A file of the checkpoint cannot be read (truncated, not a checkpoint, unsafe pickle)."""


class LayoutError(InputError):
    """The shards do not fit together: gaps, overlaps, or replicas that disagree."""


class OutputError(DistmergeError):
    """The output folder cannot be used or written."""


class OutputLocked(OutputError):
    """The output is being written by another merge that is alive (its lock, output/lock.py): not this run's to
    write now. `distmerge watch` leaves such a step to the watcher that holds it."""


class ConfigError(DistmergeError):
    """The Hugging Face config is missing or invalid."""


class Interrupted(KeyboardInterrupt):
    """A merge stopped by Ctrl-C or SIGTERM (torchrun passes scancel's and a time limit's on), on rank 0: how many
    of the planned output files were finished, and so kept for --resume (None where it did not get that far)."""

    def __init__(self, finished: int | None = None, planned: int | None = None) -> None:
        super().__init__()
        self.finished, self.planned = finished, planned

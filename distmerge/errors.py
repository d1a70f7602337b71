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


class ConfigError(DistmergeError):
    """The Hugging Face config is missing or invalid."""

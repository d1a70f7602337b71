"""The kinds of option value: how the command line parses each, how the API's signature spells it. Light (the
command line imports it): no torch."""

from __future__ import annotations

from enum import StrEnum


class Kind(StrEnum):
    """How an option's value is parsed (options._parsed, cli_options.TYPES); a str: prints as its name."""

    PATH = "path"  # a local path
    LOCATION = "location"  # a folder, or an object-store URL kept as typed (options.location); or a Source/Store
    SIZE = "size"  # bytes: 5GB, 512MiB or a number
    FLOAT = "float"
    TEXT = "text"
    SWITCH = "switch"  # on or off: a flag with no value
    VALUE = "value"  # parsed by the option's own parser (Opt.parse)
    GROUP = "group"  # the API's only: a torch.distributed process group


# How the API's signature spells each kind (options.signature; api.py's written keywords match it).
ANNOTATIONS = {Kind.PATH: "str | os.PathLike", Kind.LOCATION: "str | os.PathLike", Kind.SIZE: "int | str",
               Kind.FLOAT: "float", Kind.TEXT: "str", Kind.SWITCH: "bool", Kind.VALUE: "int | str",
               Kind.GROUP: "torch.distributed.ProcessGroup"}

"""The command line's options, made from the one table of options (options.OPTIONS), and their typed form.

Each command's options go into --help's sections (TITLES) in the table's order; a section is made where its first
option is, so the table's order is --help's and the usage line's.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from distmerge import options, output_options
from distmerge.option_kinds import Kind
from distmerge.options import parse_size

# command -> the section each group of options is shown under (None: the command's own "options:" section)
TITLES: dict[str, dict[str, str | None]] = {
    "merge": {"": None, "input": "input", "output": "output", "run": "run"},
    "inspect": {"": None, "input": "input", "output": "output", "run": None},
    "watch": {"": None, "input": "input", "output": "output: each step's merge", "run": "run"},
    "verify": {"": None, "input": "when --merged is a checkpoint: how to read it",
               "reference": "when --reference is a checkpoint: how to read it",
               "output": "when either side is a checkpoint: the merge to check", "run": "run"},
}
TYPES = {Kind.PATH: Path, Kind.LOCATION: options.location, Kind.SIZE: parse_size, Kind.FLOAT: float, Kind.TEXT: None}


def add_options(parser: argparse.ArgumentParser, command: str) -> None:
    """Every option of `command` (options.rows), in its section."""
    sections: dict[str | None, Any] = {None: parser}
    for row in options.cli_rows(command):
        title = TITLES[command][row.group]
        if title not in sections:
            sections[title] = parser.add_argument_group(title)
        sections[title].add_argument(*row.flags, **_argparse_keywords(row))


def _argparse_keywords(row: options.Opt) -> dict[str, Any]:
    if row.kind == Kind.SWITCH:
        return {"dest": row.name, "action": "store_true", "help": row.help}
    kw: dict[str, Any] = {"help": row.help, **({"action": "append"} if row.repeat else {})}
    if row.flags[0].startswith("-"):  # a positional's dest is its name
        kw["dest"] = row.name
        if row.required:
            kw["required"] = True
    parse = row.parse if row.kind == Kind.VALUE else TYPES[row.kind]
    if parse is not None:
        kw["type"] = parse
    if row.default is not None:
        kw["default"] = row.default  # a string default is parsed by `type`, as a value given would be
    if row.choices is not None:
        kw["choices"] = row.choices
    if row.metavar is not None:
        kw["metavar"] = row.metavar
    return kw


def format_options(values: Mapping[str, Any]) -> dict:
    """The format options given (the ones left out are not passed)."""
    return options.given(dict(values), options.format_option_names())


def reference_format_options(values: Mapping[str, Any]) -> dict:
    """verify: the --reference- twins of the format options given, by the formats' own keys (--reference-iteration
    is `iteration` to the reference's format)."""
    return {key: values[twin] for twin, key in options.reference_format_option_names().items()
            if values.get(twin) is not None}


def base_model_dir(values: Mapping[str, Any]) -> Path | None:
    """--base-model as a second input root: only when it names a folder (a hub name only names the base)."""
    value = values.get("base_model")
    return Path(value) if value and Path(value).is_dir() else None


def output_settings(values: Mapping[str, Any]):
    """The options that shape the output, typed: each declared one sets its field (output_options.settings); the
    run's own, --budget and --output, theirs (inspect has no --budget: it plans in one round)."""
    from distmerge.engine.prepare import OutputSettings

    run = OutputSettings(budget_bytes=values.get("budget", 2**62), output=values.get("output") or Path())
    return output_options.settings(run, values)

"""The options of merge, verify and inspect, defined once: OPTIONS. Everything else derives from its rows or is
checked against them (tests/test_options_agree.py):

    argparse       cli_options.add_options: add_argument(*flags, dest=name, default, choices, metavar, help)
    the API        distmerge.merge / verify / watch: keyword `name`, default `default`, written out in api.py and
                   checked against signature() (tests/test_options_agree.py); its docstring is made here
                   (docstring()); the value checked and parsed as the command line parses it (from_keywords)
    the request    api.merge_request / api.verify_request: the typed values, by name (the same for the CLI and
                   the API), into engine.run.MergeOptions and verify.VerifyOptions
    docs/cli.md    its options table lists each row's flags for its commands, and the default

Adding an option is one row, and its keyword in the API functions that take it (a format's own options are rows
of the format registry, put at FORMAT_OPTIONS; verify's --reference- twins of the input rows are made at
REFERENCE_OPTIONS, a new format option's with it; an option that shapes the output is one declaration of
output_options.py, its row put at OUTPUT_OPTIONS).
Light on purpose: the registry is imported only when the rows are first asked for.
"""

from __future__ import annotations

import argparse
import os
import re
from dataclasses import dataclass, replace
from functools import cache
from pathlib import Path
from typing import Any

from distmerge import output_options
from distmerge.errors import InputError
from distmerge.input.source import is_source
from distmerge.option_kinds import ANNOTATIONS, Kind
from distmerge.output import incomplete_store, is_store
from distmerge.watcher.choose import parse_steps, positive_count

SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*$", re.IGNORECASE)
COMMANDS = ("merge", "inspect", "verify", "watch")
API = ("merge", "verify", "watch")  # the commands distmerge.api offers
KINDS = ANNOTATIONS  # how the API's signature spells each kind of value (option_kinds.py)


def parse_size(text: str) -> int:
    """'5GB' (decimal, like Hugging Face), '512MiB' (binary), or a plain number of bytes."""
    m = SIZE.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (try 5GB, 500MB, 2GiB)")
    unit = m[2].upper()
    base = 1024 if "I" in unit else 1000
    power = "BKMGT".index(unit[0]) if unit and unit[0] != "B" else 0
    value = float(m[1]) * base**power
    if value < 1:
        raise argparse.ArgumentTypeError(f"size must be at least 1 byte: {text!r}")
    return int(value)


def location(value: str) -> Path | str:
    """A folder, or an object-store URL kept as typed (a Path would fold s3://b/p into the folder s3:/b/p)."""
    return value if "://" in value else Path(value)


@dataclass(frozen=True, kw_only=True)
class Opt:
    """One option of one or more commands."""

    name: str  # the API's keyword, argparse's dest
    flags: tuple[str, ...] = ()  # the command line's spelling (a bare name: positional); () the API's only
    commands: tuple[str, ...]
    group: str = ""  # input | reference | output | run | "" (the command's own): --help's section (cli_options.TITLES)
    kind: Kind = Kind.TEXT
    help: str = ""
    default: Any = None  # as the command line spells it ("5GB"); None: not given
    choices: tuple[str, ...] | None = None
    metavar: str | None = None
    required: bool = False  # the API takes it positionally
    api: bool = True  # False: the command line's only (CLI_ONLY says why)
    parse: Any = None  # kind "value": the format option's own parser (formats.base.FormatOption.parse)
    repeat: bool = False  # may be given several times (merge's --input: an average's inputs); the API takes a list

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", Kind(self.kind))  # a row written with the kind's text; an unknown one fails


# The command line's options the API leaves out, and why (docs/api.md says the same).
CLI_ONLY = {
    "quiet": "progress=False is the API's default (progress=True prints)",
    "debug": "the caller holds the exception and its traceback",
    "json_summary": "the caller holds the MergeResult (report.summary_json)",
    "verify_against": "call distmerge.verify() after distmerge.merge()",
    "json": "inspect is the command line's only",
}
FORMAT, FORMAT_OPTIONS = "<format>", "<format options>"  # rows made from the format registry (rows())
IMPORT_OPTIONS = "<import options>"  # import's rows (import_options.py): it runs the other way, sharing none
OUTPUT_OPTIONS = "<output options>"  # the rows of the options that shape the output (output_options.py)
REFERENCE_OPTIONS = "<reference options>"  # verify's --reference- twins of the input rows (rows())
# The input rows verify reads --reference with, by name, and the end of each twin's help ("as --format, for
# --reference" + it); every format option (FORMAT_OPTIONS) has its twin too, so a new one gets it with no row here.
REFERENCE_TWINS = {"format": " (default: detected)",
                   "hf_config": ": folder with its config.json (default: its own)"}
REFERENCE = "reference_"  # a twin's name: this + the row's (its flag: --reference- + the row's, less its dashes)
MERGE, ALL = ("merge",), COMMANDS
RUN = ("merge", "verify", "watch")
WATCH = ("watch",)

OPTIONS: tuple[Opt | str, ...] = (
    # verify's own (ungrouped), in --help's order
    Opt(name="merged", flags=("--merged",), commands=("verify",), kind=Kind.LOCATION, required=True, metavar="DIR",
        repeat=True, help="merged model folder (model.safetensors.index.json or model.safetensors), or a training "
        "checkpoint to merge in memory (nothing written); once per checkpoint with --average: their average, as "
        "merge --average writes it"),
    Opt(name="reference", flags=("--reference",), commands=("verify",), kind=Kind.LOCATION, required=True,
        metavar="PATH",
        help="reference: a Hugging Face folder (safetensors or pytorch_model*.bin, sharded or not) or one "
             ".safetensors / .bin / .index.json file; or a training checkpoint (detected, or named by "
             "--reference-format), merged in memory too"),
    Opt(name="atol", flags=("--atol",), commands=("verify",), kind=Kind.FLOAT, metavar="A",
        help="absolute tolerance (allclose per element)"),
    Opt(name="rtol", flags=("--rtol",), commands=("verify",), kind=Kind.FLOAT, metavar="R",
        help="relative tolerance, times |reference|"),
    Opt(name="min_cosine", flags=("--min-cosine",), commands=("verify",), kind=Kind.FLOAT, metavar="C",
        help="least cosine similarity per tensor"),
    Opt(name="logits", flags=("--logits",), commands=("verify",), kind=Kind.SWITCH, default=False,
        help="also run both models (transformers, rank 0) on fixed token ids; compare logits"),
    Opt(name="json", flags=("--json",), commands=("verify",), kind=Kind.PATH, metavar="PATH",
        help="write every tensor's figures as JSON"),
    Opt(name="plot", flags=("--plot",), commands=("verify",), kind=Kind.PATH, metavar="PATH",
        help="write a PNG of max rel diff and cosine by layer and kind (attention, MLP, norms, embeddings/head); "
             "needs matplotlib: pip install 'distmerge[plot]'"),
    # watch's own (ungrouped), in --help's order
    Opt(name="once", flags=("--once",), commands=WATCH, kind=Kind.SWITCH, default=False,
        help="merge the finished steps once, show the summary and exit (without it: watch until SIGTERM or Ctrl-C)"),
    Opt(name="poll", flags=("--poll",), commands=WATCH, kind=Kind.FLOAT, default=30.0, metavar="SECONDS",
        help="seconds between two looks at the run (default 30)"),
    Opt(name="steps", flags=("--steps",), commands=WATCH, kind=Kind.VALUE, default="all", parse=parse_steps,
        metavar="WHICH", help="the steps to merge: all (default), latest, every:K (numbers that K divides), or "
                              "N,M (those numbers)"),
    Opt(name="average_last", flags=("--average-last",), commands=WATCH, kind=Kind.VALUE, parse=positive_count,
        metavar="K", help="also average the last K finished steps (merge --average of their checkpoints, oldest "
                          "first, weights 1/K) into OUT/average-last-K/, written again when a step finishes"),
    Opt(name="hf_upload_path", flags=("--hf-upload-path", "--hf_upload_path"), commands=WATCH, metavar="REPO",
        help="upload each merged step to this Hugging Face Hub repository, on a branch named after the step "
             "(global_step_200/actor: branch global_step_200-actor); needs huggingface_hub"),
    # the input and how to read it
    Opt(name="input", flags=("--input", "-i"), commands=MERGE, group="input", kind=Kind.LOCATION, required=True,
        repeat=True, help="checkpoint folder (e.g. .../actor) or s3://bucket/prefix; once per checkpoint with "
                          "--average"),
    Opt(name="input", flags=("--input", "-i"), commands=WATCH, group="input", kind=Kind.PATH, required=True,
        metavar="RUN", help="the run folder the trainer saves its checkpoints in (global_step_N/, iter_N/, "
                            "checkpoint-N/, checkpoint/step-N/ ...), a local folder"),
    Opt(name="input", flags=("input",), commands=("inspect",), group="input", kind=Kind.LOCATION, required=True,
        help="checkpoint folder (e.g. .../actor) or s3://bucket/prefix"),
    FORMAT,
    Opt(name="hf_config", flags=("--hf-config",), commands=ALL, group="input", kind=Kind.PATH, metavar="DIR",
        help="folder with config.json (default: huggingface/ inside the input, or beside it)"),
    FORMAT_OPTIONS,
    # verify's --reference when it is a checkpoint: the twins of the input rows above (REFERENCE_TWINS)
    REFERENCE_OPTIONS,
    # what the merged model looks like
    Opt(name="output", flags=("--output", "-o"), commands=MERGE, group="output", kind=Kind.LOCATION, required=True,
        help="folder for the merged model, or s3://bucket/prefix"),
    Opt(name="output", flags=("--output", "-o"), commands=WATCH, group="output", kind=Kind.LOCATION, required=True,
        metavar="OUT", help="each step's checkpoint RUN/<rel> is merged into OUT/<rel> (a folder or "
                            "s3://bucket/prefix)"),
    OUTPUT_OPTIONS,  # --dtype, --quantize, --max-shard-size, --lora ...: output_options.OUTPUT_OPTIONS
    Opt(name="overwrite", flags=("--overwrite",), commands=MERGE, group="output", kind=Kind.SWITCH, default=False,
        help="replace model files in a non-empty output"),
    Opt(name="resume", flags=("--resume",), commands=MERGE, group="output", kind=Kind.SWITCH, default=False,
        help="finish an interrupted merge: keep its completed files, redo the rest"),
    Opt(name="checksum", flags=("--checksum",), commands=(*MERGE, *WATCH), group="output", kind=Kind.SWITCH,
        default=False,
        help="record each file's sha256 in distmerge.manifest.json (about 1 s per GB per process)"),
    Opt(name="verify_against", flags=("--verify-against",), commands=MERGE, group="output", kind=Kind.PATH,
        metavar="HF_DIR", api=False,
        help="after the merge, run `verify --reference HF_DIR` in the same processes (bit-exact; a --dtype cast is "
             "accepted); exit 1 if it fails"),
    Opt(name="json", flags=("--json",), commands=("inspect",), kind=Kind.SWITCH, default=False, api=False,
        help="print JSON instead of a table"),
    # how the processes run
    Opt(name="device", flags=("--device",), commands=RUN, group="run", default="auto", choices=("auto", "cpu", "cuda"),
        help="where tensors are moved and computed (auto: cuda if present)"),
    Opt(name="timeout", flags=("--timeout",), commands=RUN, group="run", kind=Kind.FLOAT, default=600.0,
        metavar="SECONDS", help="a process that waits this long for another names it (rank, host, phase) and the "
                                "job ends; the group's own timeout is this + 25 s (default 600)"),
    Opt(name="quiet", flags=("--quiet", "-q"), commands=RUN, group="run", kind=Kind.SWITCH, default=False, api=False,
        help="no progress and no summary"),
    Opt(name="debug", flags=("--debug",), commands=ALL, group="run", kind=Kind.SWITCH, default=False, api=False,
        help="show tracebacks on errors"),
    Opt(name="budget", flags=("--budget",), commands=RUN, group="run", kind=Kind.SIZE, default="128MiB", metavar="SIZE",
        help="bytes each process assembles per round (two rounds are in flight); bounds memory (default 128MiB)"),
    Opt(name="json_summary", flags=("--json-summary",), commands=MERGE, group="run", kind=Kind.PATH, metavar="PATH",
        api=False, help="also write the summary as JSON"),
    # the API's own
    Opt(name="progress", commands=RUN, kind=Kind.SWITCH, default=False,
        help="rank 0 prints the progress and the summary (verify: its report), as the command does; otherwise "
             "nothing is printed and notes go to the `distmerge` logger"),
    Opt(name="group", commands=RUN, kind=Kind.GROUP,
        help="the running job's process group to use (default: its default group when torch.distributed is "
             "initialized); borrowed, never destroyed"),
    IMPORT_OPTIONS,
)


@cache
def rows(command: str) -> tuple[Opt, ...]:
    """The command's options, in --help's order, each placeholder of OPTIONS replaced by the rows it stands for."""
    from distmerge.options import import_options  # import's own table (it imports Opt from here)

    made = {FORMAT: lambda: [_format_row()], FORMAT_OPTIONS: _format_option_rows, REFERENCE_OPTIONS: _reference_rows,
            OUTPUT_OPTIONS: lambda: [output_row(o) for o in output_options.OUTPUT_OPTIONS],
            IMPORT_OPTIONS: lambda: [row for _, row in import_options.ROWS]}
    out = [r for row in OPTIONS for r in (made[row]() if isinstance(row, str) else [row])]
    return tuple(r for r in out if command in r.commands)


def _format_row() -> Opt:
    from distmerge.formats import registry

    return Opt(name="format", flags=("--format",), commands=ALL, group="input", default="auto",
               choices=tuple(registry.choices()), metavar="FORMAT", help=registry.help_text())


def _format_option_rows() -> list[Opt]:
    from distmerge.formats import registry

    return [Opt(name=opt.dest, flags=(opt.flag,), group="input", kind=Kind.VALUE, parse=opt.parse, metavar=opt.metavar,
                commands=tuple(c for c in ALL if c != "watch" or not opt.picks_save),  # watch finds saves itself
                help=f"{opt.help} [{', '.join(names)}]") for opt, names in registry.options()]


def output_row(opt: output_options.OutputOption) -> Opt:
    """An option that shapes the output, as a row of the table (output_options.py declares the rest of it)."""
    choices, help = opt.offered()
    return Opt(name=opt.name, flags=(opt.flag,), commands=opt.commands, group="output", kind=opt.kind,
               default=opt.default, choices=choices, metavar=opt.metavar, help=help, parse=opt.parse)


def _reference_rows() -> list[Opt]:
    """verify's --reference- twins: --reference-format, --reference-hf-config, and one per format option."""
    rows_ = [_format_row(), *(r for r in OPTIONS if isinstance(r, Opt) and r.name in REFERENCE_TWINS)]
    twins = [_twin(r, REFERENCE_TWINS[r.name]) for r in rows_]
    return twins + [_twin(r, " " + r.help[r.help.rindex("["):]) for r in _format_option_rows()]


def _twin(row: Opt, tail: str) -> Opt:
    return replace(row, name=REFERENCE + row.name, flags=("--reference-" + row.flags[0].removeprefix("--"),),
                   commands=("verify",), group="reference", help=f"as {row.flags[0]}, for --reference{tail}")


def format_option_names() -> tuple[str, ...]:
    return tuple(r.name for r in _format_option_rows())


def reference_format_option_names() -> dict[str, str]:
    """verify's --reference- twins of the format options: twin's name -> the format's own key."""
    return {REFERENCE + name: name for name in format_option_names()}


def api_rows(command: str) -> tuple[Opt, ...]:
    return tuple(r for r in rows(command) if r.api)


def cli_rows(command: str) -> tuple[Opt, ...]:
    return tuple(r for r in rows(command) if r.flags)


# -- the API: signature, docstring, values --------------------------------------------------------------------


def signature(command: str, returns: str):
    """Build the signature (inspect.Signature) that distmerge.<command> must have: the required options
    positionally, then every other one by keyword. api.py writes it out; the test compares the two."""
    import inspect  # the API's alone: the command line starts without it

    params = []
    for row in sorted(api_rows(command), key=lambda r: not r.required):  # stable: --help's order otherwise
        annotation = KINDS[row.kind] + (f" | list[{KINDS[row.kind]}]" if row.repeat else "") + (
            " | None" if row.default is None and not row.required else "")
        kind = inspect.Parameter.POSITIONAL_OR_KEYWORD if row.required else inspect.Parameter.KEYWORD_ONLY
        default = inspect.Parameter.empty if row.required else row.default
        params.append(inspect.Parameter(row.name, kind, default=default, annotation=annotation))
    return inspect.Signature(params, return_annotation=returns)


def docstring(command: str, summary: str) -> str:
    """`summary`, then each keyword with its command-line flag and help."""
    lines = [summary, "", "Options (the command's: `distmerge " + command + " --help`):"]
    for row in api_rows(command):
        flag = f" ({row.flags[0]})" if row.flags else ""
        lines.append(f"    {row.name}{flag}: {row.help}")
    return "\n".join(lines)


def from_keywords(command: str, given: dict[str, Any]) -> dict[str, Any]:
    """The API's arguments as the command line's parsed values: every API option of `command`, the default where
    not given. A bad value is an InputError naming the keyword; an unknown keyword a TypeError, as Python's."""
    known = {r.name: r for r in api_rows(command)}
    unknown = sorted(set(given) - set(known))
    if unknown:
        raise TypeError(f"distmerge.{command}() got unexpected keyword argument(s) {', '.join(unknown)}")
    return {name: _value(row, given.get(name, row.default), given=name in given) for name, row in known.items()}


def _value(row: Opt, value: Any, *, given: bool) -> Any:
    if value is None:
        if row.default is not None or row.required:
            raise InputError(f"{row.name}=None: give a value (default {row.default!r})")
        return None
    try:
        parsed = _many(row, [_parsed(row, v) for v in value]) if row.repeat and isinstance(value, (list, tuple)) \
            else _parsed(row, value)
    except (argparse.ArgumentTypeError, ValueError, TypeError) as err:
        raise InputError(f"{row.name}={value!r}: {err}") from None
    if row.choices is not None and parsed not in row.choices:
        raise InputError(f"{row.name}={value!r}: choose one of {', '.join(row.choices)}")
    return parsed


def _parsed(row: Opt, value: Any) -> Any:
    if row.kind == Kind.GROUP:
        return value
    if row.kind == Kind.SWITCH:
        if not isinstance(value, bool):
            raise TypeError("True or False")
        return value
    if row.kind == Kind.PATH:
        return Path(os.fspath(value))
    if row.kind == Kind.LOCATION:
        if is_source(value):  # a Source object: input/source.py
            return value
        if is_store(value):  # a Store object (output/store.py), refused now if it lacks a method of any role
            if (lacking := incomplete_store(value)) is not None:
                raise TypeError(lacking)
            return value
        return location(os.fspath(value))
    if isinstance(value, bool):
        raise TypeError(f"not a {row.kind}")
    if row.kind == Kind.SIZE and isinstance(value, int):
        if value < 1:
            raise ValueError("a size is at least 1 byte")
        return value
    if row.kind == Kind.FLOAT:
        return float(value)
    if row.kind == Kind.VALUE and isinstance(value, (list, tuple)):  # a list of numbers (--average-weights)
        value = ",".join(repr(float(v)) for v in value)
    if row.kind == Kind.TEXT:
        return os.fspath(value) if isinstance(value, os.PathLike) else _text(value)
    return (parse_size if row.kind == Kind.SIZE else row.parse)(str(value))


def _many(row: Opt, values: list[Any]) -> Any:
    """A repeated option's values: one as it is (so one --input is what it always was), several as a tuple."""
    if not values:
        raise ValueError("give at least one")
    return values[0] if len(values) == 1 else tuple(values)


def _text(value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError("a string")
    return value


def from_namespace(args: argparse.Namespace, command: str) -> dict[str, Any]:
    """The command line's parsed values of `command`'s options, by name (a repeated option's as _many makes them)."""
    return {row.name: _many(row, value) if row.repeat and isinstance(value := getattr(args, row.name), list)
            else getattr(args, row.name) for row in cli_rows(command)}


def parsed_default(row: Opt) -> Any:
    """The default as parsed (argparse parses a string default with the option's type)."""
    return None if row.default is None else _parsed(row, row.default)


def given(values: dict[str, Any], names: tuple[str, ...]) -> dict[str, Any]:
    """The options of `names` given (left out when None)."""
    return {name: values[name] for name in names if values.get(name) is not None}


def with_defaults(command: str, **values: Any) -> dict[str, Any]:
    """Every option of `command` at its default, but `values` (typed): what a caller inside distmerge builds a
    request from (verl's test, merge --verify-against)."""
    out = {row.name: parsed_default(row) for row in rows(command)}
    return {**out, **values}


# -- errors in the API's spelling ---------------------------------------------------------------------------------

FLAG = re.compile(r"(?<![\w-])--[A-Za-z][\w-]*")  # a long flag, whole (--reference-format, not its --reference)


def api_spelling(message: str, command: str) -> str:
    """`message`, written for the command line, in the API's spelling: each flag of an option distmerge.<command>
    takes becomes its keyword (`--overwrite` -> `overwrite=True`, a switch; `--dtype` -> `dtype`; `--merged` ->
    `merged`); a flag the API does not take (CLI_ONLY's) stays as it is."""
    keywords = {flag: f"{row.name}=True" if row.kind == Kind.SWITCH else row.name
                for row in api_rows(command) for flag in row.flags if flag.startswith("--")}
    return FLAG.sub(lambda m: keywords.get(m[0], m[0]), message)

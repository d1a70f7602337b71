"""The options of `distmerge import`, rows of the same kind as the table of options.OPTIONS, kept apart: import
runs the other way (a Hugging Face model in, a training layout out), so it shares none of merge's input or output
options, only the run's (--timeout, --debug, --quiet)."""

from __future__ import annotations

import argparse
from typing import Any

from distmerge.option_kinds import Kind
from distmerge.options import Opt
from distmerge.options.cli_options import _argparse_keywords

IMPORT = ("import",)
TARGETS = ("megatron", "torchtitan")  # --to: the training layouts import writes


def positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1: {text!r}")
    return value


ROWS: tuple[tuple[str | None, Opt], ...] = (
    ("input", Opt(name="input", flags=("--input", "-i"), commands=IMPORT, kind=Kind.PATH, required=True,
                  metavar="HF_DIR", help="Hugging Face model folder (config.json and safetensors weights), or any "
                                            "checkpoint distmerge merges")),
    ("input", Opt(name="hf_config", flags=("--hf-config",), commands=IMPORT, kind=Kind.PATH, metavar="DIR",
                  help="config.json's folder, when --input is a training checkpoint (merged first, as "
                       "`distmerge merge` merges it) and does not carry one")),
    ("output", Opt(name="output", flags=("--output", "-o"), commands=IMPORT, kind=Kind.PATH, required=True,
                   metavar="OUT", help="folder for the training checkpoint (Megatron-LM: pass it as --load)")),
    ("output", Opt(name="to", flags=("--to",), commands=IMPORT, default="megatron", choices=TARGETS,
                   help="the training layout: megatron (Megatron-LM torch_dist, the default) or torchtitan (a DCP "
                        "step-0 folder in torchtitan's names, loaded at any world size)")),
    ("output", Opt(name="tp", flags=("--tp",), commands=IMPORT, kind=Kind.VALUE, parse=positive, default="1",
                   metavar="T", help="tensor-parallel size the training job runs with; must divide the attention "
                                     "heads and query groups (default 1)")),
    ("output", Opt(name="pp", flags=("--pp",), commands=IMPORT, kind=Kind.VALUE, parse=positive, default="1",
                   metavar="P", help="pipeline-parallel size; must divide the layers (default 1)")),
    ("output", Opt(name="ep", flags=("--ep",), commands=IMPORT, kind=Kind.VALUE, parse=positive, default="1",
                   metavar="E", help="expert-parallel size of an MoE model; must divide the experts (default 1)")),
    ("output", Opt(name="make_vocab_size_divisible_by", flags=("--make-vocab-size-divisible-by",), commands=IMPORT,
                   kind=Kind.VALUE, parse=positive, default="128", metavar="K",
                   help="as Megatron-LM's flag: the vocabulary is padded to a multiple of K x TP (default 128)")),
    ("output", Opt(name="overwrite", flags=("--overwrite",), commands=IMPORT, kind=Kind.SWITCH, default=False,
                   help="replace an earlier import in a non-empty output")),
    ("run", Opt(name="timeout", flags=("--timeout",), commands=IMPORT, kind=Kind.FLOAT, default=600.0,
                metavar="SECONDS", help="a process that waits this long for another names it and the job ends "
                                        "(default 600)")),
    ("run", Opt(name="quiet", flags=("--quiet", "-q"), commands=IMPORT, kind=Kind.SWITCH, default=False,
                help="no summary line")),
    ("run", Opt(name="debug", flags=("--debug",), commands=IMPORT, kind=Kind.SWITCH, default=False,
                help="show tracebacks on errors")),
)


def add_import_options(parser: argparse.ArgumentParser) -> None:
    """Every option of `import`, in its section of --help."""
    sections: dict[str | None, Any] = {"input": parser.add_argument_group("input"),
                                       "output": parser.add_argument_group("output"),
                                       "run": parser.add_argument_group("run")}
    for section, row in ROWS:
        sections[section].add_argument(*row.flags, **_argparse_keywords(row))

"""The options of `distmerge import`, rows of the same kind as the table of options.OPTIONS, kept apart: import
runs the other way (a Hugging Face model in, a training layout out), so it shares none of merge's input or output
options, only the run's (--timeout, --debug, --quiet). options.rows("import") reads them, so the API's
distmerge.api.import_checkpoint is checked and parsed against this table as merge() is against its own."""

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
    ("input", Opt(name="input", flags=("--input", "-i"), commands=IMPORT, kind=Kind.LOCATION, required=True,
                  metavar="HF_DIR", help="Hugging Face model folder (config.json and safetensors weights), or any "
                                            "checkpoint distmerge merges; a folder or s3://bucket/prefix")),
    ("input", Opt(name="hf_config", flags=("--hf-config",), commands=IMPORT, kind=Kind.LOCATION, metavar="DIR",
                  help="config.json's folder, when --input is a training checkpoint (merged first, as "
                       "`distmerge merge` merges it) and does not carry one")),
    ("output", Opt(name="output", flags=("--output", "-o"), commands=IMPORT, kind=Kind.LOCATION, required=True,
                   metavar="OUT", help="folder or s3://bucket/prefix for the training checkpoint (Megatron-LM: pass "
                                       "it as --load)")),
    ("output", Opt(name="to", flags=("--to",), commands=IMPORT, default="megatron", choices=TARGETS,
                   help="the training layout: megatron (Megatron-LM torch_dist, the default) or torchtitan (a DCP "
                        "step-0 folder in torchtitan's names, loaded at any world size)")),
    ("output", Opt(name="tp", flags=("--tp",), commands=IMPORT, kind=Kind.VALUE, parse=positive, default=1,
                   metavar="T", help="tensor-parallel size the training job runs with; must divide the attention "
                                     "heads and query groups (default 1)")),
    ("output", Opt(name="pp", flags=("--pp",), commands=IMPORT, kind=Kind.VALUE, parse=positive, default=1,
                   metavar="P", help="pipeline-parallel size; must divide the layers, unless the first or last "
                                     "stage's are given (default 1)")),
    ("output", Opt(name="vpp", flags=("--vpp",), commands=IMPORT, kind=Kind.VALUE, parse=positive, metavar="V",
                   help="virtual pipeline stages per pipeline rank (Megatron-LM's interleaved schedule, "
                        "--num-virtual-stages-per-pipeline-rank); needs --pp above 1 and must divide each "
                        "rank's layers")),
    ("output", Opt(name="decoder_first_pipeline_num_layers", flags=("--decoder-first-pipeline-num-layers",),
                   commands=IMPORT, kind=Kind.VALUE, parse=positive, metavar="N",
                   help="layers of the first pipeline stage, as Megatron-LM's flag (uneven stages: the middle "
                        "stages share the rest equally)")),
    ("output", Opt(name="decoder_last_pipeline_num_layers", flags=("--decoder-last-pipeline-num-layers",),
                   commands=IMPORT, kind=Kind.VALUE, parse=positive, metavar="N",
                   help="layers of the last pipeline stage, as Megatron-LM's flag")),
    ("output", Opt(name="ep", flags=("--ep",), commands=IMPORT, kind=Kind.VALUE, parse=positive, default=1,
                   metavar="E", help="expert-parallel size of an MoE model; must divide the experts (default 1)")),
    ("output", Opt(name="make_vocab_size_divisible_by", flags=("--make-vocab-size-divisible-by",), commands=IMPORT,
                   kind=Kind.VALUE, parse=positive, default=128, metavar="K",
                   help="as Megatron-LM's flag: the vocabulary is padded to a multiple of K x TP (default 128)")),
    ("output", Opt(name="overwrite", flags=("--overwrite",), commands=IMPORT, kind=Kind.SWITCH, default=False,
                   help="replace an earlier import in a non-empty output")),
    ("run", Opt(name="timeout", flags=("--timeout",), commands=IMPORT, kind=Kind.FLOAT, default=600.0,
                metavar="SECONDS", help="a process that waits this long for another names it and the job ends "
                                        "(default 600)")),
    ("run", Opt(name="quiet", flags=("--quiet", "-q"), commands=IMPORT, kind=Kind.SWITCH, default=False,
                api=False, help="no summary line")),
    ("run", Opt(name="debug", flags=("--debug",), commands=IMPORT, kind=Kind.SWITCH, default=False, api=False,
                help="show tracebacks on errors")),
    # the API's only (api.import_checkpoint), as merge's rows of the same names
    ("run", Opt(name="progress", commands=IMPORT, kind=Kind.SWITCH, default=False,
                help="rank 0 prints the summary line, as the command does; otherwise nothing is printed")),
    ("run", Opt(name="group", commands=IMPORT, kind=Kind.GROUP,
                help="the running job's process group to use (default: its default group when torch.distributed "
                     "is initialized); borrowed, never destroyed")),
)


def add_import_options(parser: argparse.ArgumentParser) -> None:
    """Every option of `import`, in its section of --help."""
    sections: dict[str | None, Any] = {"input": parser.add_argument_group("input"),
                                       "output": parser.add_argument_group("output"),
                                       "run": parser.add_argument_group("run")}
    for section, row in ROWS:
        if row.flags:  # the API's only rows have none
            sections[section].add_argument(*row.flags, **_argparse_keywords(row))

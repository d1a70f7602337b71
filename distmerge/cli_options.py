"""The command-line options merge, inspect and verify share (argparse parents), and their typed form.

The --format choices and each format's own options come from the format registry.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*$", re.IGNORECASE)


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


CAST_NAMES = ["keep", "bf16", "fp16", "fp32", "bfloat16", "float16", "float32"]


def add_input_options(parser: argparse.ArgumentParser, *, positional: bool = False, with_input: bool = True,
                      title: str = "input") -> None:
    """The input and how to read it (merge, inspect, verify): the format and the format's own options.
    `with_input` False: the command names the checkpoint its own way (verify's --merged)."""
    from distmerge.formats import registry

    group = parser.add_argument_group(title)
    if with_input and positional:
        group.add_argument("input", type=location, help="checkpoint folder (e.g. .../actor) or s3://bucket/prefix")
    elif with_input:
        group.add_argument("--input", "-i", type=location, required=True,
                           help="checkpoint folder (e.g. .../actor) or s3://bucket/prefix")
    group.add_argument("--format", default="auto", choices=registry.choices(), metavar="FORMAT",
                       help=registry.help_text())
    group.add_argument("--hf-config", type=Path, metavar="DIR",
                       help="folder with config.json (default: huggingface/ inside the input, or beside it)")
    for opt, names in registry.options():
        group.add_argument(opt.flag, dest=opt.dest, type=opt.parse, metavar=opt.metavar,
                           help=f"{opt.help} [{', '.join(names)}]")


def add_output_options(parser: argparse.ArgumentParser, *, with_folder: bool = True,
                       title: str = "output") -> argparse._ArgumentGroup:
    """What the merged model looks like (merge, inspect, verify). Returns the group, for merge's own options."""
    group = parser.add_argument_group(title)
    if with_folder:
        group.add_argument("--output", "-o", type=location, required=True,
                           help="folder for the merged model, or s3://bucket/prefix")
    group.add_argument("--dtype", choices=CAST_NAMES, default="keep",
                       help="cast floating tensors (default: keep the checkpoint's dtype)")
    group.add_argument("--max-shard-size", type=parse_size, default=parse_size("5GB"), metavar="SIZE",
                       help="largest output file (default 5GB; one file is named model.safetensors)")
    group.add_argument("--lora", choices=["auto", "adapter", "merge"], default="auto",
                       help="LoRA checkpoints: base model + PEFT adapter (auto, adapter) or fused weights (merge)")
    group.add_argument("--lora-alpha", type=float, metavar="ALPHA",
                       help="LoRA alpha when lora_train_meta.json is missing or wrong")
    group.add_argument("--base-model", metavar="NAME_OR_DIR",
                       help="LoRA: the base model. A Hugging Face folder (config.json + safetensors): its weights "
                            "complete a LoRA-only save (base model + adapter, or fused with --lora merge). Any value: "
                            "base_model_name_or_path in adapter_config.json (default: the config's)")
    return group


def add_run_options(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """How the processes run (merge, verify)."""
    group = parser.add_argument_group("run")
    group.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                       help="where tensors are moved and computed (auto: cuda if present)")
    group.add_argument("--timeout", type=float, default=600.0, metavar="SECONDS",
                       help="give up when another process is silent this long (default 600)")
    group.add_argument("--quiet", "-q", action="store_true", help="no progress and no summary")
    group.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    return group


def add_budget_option(group: argparse._ArgumentGroup) -> None:
    """--budget (merge, verify of a checkpoint: both run the merge's rounds)."""
    group.add_argument("--budget", type=parse_size, default=parse_size("128MiB"), metavar="SIZE",
                       help="bytes each process assembles per round (two rounds are in flight); bounds memory "
                       "(default 128MiB)")


def format_options(args: argparse.Namespace) -> dict:
    """The format options given on the command line (the ones left out are not passed)."""
    from distmerge.formats import registry

    return {opt.dest: getattr(args, opt.dest) for opt, _ in registry.options() if getattr(args, opt.dest) is not None}


def location(value: str) -> Path | str:
    """A folder, or an object-store URL kept as typed (a Path would fold s3://b/p into the folder s3:/b/p)."""
    return value if "://" in value else Path(value)


def base_model_dir(args: argparse.Namespace) -> Path | None:
    """--base-model as a second input root: only when it names a folder (a hub name only names the base)."""
    value = getattr(args, "base_model", None)
    return Path(value) if value and Path(value).is_dir() else None


def output_settings(args: argparse.Namespace):
    """The options that shape the output, typed (inspect has no --budget: it plans in one round)."""
    from distmerge.families.base import LoraOptions
    from distmerge.prepare import OutputSettings

    return OutputSettings(dtype=args.dtype, max_shard_bytes=args.max_shard_size,
                          budget_bytes=getattr(args, "budget", 2**62), output=getattr(args, "output", None) or Path(),
                          lora=LoraOptions(mode=args.lora, alpha=args.lora_alpha, base_model=args.base_model))

"""Command line: `distmerge merge` (under torchrun or alone) and `distmerge inspect`."""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

from distmerge import __version__
from distmerge.errors import DistmergeError

SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*$", re.IGNORECASE)

EPILOG = """examples:
  torchrun --nproc-per-node 8 -m distmerge merge --input ckpts/global_step_1000/actor --output merged/
  python -m distmerge merge --input ckpts/global_step_1000/actor --output merged/ --dtype bf16
  distmerge inspect ckpts/global_step_1000/actor

Under torchrun each process reads a share of the rank files, assembles and writes its own output
files; rank 0 writes config.json and, last, model.safetensors.index.json (no index = not finished).
"""


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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="distmerge",
        description="Merge sharded training checkpoints into one Hugging Face model (safetensors).",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"distmerge {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    merge = sub.add_parser("merge", help="merge a checkpoint into safetensors", epilog=EPILOG,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    merge.add_argument("--input", "-i", type=Path, required=True, help="checkpoint folder (e.g. .../actor)")
    merge.add_argument("--output", "-o", type=Path, required=True, help="folder for the merged model")
    merge.add_argument("--format", default="auto", help="input layout: auto (default), fsdp, dcp or dcp-hf")
    merge.add_argument("--hf-config", type=Path, metavar="DIR",
                       help="folder with config.json (default: huggingface/ inside the input)")
    merge.add_argument("--dtype", choices=["keep", "bf16", "fp16", "fp32"], default="keep",
                       help="cast floating tensors (default: keep the checkpoint's dtype)")
    merge.add_argument("--max-shard-size", type=parse_size, default=parse_size("5GB"), metavar="SIZE",
                       help="largest output file (default 5GB; one file is named model.safetensors)")
    merge.add_argument("--budget", type=parse_size, default=parse_size("256MiB"), metavar="SIZE",
                       help="bytes each process assembles per round; bounds memory (default 256MiB)")
    merge.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                       help="where fragments are exchanged and assembled (auto: cuda if present)")
    merge.add_argument("--overwrite", action="store_true", help="replace model files in a non-empty output")
    merge.add_argument("--timeout", type=float, default=600.0, metavar="SECONDS",
                       help="give up when another process is silent this long (default 600)")
    merge.add_argument("--quiet", "-q", action="store_true", help="no progress and no summary")
    merge.add_argument("--json-summary", type=Path, metavar="PATH", help="also write the summary as JSON")
    merge.add_argument("--debug", action="store_true", help="show tracebacks on errors")

    inspect = sub.add_parser("inspect", help="describe a checkpoint and the files a merge would write")
    inspect.add_argument("input", type=Path, help="checkpoint folder")
    inspect.add_argument("--format", default="auto", help="input layout: auto (default), fsdp, dcp or dcp-hf")
    inspect.add_argument("--hf-config", type=Path, metavar="DIR", help="folder with config.json")
    inspect.add_argument("--dtype", choices=["keep", "bf16", "fp16", "fp32"], default="keep")
    inspect.add_argument("--max-shard-size", type=parse_size, default=parse_size("5GB"), metavar="SIZE")
    inspect.add_argument("--json", action="store_true", help="print JSON instead of a table")
    inspect.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "inspect":
            from distmerge.inspect import run_inspect

            return run_inspect(args)
        return _run_merge(args)
    except DistmergeError as err:
        _report_error(err, args.debug)
        return 1
    except KeyboardInterrupt:
        print("distmerge: interrupted", file=sys.stderr, flush=True)
        return 130


def _run_merge(args: argparse.Namespace) -> int:
    from distmerge.comm import Comm
    from distmerge.engine import MergeOptions, merge, resolve_device
    from distmerge.formats import registry
    from distmerge.report import Progress, print_summary, summary_json

    opts = MergeOptions(
        input=args.input, output=args.output, format=args.format, hf_config=args.hf_config, dtype=args.dtype,
        max_shard_bytes=args.max_shard_size, budget_bytes=args.budget, overwrite=args.overwrite,
    )
    registry.warm_up(args.input, args.format)
    comm = Comm(device=resolve_device(args.device), timeout_s=args.timeout)
    try:
        result = merge(opts, comm, Progress(enabled=comm.rank == 0 and not args.quiet))
        if comm.rank == 0:
            if not args.quiet:
                print_summary(result)
            if args.json_summary:
                args.json_summary.write_text(summary_json(result))
        return 0
    except DistmergeError:
        raise
    except Exception as err:  # a collective broke (a peer died, a timeout): this rank's own view
        raise DistmergeError(f"rank {comm.rank}: {type(err).__name__}: {str(err).splitlines()[0][:300]}") from err
    finally:
        comm.close()
        sys.stdout.flush()


def _report_error(err: DistmergeError, debug: bool) -> None:
    rank = int(os.environ.get("RANK", "0"))
    shared = hasattr(err, "origin_rank")  # every rank holds the same error: rank 0 speaks for all
    if shared and rank != 0:
        return
    if debug:
        import traceback

        print(getattr(err, "trace", None) or "".join(traceback.format_exception(err)), file=sys.stderr)
    print(f"distmerge: error: {err}", file=sys.stderr, flush=True)

"""Command line: `distmerge merge` and `distmerge verify` (under torchrun or alone), `distmerge inspect`."""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

from distmerge import __version__
from distmerge.errors import DistmergeError, InputError

SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*$", re.IGNORECASE)

EPILOG = """examples:
  torchrun --nproc-per-node 8 -m distmerge merge --input ckpts/global_step_1000/actor --output merged/
  python -m distmerge merge --input ckpts/global_step_1000/actor --output merged/ --dtype bf16
  torchrun --nproc-per-node 8 -m distmerge merge --input megatron_ckpts/ --output merged/ --hf-config hf_model/
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


FORMAT_HELP = "input layout: auto (default), fsdp, megatron (mp_rank_*), megatron-dist (torch_dist), dcp, dcp-hf"


def _iteration(text: str) -> str:
    if text != "release" and not text.isdigit():
        raise argparse.ArgumentTypeError(f"not an iteration: {text!r} (a number such as 1000, or release)")
    return text


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
    merge.add_argument("--format", default="auto", help=FORMAT_HELP)
    merge.add_argument("--hf-config", type=Path, metavar="DIR",
                       help="folder with config.json (default: huggingface/ inside the input, or beside it)")
    merge.add_argument("--iteration", type=_iteration, metavar="N",
                       help="Megatron: the save to merge, a number or 'release' (default: the one named in "
                       "latest_checkpointed_iteration.txt)")
    merge.add_argument("--dtype", choices=["keep", "bf16", "fp16", "fp32"], default="keep",
                       help="cast floating tensors (default: keep the checkpoint's dtype)")
    merge.add_argument("--max-shard-size", type=parse_size, default=parse_size("5GB"), metavar="SIZE",
                       help="largest output file (default 5GB; one file is named model.safetensors)")
    merge.add_argument("--budget", type=parse_size, default=parse_size("128MiB"), metavar="SIZE",
                       help="bytes each process assembles per round (two rounds are in flight); bounds memory "
                       "(default 128MiB)")
    merge.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                       help="where fragments are exchanged and assembled (auto: cuda if present)")
    merge.add_argument("--overwrite", action="store_true", help="replace model files in a non-empty output")
    merge.add_argument("--resume", action="store_true",
                       help="finish an interrupted merge: keep its completed files, redo the rest")
    merge.add_argument("--lora", choices=["auto", "adapter", "merge"], default="auto",
                       help="LoRA checkpoints: base model + PEFT adapter (auto, adapter) or fused weights (merge)")
    merge.add_argument("--lora-alpha", type=float, metavar="ALPHA",
                       help="LoRA alpha when lora_train_meta.json is missing or wrong")
    merge.add_argument("--base-model", metavar="NAME_OR_PATH",
                       help="base_model_name_or_path for adapter_config.json (default: the config's, else --output)")
    merge.add_argument("--checksum", action="store_true",
                       help="record each file's sha256 in distmerge.manifest.json (about 1 s per GB per process)")
    merge.add_argument("--timeout", type=float, default=600.0, metavar="SECONDS",
                       help="give up when another process is silent this long (default 600)")
    merge.add_argument("--quiet", "-q", action="store_true", help="no progress and no summary")
    merge.add_argument("--json-summary", type=Path, metavar="PATH", help="also write the summary as JSON")
    merge.add_argument("--verify-against", type=Path, metavar="HF_DIR",
                       help="after the merge, run `verify --reference HF_DIR` in the same processes "
                            "(bit-exact; a --dtype cast is accepted); exit 1 if it fails")
    merge.add_argument("--debug", action="store_true", help="show tracebacks on errors")

    inspect = sub.add_parser("inspect", help="describe a checkpoint and the files a merge would write")
    inspect.add_argument("input", type=Path, help="checkpoint folder")
    inspect.add_argument("--format", default="auto", help=FORMAT_HELP)
    inspect.add_argument("--hf-config", type=Path, metavar="DIR", help="folder with config.json")
    inspect.add_argument("--iteration", type=_iteration, metavar="N", help="Megatron: the save to describe")
    inspect.add_argument("--dtype", choices=["keep", "bf16", "fp16", "fp32"], default="keep")
    inspect.add_argument("--max-shard-size", type=parse_size, default=parse_size("5GB"), metavar="SIZE")
    inspect.add_argument("--json", action="store_true", help="print JSON instead of a table")
    inspect.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    add_verify_parser(sub)
    return parser


VERIFY_DESCRIPTION = """\
Compare a merged model with a reference, tensor by tensor: names both ways, shape, dtype, bit-exactness,
max abs / max rel / mean abs diff and cosine similarity.

Without tolerances every tensor must be bit-exact and of the reference's dtype. With any of --atol,
--rtol, --min-cosine, a tensor passes when it is within them, and a dtype other than the reference's is
accepted: the reference is cast to the merged dtype before comparing (the report says so per tensor).
A tied lm_head.weight present on one side only is accepted when the merged config.json ties embeddings
and it equals the embedding on the other side."""

VERIFY_EPILOG = """examples:
  torchrun --nproc-per-node 8 -m distmerge verify --merged merged/ --reference hf_model/
  python -m distmerge verify --merged merged/ --reference full_state_dict.safetensors --json verify.json
  python -m distmerge verify --merged merged/ --reference hf_model/ --atol 1e-3 --min-cosine 0.9999 --logits

Each process checks the tensors of the merged files it owns (read one tensor at a time on both sides);
rank 0 prints the worst tensors and one verdict line. Exit 0 only when every tensor passes.
"""


def add_verify_parser(sub) -> None:
    verify = sub.add_parser(
        "verify", help="compare a merged model with a reference, tensor by tensor", epilog=VERIFY_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=VERIFY_DESCRIPTION,
    )
    verify.add_argument("--merged", type=Path, required=True, metavar="DIR",
                        help="merged model folder (model.safetensors.index.json or model.safetensors)")
    verify.add_argument("--reference", type=Path, required=True, metavar="PATH",
                        help="reference: a Hugging Face folder (safetensors or pytorch_model*.bin, sharded or "
                             "not) or one .safetensors / .bin / .index.json file")
    verify.add_argument("--atol", type=float, metavar="A", help="absolute tolerance (allclose per element)")
    verify.add_argument("--rtol", type=float, metavar="R", help="relative tolerance, times |reference|")
    verify.add_argument("--min-cosine", type=float, metavar="C", help="least cosine similarity per tensor")
    verify.add_argument("--logits", action="store_true",
                        help="also run both models (transformers, rank 0) on fixed token ids; compare logits")
    verify.add_argument("--json", type=Path, metavar="PATH", help="write every tensor's figures as JSON")
    verify.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                        help="where figures are computed (auto: cuda if present)")
    verify.add_argument("--timeout", type=float, default=600.0, metavar="SECONDS",
                        help="give up when another process is silent this long (default 600)")
    verify.add_argument("--quiet", "-q", action="store_true", help="no table; the verdict line only")
    verify.add_argument("--debug", action="store_true", help="show tracebacks on errors")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "inspect":
            from distmerge.inspect import run_inspect

            return run_inspect(args)
        if args.command == "verify":
            from distmerge.verify import run_verify

            return run_verify(args)
        return _run_merge(args)
    except DistmergeError as err:
        _report_error(err, args.debug)
        return 1
    except KeyboardInterrupt:
        print("distmerge: interrupted", file=sys.stderr, flush=True)
        return 130


def _run_merge(args: argparse.Namespace) -> int:
    from distmerge.comm import process_group
    from distmerge.engine import MergeOptions, merge, resolve_device
    from distmerge.formats import registry
    from distmerge.mapping import LoraOptions
    from distmerge.report import Progress, print_summary, summary_json

    opts = MergeOptions(
        input=args.input, output=args.output, format=args.format, hf_config=args.hf_config, dtype=args.dtype,
        iteration=args.iteration,
        max_shard_bytes=args.max_shard_size, budget_bytes=args.budget, overwrite=args.overwrite,
        resume=args.resume, checksum=args.checksum,
        lora=LoraOptions(mode=args.lora, alpha=args.lora_alpha, base_model=args.base_model),
    )
    registry.warm_up(args.input, args.format)
    if args.verify_against is not None and not args.verify_against.exists():  # before hours of merging
        raise InputError(f"--verify-against {args.verify_against} does not exist: pass the reference model")
    with process_group(device=resolve_device(args.device), timeout_s=args.timeout) as comm:
        result = merge(opts, comm, Progress(enabled=comm.rank == 0 and not args.quiet))
        if comm.rank == 0:
            if not args.quiet:
                print_summary(result)
            if args.json_summary:
                args.json_summary.write_text(summary_json(result))
        if args.verify_against is not None:
            return _verify_after_merge(args, comm)
        return 0


def _verify_after_merge(args: argparse.Namespace, comm) -> int:
    """Same processes, same group: the merged files are still in the page cache."""
    from distmerge.verify import VerifyOptions, verify_and_report
    from distmerge.verify_report import Criteria

    sys.stdout.flush()  # the merge summary before the verify table
    crit = Criteria(accept_cast=args.dtype != "keep")  # the merge cast on purpose; values must match the cast
    return verify_and_report(VerifyOptions(merged=args.output, reference=args.verify_against, criteria=crit,
                                           quiet=args.quiet), comm)


def _report_error(err: DistmergeError, debug: bool) -> None:
    rank = int(os.environ.get("RANK", "0"))
    shared = hasattr(err, "origin_rank")  # every rank holds the same error: rank 0 speaks for all
    if shared and rank != 0:
        return
    if debug:
        import traceback

        print(getattr(err, "trace", None) or "".join(traceback.format_exception(err)), file=sys.stderr)
    print(f"distmerge: error: {err}", file=sys.stderr, flush=True)

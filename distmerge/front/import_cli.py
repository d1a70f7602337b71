"""`distmerge import`: a Hugging Face model written as a training checkpoint (docs/import.md). Its parser and its
run; cli.py adds the one and calls the other."""

from __future__ import annotations

import argparse
from pathlib import Path

IMPORT_DESCRIPTION = """\
Write a Hugging Face model as a training checkpoint that a job starts from: a Megatron-LM torch_dist save at the
TP, PP and EP the job runs with (fused QKV per query group, [gate; up], the vocabulary padded for TP, tied
embeddings, MoE experts split over EP), made with the same tables merge reads Megatron saves with, walked
backwards; or, with --to torchtitan, a DCP step-0 folder in torchtitan's names that its checkpointer loads at any
world size. Run it alone or under torchrun: each process writes the files it owns, reading only the rows they
need; the files are the same for any number."""

IMPORT_EPILOG = """examples:
  python -m distmerge import --input hf_model/ --output megatron_ckpt/ --tp 2 --pp 2
  torchrun --nproc-per-node 8 -m distmerge import --input hf_model/ --output megatron_ckpt/ --tp 8
  python -m distmerge import --input qwen3_moe/ --output megatron_moe/ --tp 2 --ep 4
  python -m distmerge import --input hf_model/ --output titan_ckpt/ --to torchtitan

Then start Megatron-LM with --load megatron_ckpt/ --finetune (the save is a release: iteration 0, no optimizer
or RNG state) and the same --tensor-model-parallel-size, --pipeline-model-parallel-size,
--expert-model-parallel-size and --make-vocab-size-divisible-by. Start torchtitan with
--checkpoint.initial_load_path titan_ckpt/step-0 (an absolute path). docs/import.md: the layout, what is checked,
what is not written yet.
"""


def add_import_parser(sub) -> None:
    from distmerge.options.import_options import add_import_options

    parser = sub.add_parser("import",
                            help="write a Hugging Face model as a Megatron-LM or torchtitan checkpoint to train from",
                            description=IMPORT_DESCRIPTION, epilog=IMPORT_EPILOG,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    add_import_options(parser)


def run_import_command(args: argparse.Namespace, on_silence) -> int:
    """The import in a process group of our own (torchrun's processes, or this one alone); rank 0 prints one line."""
    from distmerge.distributed.comm import process_group
    from distmerge.importer.plan import Layout
    from distmerge.importer.run import ImportOptions, run_import

    layout = Layout(tp=args.tp, pp=args.pp, ep=args.ep, divisible_by=args.make_vocab_size_divisible_by)
    opts = ImportOptions(input=Path(args.input), output=Path(args.output), layout=layout, overwrite=args.overwrite,
                         hf_config=Path(args.hf_config) if args.hf_config else None)
    if args.to == "torchtitan":
        from distmerge.importer.torchtitan_run import describe, run_torchtitan_import

        _refuse_megatron_options(args)
        with process_group(device="cpu", timeout_s=args.timeout, on_silence=on_silence) as comm:
            result = run_torchtitan_import(opts, comm)
            if comm.rank == 0 and not args.quiet:
                print(describe(result, Path(args.output)), flush=True)
        return 0
    with process_group(device="cpu", timeout_s=args.timeout, on_silence=on_silence) as comm:
        result = run_import(opts, comm)
        if comm.rank == 0 and not args.quiet:
            ep = f" x EP={args.ep}" if args.ep > 1 else ""
            print(f"distmerge import: wrote {args.output} (Megatron-LM torch_dist, TP={args.tp} x PP={args.pp}{ep}): "
                  f"{result.tensors} tensors in {result.chunks} chunks, {result.files} files, "
                  f"{result.nbytes / 1e6:.1f} MB, vocabulary padded to {result.padded_vocab} rows; "
                  f"{result.seconds:.1f} s with {result.processes} process(es)", flush=True)
    return 0


def _refuse_megatron_options(args: argparse.Namespace) -> None:
    """--to torchtitan: one layout for every world size, so no --tp or --pp (torchtitan's run options, not the
    checkpoint's: its loader reshards), and no vocabulary padding (torchtitan's embedding is vocab_size rows)."""
    from distmerge.errors import ConfigError

    if args.tp != 1 or args.pp != 1 or args.ep != 1:
        raise ConfigError("--to torchtitan writes one folder that torchtitan loads at any parallelism: drop --tp, "
                          "--pp and --ep (set them in torchtitan's own config)")
    if args.hf_config:
        raise ConfigError("--to torchtitan reads a Hugging Face model folder only: merge the checkpoint first "
                          "(distmerge merge ... --hf-config DIR), then import the merged folder")
    if args.make_vocab_size_divisible_by != 128:
        raise ConfigError("--make-vocab-size-divisible-by is Megatron-LM's: torchtitan does not pad the vocabulary, "
                          "so --to torchtitan takes no such option")

"""`distmerge import`: a Hugging Face model written as a training checkpoint (docs/import.md). Its parser and its
run; cli.py adds the one and calls the other."""

from __future__ import annotations

import argparse

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
  python -m distmerge import --input s3://models/hf_model --output s3://ckpts/megatron_ckpt --tp 2

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
    """The import in a process group of our own (torchrun's processes, or this one alone); rank 0 prints one line.
    The options become the request and run as the API's do (api.import_request, api.run_import)."""
    from distmerge import api, options
    from distmerge.distributed.comm import process_group

    opts = api.import_request(options.from_namespace(args, "import"))
    with process_group(device="cpu", timeout_s=args.timeout, on_silence=on_silence) as comm:
        api.run_import(opts, comm, show=not args.quiet)
    return 0

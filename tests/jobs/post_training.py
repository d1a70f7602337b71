"""The post-training steps of docs/api.md (verl, torchtitan, Megatron-LM), run at the end of a training-like job
on every rank (tests/test_hooks.py):

    torchrun --nproc-per-node 2 tests/jobs/post_training.py verl ROOT STEP OUT \\
        torchtitan FOLDER STEP HF_CONFIG OUT  megatron SAVE HF_CONFIG OUT

Each step's function holds the lines docs/api.md shows, with the framework's objects (verl's config and trainer,
torchtitan's trainer and config, Megatron's args) replaced by the paths they would hold; tests/test_hooks.py checks
that every line of each function appears in docs/api.md. On the CPU the job's group runs gloo, as the frameworks'
own groups do there; on GPUs they run NCCL, hence the gloo side group.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

import torch
import torch.distributed as dist

import distmerge
from distmerge.results import MergeResult


def verl_sft(default_local_dir: str, total_training_steps: int, output: str) -> MergeResult:
    """verl's SFT trainer: config.trainer.default_local_dir, trainer.total_training_steps (its last save)."""
    gloo = dist.new_group(backend="gloo")  # verl's group runs NCCL: distmerge's collectives move CPU tensors
    save = os.path.join(default_local_dir, f"global_step_{total_training_steps}")
    return distmerge.merge(save, output, group=gloo)


def torchtitan(folder: str, step: int, hf_assets_path: str, output: str) -> MergeResult:
    """torchtitan: trainer.checkpointer.folder, trainer.step, config.hf_assets_path."""
    gloo = dist.new_group(backend="gloo")
    return distmerge.merge(folder, output, step=step, hf_config=hf_assets_path, group=gloo)


def megatron(save: str, hf_model: str, output: str) -> MergeResult:
    """Megatron-LM: get_args().save (latest_checkpointed_iteration.txt names the last save), the model's HF folder."""
    gloo = dist.new_group(backend="gloo")
    return distmerge.merge(save, output, hf_config=hf_model, group=gloo)


STEPS: dict[str, tuple[Callable[..., MergeResult], tuple[type, ...]]] = {
    "verl": (verl_sft, (str, int, str)),
    "torchtitan": (torchtitan, (str, int, str, str)),
    "megatron": (megatron, (str, str, str)),
}


def main(argv: list[str]) -> None:
    dist.init_process_group("gloo")
    total = torch.ones(1)
    dist.all_reduce(total)  # the training job's collectives
    while argv:
        name, argv = argv[0], argv[1:]
        step, types = STEPS[name]
        args, argv = [kind(a) for kind, a in zip(types, argv, strict=False)], argv[len(types):]
        result = step(*args)
        after = torch.ones(1)
        dist.all_reduce(after)  # the job's group still works
        print(f"rank {dist.get_rank()}: {name}: merged {result.tensors} tensors ({result.format}, saved by "
              f"{result.input_world_size} ranks) with {result.processes} processes; all_reduce after: {int(after)}",
              flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])

"""A real FSDP2 training job (gloo, CPU) that saves as verl saves, for tests/test_watch.py:

    python -m torch.distributed.run --nproc-per-node 2 tests/jobs/train_verl.py RUN REF STEPS EVERY GAP

A tiny random Llama (tests/fixtures/make_fsdp.build_model) sharded by fully_shard trains STEPS optimizer steps; every
EVERY steps it saves RUN/global_step_N/actor/ as verl's FSDP checkpoint manager does (model_world_size_2_rank_R.pt
from each rank, fsdp_config.json, huggingface/), and rank 0 then writes RUN/latest_checkpointed_iteration.txt holding
N, as RayPPOTrainer._save_checkpoint does once the actor's save returned, GAP seconds after the rank files (the time a
real save of other parts takes, while a watcher may look). The full state dict each save holds, gathered by the job
itself (DTensor.full_tensor), goes to REF/global_step_N.safetensors, and REF/marks.jsonl gets one line per save:
the step and the time (time.time()) just before the marker was written.
"""

from __future__ import annotations

import json
import os
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.fixtures.make_fsdp import CASES, build_model, save_hf_dir, wrap  # noqa: E402

TRACKER = "latest_checkpointed_iteration.txt"


def save(model, run: Path, ref: Path, step: int, gap: float) -> None:
    """verl's layout, then the gathered reference, then (rank 0, after every rank's files) the marker."""
    from safetensors.torch import save_file

    rank, world = dist.get_rank(), dist.get_world_size()
    actor = run / f"global_step_{step}" / "actor"
    actor.mkdir(parents=True, exist_ok=True)
    sd = model.state_dict()
    torch.save(sd, actor / f"model_world_size_{world}_rank_{rank}.pt")
    full = {k: v.full_tensor().detach().clone() for k, v in sd.items()}
    if rank == 0:
        save_hf_dir(model, actor / "huggingface")
        (actor / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": world}))
        save_file(full, str(ref / f"global_step_{step}.safetensors"), metadata={"format": "pt"})
    dist.barrier()
    if rank == 0:
        time.sleep(gap)
        now = time.time()
        with open(ref / "marks.jsonl", "a") as f:
            f.write(json.dumps({"step": step, "time": now}) + "\n")
        (run / TRACKER).write_text(str(step))
    dist.barrier()


def main(run: Path, ref: Path, steps: int, every: int, gap: float) -> None:
    warnings.filterwarnings("ignore")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    ref.mkdir(parents=True, exist_ok=True)
    model = wrap(build_model("llama", seed=36, dtype=torch.float32), CASES["fsdp2_llama_w2"], dist.get_world_size())
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    torch.manual_seed(100 + rank)  # each rank its own batch, as data parallelism has it
    for step in range(1, steps + 1):
        ids = torch.randint(0, model.config.vocab_size, (2, 8))
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        if step % every == 0:
            save(model, run, ref, step, gap)
            if rank == 0:
                print(f"saved global_step_{step} (loss {loss.item():.4f})", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5]))

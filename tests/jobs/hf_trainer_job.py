"""A real Hugging Face Trainer + DeepSpeed run on CPU (torchrun, gloo) with DistmergeCallback (tests/test_hooks.py).

    torchrun --nproc-per-node 2 tests/jobs/hf_trainer_job.py OUT 3 [2 ...]     (ZeRO stages, one Trainer each)

Each Trainer saves every step (checkpoint-1, checkpoint-2) and carries two callbacks: one merges the last step's save
into OUT/z{stage}/last, the other every save into OUT/z{stage}/every/step-{step} (step 1 is merged mid-run, so
step 2 trains after a merge). After train() one more step runs on the same DeepSpeed engine.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
import zlib
from pathlib import Path

import torch
import torch.distributed as dist

from distmerge.hooks.hf_trainer import DistmergeCallback
from tests.fixtures.deepspeed_cases import LR, DSCase, trainer_ds_config
from tests.fixtures.make_deepspeed import BATCH, build_model, token_batch

STEPS = 2
CASES = {3: DSCase(2, 3, arch="qwen2", odd=True, driver="trainer"), 2: DSCase(2, 2, driver="trainer")}


def run(stage: int, out: Path) -> None:
    from accelerate.state import AcceleratorState
    from transformers import Trainer, TrainingArguments
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    case, root = CASES[stage], out / f"z{stage}"
    seed = zlib.crc32(f"hook-z{stage}".encode()) % 2**31
    args = TrainingArguments(output_dir=str(root / "run"), deepspeed=trainer_ds_config(case), use_cpu=True, bf16=True,
                             max_steps=STEPS, save_strategy="steps", save_steps=1, per_device_train_batch_size=BATCH,
                             learning_rate=LR, logging_strategy="no", report_to="none", disable_tqdm=True, seed=seed,
                             dataloader_num_workers=0)
    model = build_model(case, seed)  # after the arguments: at stage 3 built under the Trainer's zero.Init
    world = dist.get_world_size()
    rows = [token_batch(model.config.vocab_size, i, world)[0] for i in range(BATCH * world * STEPS)]
    last = DistmergeCallback(root / "last")
    every = DistmergeCallback(root / "every" / "step-{step}", every_save=True)
    trainer = Trainer(model=model, args=args, train_dataset=[{"input_ids": r, "labels": r} for r in rows],
                      callbacks=[last, every])
    trainer.train()
    engine = trainer.model_wrapped  # a further step on the engine the merges ran beside
    ids = token_batch(model.config.vocab_size, 99, dist.get_rank())
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()
    assert engine.global_steps == STEPS + 1 and torch.isfinite(loss), (engine.global_steps, loss)
    print(f"rank {dist.get_rank()}: ZeRO-{stage}: last merged steps {sorted(last.results)}, every save merged steps "
          f"{sorted(every.results)} ({last.results[STEPS].tensors} tensors, {last.results[STEPS].processes} processes);"
          f" a further step ran: global step {engine.global_steps}, loss {loss.item():.3f}", flush=True)
    engine.destroy()
    unset_hf_deepspeed_config()  # the next Trainer brings its own DeepSpeed config
    AcceleratorState._reset_state()


def main(out: str, *stages: str) -> None:
    warnings.filterwarnings("ignore")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    torch.set_num_threads(1)
    import deepspeed
    from deepspeed.utils import logger as ds_logger

    ds_logger.setLevel(logging.WARNING)
    deepspeed.init_distributed(dist_backend="gloo")  # as tests/fixtures/make_deepspeed.py: gloo on the CPU
    for stage in stages:
        run(int(stage), Path(out).resolve())
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # DeepSpeed's leftover gloo groups can abort interpreter teardown (make_deepspeed.py says why)


if __name__ == "__main__":
    main(*sys.argv[1:])

"""Real Hugging Face Trainer runs on CPU (torchrun, gloo) with DistmergeCallback (tests/test_hooks.py):

    torchrun --nproc-per-node 2 tests/jobs/hf_trainer_job.py OUT z3 z2     (one Trainer each, in turn)
    torchrun --nproc-per-node 2 tests/jobs/hf_trainer_job.py OUT fsdp2     (a job of its own: after a DeepSpeed
                                                                            Trainer, accelerate refuses FSDP)

z3, z2: DeepSpeed ZeRO-3 / ZeRO-2 (bf16); fsdp2: accelerate FSDP2 with SHARDED_STATE_DICT (fp32). Each Trainer
saves every step (checkpoint-1, checkpoint-2) and carries two callbacks: one merges the last step's save into
OUT/{case}/last, the other every save into OUT/{case}/every/step-{step} (step 1 is merged mid-run, so step 2 trains
after a merge). After train() one more optimizer step runs on the same engine / FSDP model.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
import zlib
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from distmerge.hooks.hf_trainer import DistmergeCallback
from tests.fixtures.deepspeed_cases import LR, DSCase, trainer_ds_config, without_shm_comm_op
from tests.fixtures.make_deepspeed import BATCH, build_model, token_batch
from tests.fixtures.make_fsdp import make_tokenizer

STEPS = 2
CASES = {"z3": DSCase(2, 3, arch="qwen2", odd=True, driver="trainer"), "z2": DSCase(2, 2, driver="trainer"),
         "fsdp2": DSCase(2, 0, odd=True, driver="trainer", dtype="fp32")}
FSDP2 = {"fsdp_version": 2, "state_dict_type": "SHARDED_STATE_DICT"}


def accelerate_fsdp_on_cpu() -> None:
    """accelerate takes its FSDP branch only for accelerator runs (AcceleratorState.__init__ sets
    distributed_type FSDP and fsdp_plugin for MULTI_GPU, MULTI_XPU, ..., never MULTI_CPU), though FSDP2 itself
    runs on CPU with gloo. Take that same branch on CPU: the rest (fully_shard, save_fsdp_model) is the library's."""
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedType

    init = AcceleratorState.__init__

    def cpu_fsdp_init(self: Any, *args: Any, fsdp_plugin: Any = None, **kwargs: Any) -> None:
        init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type, self.fsdp_plugin = DistributedType.FSDP, fsdp_plugin

    AcceleratorState.__init__ = cpu_fsdp_init


def trainer_for(name: str, root: Path) -> tuple[Any, DistmergeCallback, DistmergeCallback]:
    from transformers import Trainer, TrainingArguments, default_data_collator

    case, seed = CASES[name], zlib.crc32(f"hook-{name}".encode()) % 2**31
    strategy: dict[str, Any] = {"fsdp": True, "fsdp_config": FSDP2} if name == "fsdp2" else {
        "deepspeed": trainer_ds_config(case), "bf16": True}
    args = TrainingArguments(output_dir=str(root / "run"), use_cpu=True, max_steps=STEPS, save_strategy="steps",
                             save_steps=1, per_device_train_batch_size=BATCH, learning_rate=LR, logging_strategy="no",
                             report_to="none", disable_tqdm=True, seed=seed, dataloader_num_workers=0, **strategy)
    model = build_model(case, seed)  # after the arguments: at ZeRO-3 built under the Trainer's zero.Init
    world = dist.get_world_size()
    rows = [token_batch(model.config.vocab_size, i, world)[0] for i in range(BATCH * world * STEPS)]
    last = DistmergeCallback(root / "last")
    every = DistmergeCallback(root / "every" / "step-{step}", every_save=True)
    trainer = Trainer(model=model, args=args, train_dataset=[{"input_ids": r, "labels": r} for r in rows],
                      processing_class=make_tokenizer(model.config.model_type), data_collator=default_data_collator,
                      callbacks=[last, every])
    return trainer, last, every


def further_step(trainer: Any, deepspeed: bool) -> tuple[int, float]:
    """One more optimizer step after the merges, on the engine (DeepSpeed) or the FSDP model and its optimizer."""
    model = trainer.model_wrapped if deepspeed else trainer.model
    ids = token_batch(trainer.model.config.vocab_size, 99, dist.get_rank())
    loss = model(input_ids=ids, labels=ids).loss
    if deepspeed:
        model.backward(loss)
        model.step()
        return model.global_steps, loss.item()
    trainer.accelerator.backward(loss)
    trainer.optimizer.step()
    trainer.optimizer.zero_grad()
    return STEPS + 1, loss.item()


def fsdp_full_weights(model: Any) -> dict[str, torch.Tensor]:
    """The live FSDP2 model's full state dict (collective), to check the merged folder against."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def check_against(full: dict[str, torch.Tensor], merged: Path) -> str:
    """What differs between the live model's full state dict and the merged folder ("" when nothing does)."""
    from safetensors.torch import load_file

    got = {k: v for f in sorted(merged.glob("*.safetensors")) for k, v in load_file(f).items()}
    if not (set(full) - set(got) <= {"lm_head.weight"} and set(got) <= set(full)):  # a tied head is written once
        return f"keys: merged {sorted(got)}, live {sorted(full)}"
    return ", ".join(key for key, tensor in got.items() if not torch.equal(tensor, full[key]))


def save_config(trainer: Any, folder: Path) -> None:
    """The model's config files as a full save writes them beside the weights: the CLI's --hf-config for the
    merge that the test compares with (the sharded FSDP save holds none)."""
    trainer.model.config.save_pretrained(folder)
    trainer.model.generation_config.save_pretrained(folder)
    trainer.processing_class.save_pretrained(folder)


def run(name: str, out: Path) -> None:
    from accelerate.state import AcceleratorState
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    trainer, last, every = trainer_for(name, out / name)
    trainer.train()
    if name == "fsdp2":
        full = fsdp_full_weights(trainer.model)
        differs = [check_against(full, out / name / "last") if dist.get_rank() == 0 else ""]
        dist.broadcast_object_list(differs)  # every rank stops on a difference: none waits in the next step
        assert not differs[0], f"the merged model differs from the live one: {differs[0]}"
        if dist.get_rank() == 0:
            save_config(trainer, out / name / "hf_config")
    step, loss = further_step(trainer, deepspeed=name != "fsdp2")
    assert step == STEPS + 1 and loss == loss, (step, loss)
    print(f"rank {dist.get_rank()}: {name}: last merged steps {sorted(last.results)}, every save merged steps "
          f"{sorted(every.results)} ({last.results[STEPS].tensors} tensors, {last.results[STEPS].processes} processes);"
          f" a further step ran: step {step}, loss {loss:.3f}", flush=True)
    if name != "fsdp2":
        trainer.model_wrapped.destroy()  # drops the ZeRO-3 hooks
        unset_hf_deepspeed_config()  # the next Trainer brings its own config
    AcceleratorState._reset_state()


def main(out: str, *names: str) -> None:
    assert "fsdp2" not in names or names == ("fsdp2",), "fsdp2 runs in a job of its own"
    warnings.filterwarnings("ignore")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    torch.set_num_threads(1)
    if any(n != "fsdp2" for n in names):
        import deepspeed
        from deepspeed.utils import logger as ds_logger

        ds_logger.setLevel(logging.WARNING)
        without_shm_comm_op()
        deepspeed.init_distributed(dist_backend="gloo")  # as tests/fixtures/make_deepspeed.py: gloo on the CPU
    if "fsdp2" in names:
        accelerate_fsdp_on_cpu()
    for name in names:
        run(name, Path(out).resolve())
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # DeepSpeed's leftover gloo groups can abort interpreter teardown (make_deepspeed.py says why)


if __name__ == "__main__":
    main(*sys.argv[1:])

"""Write a real DeepSpeed ZeRO-2 or ZeRO-3 checkpoint (a real engine on CPU + gloo) of a Llama-shaped model.

Run under torchrun with W processes (data parallel), e.g.::

    torchrun --standalone --nproc-per-node 8 tests/bench/make_deepspeed_ckpt.py --out DIR --size 800000000 --stage 2

Trains one real optimizer step in bf16 (AdamW in the decay / no-decay param groups the HF Trainer makes, random
tokens) and saves with ``engine.save_checkpoint(DIR)``, exactly as users' jobs do: ``DIR/latest``,
``DIR/zero_to_fp32.py`` (DeepSpeed's converter, copied beside the save), ``DIR/global_step1/`` with
``mp_rank_00_model_states.pt`` (stage 2: the whole bf16 module) or ``zero_pp_rank_{r}_mp_rank_00_model_states.pt``
(stage 3) and ``bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt`` (fp32 master partition + Adam moments), plus
``DIR/huggingface/config.json`` (as verl and OpenRLHF write it). The shape is make_ckpt's (untied embeddings).

Memory on a small box (8 ranks, 24 GiB): stage 2 builds the model in bf16 (DeepSpeed broadcasts rank 0's weights,
so every rank holds the bf16 module once, about 0.4 GB at 0.8 GB fp32); stage 3 builds it under ``zero.Init``,
each rank holding 1/W of it. Bucket sizes are the HF Trainer's "auto" values (hidden^2), not DeepSpeed's 5e8
defaults, which would preallocate 1 GB of gradient buckets per rank. Only stdlib at module level:
bench_deepspeed.py imports ``llama_shape`` (via make_ckpt) for its stamp.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import logging
import os
import resource
import sys
import time
import warnings
from pathlib import Path

from make_ckpt import llama_shape

SEQ = 32
LR = 1e-4
WEIGHT_DECAY = 0.01


def ds_config(stage: int, hidden: int) -> dict:
    """bf16 ZeRO config with the HF Trainer's "auto" bucket sizes for this hidden size."""
    zero: dict = {"stage": stage, "reduce_bucket_size": hidden * hidden, "allgather_bucket_size": hidden * hidden}
    if stage == 3:
        zero.update(stage3_prefetch_bucket_size=int(0.9 * hidden * hidden),
                    stage3_param_persistence_threshold=10 * hidden)
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
            "bf16": {"enabled": True}, "zero_optimization": zero, "steps_per_print": 10**9,
            "wall_clock_breakdown": False}


def build(config, stage: int, cfg: dict, seed: int):  # noqa: ANN001, ANN201 - torch types stay out of the imports
    import torch
    import transformers.models.llama.modeling_llama  # noqa: F401 - before zero.Init (classes get patched once)
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)  # same on every rank (stage 2 broadcasts rank 0's anyway)
    if stage == 3:
        import deepspeed

        with deepspeed.zero.Init(config_dict_or_path=cfg):  # bf16 from the config; 1/W of each param kept
            return LlamaForCausalLM(config)
    torch.set_default_dtype(torch.bfloat16)  # never the fp32 model: 8 ranks x 0.8 GB would be 6.4 GB at once
    try:
        return LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(torch.float32)


def param_groups(model) -> list[dict]:  # noqa: ANN001
    """Two groups split like Trainer.get_decay_parameter_names: norms and biases without weight decay."""
    named = [(k, p) for k, p in model.named_parameters() if p.requires_grad]
    decay = [p for k, p in named if not (k.endswith("bias") or "norm" in k)]
    no_decay = [p for k, p in named if k.endswith("bias") or "norm" in k]
    return [{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": no_decay, "weight_decay": 0.0}]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--size", type=int, required=True, help="target model bytes (fp32)")
    parser.add_argument("--stage", type=int, choices=(2, 3), required=True, help="zero_optimization.stage")
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args()
    faulthandler.enable(all_threads=True)  # an abort at teardown would show every thread's Python stack
    warnings.filterwarnings("ignore")  # gloo/CPU warnings x W ranks bury real errors
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    start = time.perf_counter()

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # W ranks share a couple of cores; more threads only thrash
    import deepspeed
    from deepspeed.utils import logger as ds_logger
    from transformers import LlamaConfig

    ds_logger.setLevel(logging.WARNING)
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    shape = llama_shape(args.size)
    params = shape.pop("params")
    config = LlamaConfig(**shape, max_position_embeddings=2048, tie_word_embeddings=False,
                         architectures=["LlamaForCausalLM"])
    cfg = ds_config(args.stage, shape["hidden_size"])
    model = build(config, args.stage, cfg, args.seed)
    optimizer = torch.optim.AdamW(param_groups(model), lr=LR, weight_decay=WEIGHT_DECAY)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=cfg)
    built = time.perf_counter()

    g = torch.Generator().manual_seed(args.seed + rank)  # different data per rank: real DP averaging
    ids = torch.randint(0, shape["vocab_size"], (1, SEQ), generator=g)
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    assert engine.global_steps == 1, engine.global_steps
    stepped = time.perf_counter()

    engine.save_checkpoint(str(args.out))  # ends with a barrier: every rank's files exist afterwards
    saved = time.perf_counter()
    peaks = [0] * world
    dist.all_gather_object(peaks, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    if rank == 0:
        config.save_pretrained(args.out / "huggingface")
        counted = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in engine.module.parameters())
        assert counted == params, (counted, params)
        files = sorted((args.out / "global_step1").iterdir())
        print(f"make_deepspeed_ckpt: {params:,} params ({params * 4 / 1e9:.3f} GB fp32), ZeRO-{args.stage} bf16, "
              f"W={world}, {len(files)} files {sum(p.stat().st_size for p in files) / 1e9:.2f} GB; build "
              f"{built - start:.1f} s, step {stepped - built:.1f} s, save {saved - stepped:.1f} s; peak RSS per rank "
              f"{' / '.join(f'{p / 1e9:.2f}' for p in peaks)} GB; config {json.dumps(shape)}", flush=True)
    dist.barrier()  # every rank's file (and rank 0's config) complete before the job ends
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter finalization, as tests/fixtures/make_deepspeed.py does: DeepSpeed's module globals keep
    # gloo groups (and their threads) alive past destroy_process_group(); tearing them down while the
    # interpreter finalizes can abort with "terminate called without an active exception". Everything is
    # written and closed here.
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())

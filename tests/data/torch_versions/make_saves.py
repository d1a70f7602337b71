"""Save tiny real sharded checkpoints with whichever torch runs this script (tests/test_torch_versions.py merges them).

Run from the repository root under torchrun (gloo, CPU, 4 ranks), in a virtualenv holding the torch to record::

    torchrun --nnodes 1 --nproc-per-node 4 --master-addr 127.0.0.1 --master-port 29533 \\
        tests/data/torch_versions/make_saves.py --out tests/data/torch_versions/torch-X.Y.Z

Each case writes ``OUT/{case}/`` (what a user passes as ``--input``) and ``OUT/{case}_reference/model.safetensors``:
the full state dict gathered by this job itself (HF names), checked equal to the pre-sharding weights. Only torch,
transformers and safetensors are needed, so the script runs under old torches as well as new ones.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import warnings
import zlib
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

WORLD = 4
CASES = ("fsdp2_w4", "hsdp_2x2", "fsdp1_mesh_w4", "fsdp1_nomesh_w4", "dcp_w4")


def build_model(seed: int) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=67,  # odd: dim-0 shards are uneven at W=4 (17, 17, 17, 16)
        hidden_size=8,
        intermediate_size=14,  # uneven rows at W=4 (4, 4, 4, 2)
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,  # GQA: k/v projections differ in shape from q
        max_position_embeddings=32,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).float()
    with torch.no_grad():
        for tensor in model.state_dict().values():
            dist.broadcast(tensor, src=0)  # same weights on every rank, whatever the init does
    return model.eval()


def wrap(model: nn.Module, case: str) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh

    layers = list(model.model.layers)
    if case in ("fsdp2_w4", "hsdp_2x2", "dcp_w4"):
        from torch.distributed.fsdp import fully_shard

        if case == "hsdp_2x2":
            mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ddp", "fsdp"))
        else:
            mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("fsdp",))
        for layer in layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model

    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    return FSDP(
        model,
        device_id=torch.device("cpu"),
        use_orig_params=True,
        auto_wrap_policy=ModuleWrapPolicy({type(layers[0])}),
        device_mesh=init_device_mesh("cpu", (WORLD,)) if case == "fsdp1_mesh_w4" else None,
    )


def sharded_state_dict(model: nn.Module, case: str) -> dict[str, Any]:
    if not case.startswith("fsdp1"):
        return model.state_dict()  # FSDP2: DTensor values, no context needed (as verl saves it)
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardedStateDictConfig, StateDictType

    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT, ShardedStateDictConfig()):
        return model.state_dict()


def full_state_dict(model: nn.Module, sharded: dict[str, Any], case: str) -> dict[str, torch.Tensor]:
    """Collective; only rank 0's result is complete."""
    if not case.startswith("fsdp1"):
        return {k: v.full_tensor() for k, v in sharded.items()}
    from torch.distributed.fsdp import FullStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    cfg = FullStateDictConfig(offload_to_cpu=False, rank0_only=True)  # the module already lives on CPU
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg):
        return model.state_dict()


def check_kinds(sd: dict[str, Any], case: str) -> str:
    """The entry kind each case must hold, so a change in torch's behaviour fails here rather than in a test."""
    if case == "fsdp1_nomesh_w4":
        from torch.distributed._shard.sharded_tensor import ShardedTensor

        assert all(isinstance(v, ShardedTensor) for v in sd.values()), {type(v) for v in sd.values()}
        return "ShardedTensor"
    from torch.distributed.tensor import DTensor, Replicate, Shard

    want = (Replicate(), Shard(0)) if case == "hsdp_2x2" else (Shard(0),)
    for key, value in sd.items():
        assert isinstance(value, DTensor), (key, type(value))
        assert tuple(value.placements) == want, (key, value.placements)
    return f"DTensor{want}"


def make_case(case: str, out: Path) -> None:
    from safetensors.torch import save_file

    rank = dist.get_rank()
    ckpt, ref = out / case, out / f"{case}_reference"
    model = build_model(seed=zlib.crc32(case.encode()) % 2**31)
    original = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if rank == 0:
        model.config.save_pretrained(ckpt / "huggingface")

    model = wrap(model, case)
    sd = sharded_state_dict(model, case)
    assert list(sd) == list(original), set(sd) ^ set(original)
    kind = check_kinds(sd, case)
    ckpt.mkdir(parents=True, exist_ok=True)
    if case == "dcp_w4":
        import torch.distributed.checkpoint as dcp

        dcp.save(sd, checkpoint_id=str(ckpt))
    else:
        torch.save(sd, ckpt / f"model_world_size_{WORLD}_rank_{rank}.pt")

    full = full_state_dict(model, sd, case)
    if rank == 0:
        tensors = {k: v.detach().contiguous().clone() for k, v in full.items()}
        assert list(tensors) == list(original), set(tensors) ^ set(original)
        for k, v in tensors.items():
            assert v.dtype == original[k].dtype and torch.equal(v, original[k]), k
        ref.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(ref / "model.safetensors"), metadata={"format": "pt"})
        if case != "dcp_w4":
            (ckpt / "fsdp_config.json").write_text(
                json.dumps({"FSDP_version": 1 if case.startswith("fsdp1") else 2, "world_size": WORLD}, indent=4)
            )
        print(f"made {case}: {len(tensors)} tensors, {kind}", flush=True)
    dist.barrier()  # every rank's files exist before the job ends


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--case", action="append", choices=CASES, help="default: every case")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        assert dist.get_world_size() == WORLD, f"run with --nproc-per-node {WORLD}"
        if dist.get_rank() == 0:
            import transformers

            print(f"torch {torch.__version__}, transformers {transformers.__version__}", flush=True)
        for case in args.case or CASES:
            make_case(case, args.out)
    finally:
        dist.destroy_process_group()
        gc.collect()  # meshes hold process groups through cycles: free them before interpreter exit
    return 0


if __name__ == "__main__":
    sys.exit(main())

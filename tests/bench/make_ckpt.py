"""Write a real FSDP2 checkpoint of a Llama-shaped model, laid out like verl's FSDP checkpoint manager.

Run under torchrun on CPU (gloo), e.g.::

    torchrun --standalone --nproc-per-node 8 tests/bench/make_ckpt.py --out DIR --size 800000000

``--layout`` picks how the same sharded weights (same seed, same shape) are written:

- ``fsdp`` (default): each rank writes ``DIR/model_world_size_{W}_rank_{r}.pt`` (``torch.save(model.state_dict())``,
  entries are DTensors), like verl; rank 0 adds ``fsdp_config.json``.
- ``dcp``: ``torch.distributed.checkpoint.save(model.state_dict(), checkpoint_id=DIR)``: ``.metadata`` and
  ``__{r}_0.distcp``.
- ``hf``: the same save through ``HuggingFaceStorageWriter(path=DIR/sharded, save_distributed=True)``: one
  ``sharded/shard-{r+1:05}-model-00001-of-00001.safetensors`` per rank, chunk offsets in its header.

``--wrap model`` (dcp, hf) saves ``{"model": state_dict}`` as accelerate's FSDP SHARDED_STATE_DICT does, so every
key becomes ``model.<name>`` (``model.model.layers.0...``, ``model.lm_head.weight``); without it the keys are the
module's own, as torchtitan's model-only saves are.

Every layout gets ``DIR/huggingface/config.json``. bench_fsdp.py and bench_dcp.py call this once per layout and
reuse the result, since building it is the slow part of a benchmark run.

Only stdlib is imported at module level: bench_fsdp.py imports ``llama_shape`` to stamp the checkpoint
without paying for torch/transformers in that import.
"""

from __future__ import annotations

import argparse
import json
import warnings
from pathlib import Path

HEAD_DIM = 64
VOCAB = 32000


def llama_shape(target_bytes: int, dtype_bytes: int = 4) -> dict:
    """LlamaConfig kwargs (plus the parameter count) for a model of about target_bytes.

    Llama-7B proportions scaled down (intermediate = 2.75 x hidden, GQA with half as many kv heads). The
    widest hidden size that leaves room for two layers next to the 32k-vocab embeddings wins, so small
    test sizes still get many layers rather than just one giant embedding.
    """
    for hidden in (1024, 768, 512, 256, 128):
        heads = hidden // HEAD_DIM
        kv_heads = max(1, heads // 2)
        inter = 2816 * hidden // 1024
        embed = 2 * VOCAB * hidden  # untied: embed_tokens + lm_head
        layer = 2 * hidden * hidden + 2 * hidden * kv_heads * HEAD_DIM + 3 * hidden * inter + 2 * hidden
        if (embed + 2 * layer + hidden) * dtype_bytes <= target_bytes or hidden == 128:
            break
    layers = max(1, round((target_bytes / dtype_bytes - embed - hidden) / layer))
    return {
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "num_hidden_layers": layers,
        "vocab_size": VOCAB,
        "params": embed + hidden + layers * layer,
    }


def save(sd: dict, out: Path, layout: str, rank: int, world: int, wrap: str = "") -> None:
    """Write the DTensor state dict in one of the three layouts (a collective for dcp and hf)."""
    import torch

    if layout == "fsdp":
        torch.save(sd, out / f"model_world_size_{world}_rank_{rank}.pt")
        return
    import torch.distributed.checkpoint as dcp

    sd = {wrap: sd} if wrap else sd  # dcp.save flattens a nested dict to "wrap.<key>"

    if layout == "dcp":
        dcp.save(sd, checkpoint_id=str(out))
        return
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    # DTensors go in as they are: the default save planner turns each into this rank's chunk, which the HF
    # writer stores with its offsets in DCP_SHARDING_INFO (no full_tensor() needed, nothing gathered).
    writer = HuggingFaceStorageWriter(path=str(out / "sharded"), save_distributed=True, enable_consolidation=False)
    dcp.save(sd, storage_writer=writer)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--size", type=int, required=True, help="target checkpoint bytes (fp32)")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--layout", choices=("fsdp", "dcp", "hf"), default="fsdp", help="how to save (fsdp)")
    parser.add_argument("--wrap", default="", help="dcp, hf: save {WRAP: state_dict} (accelerate: model)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")  # gloo/CPU and TypedStorage warnings x W ranks bury real errors

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)  # W ranks share a couple of cores; more threads only thrash

    shape = llama_shape(args.size)
    params = shape.pop("params")
    config = LlamaConfig(**shape, max_position_embeddings=2048, tie_word_embeddings=False)
    # Built on meta so no rank ever holds the whole fp32 model at once: each layer is materialized, filled
    # and sharded in turn (fully_shard drops the full tensors), so the peak is the two embedding matrices plus
    # 1/W of the layers, instead of W full copies of the model on the machine.
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
    # Same seed, same fill order on every rank: the ranks agree on the full weights without a broadcast.
    gen = torch.Generator().manual_seed(args.seed)
    checksum = torch.zeros((), dtype=torch.float64)

    def materialize(module: torch.nn.Module) -> None:
        nonlocal checksum
        module.to_empty(device="cpu")
        with torch.no_grad():
            for p in module.parameters():
                # Norm weights get mean 1, not all ones: a merger that swaps two layers' norms must show.
                p.normal_(1.0 if p.ndim == 1 else 0.0, 0.02, generator=gen)
                checksum += p.sum(dtype=torch.float64)

    for layer in model.model.layers:
        materialize(layer)
        fully_shard(layer, mesh=mesh)
    for module in (model.model.embed_tokens, model.model.norm, model.lm_head):
        materialize(module)
    model.model.rotary_emb = LlamaRotaryEmbedding(config)  # computed buffers, not weights: rebuild, don't fill
    fully_shard(model, mesh=mesh)

    # Cheap proof that every rank really held identical full weights before sharding.
    sums = [torch.zeros((), dtype=torch.float64) for _ in range(world)]
    dist.all_gather(sums, checksum)
    if any(not torch.equal(s, sums[0]) for s in sums):
        raise SystemExit(f"rank {rank}: ranks disagree on the full weights: {[float(s) for s in sums]}")

    sd = model.state_dict()
    bad = [k for k, v in sd.items() if not isinstance(v, DTensor)]
    if bad:
        raise SystemExit(f"rank {rank}: expected DTensor entries only (FSDP2), got plain tensors for {bad[:3]}")
    args.out.mkdir(parents=True, exist_ok=True)
    save(sd, args.out, args.layout, rank, world, args.wrap)
    if rank == 0:
        counted = sum(v.numel() for v in sd.values())  # DTensor.numel() is the global count
        assert counted == params, (counted, params)
        print(f"make_ckpt: {params:,} params ({params * 4 / 1e9:.3f} GB fp32), {len(sd)} tensors, W={world}, "
              f"config {json.dumps(shape)}", flush=True)
        if args.layout == "fsdp":
            (args.out / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": world}, indent=4))
        config.save_pretrained(args.out / "huggingface")
    dist.barrier()  # every rank's file is complete before the job (and the caller waiting on it) ends
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

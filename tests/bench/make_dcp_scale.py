"""Write a many-rank DCP save (W up to 1024 and more) in one process, with torch's own planner and writer.

    python tests/bench/make_dcp_scale.py --out DIR --world 1024 [--names hf|torchtitan] [--cols 4] [--model small]
                                         [--reference FILE]

Every simulated rank r runs what `torch.distributed.checkpoint.save` runs on rank r of a W-rank job, under a
fake process group of rank r (torch.testing's "fake" backend: no communication, `get_rank() == r`), on a
state dict of FSDP2-style DTensors (`Shard(0)` over a 1-D mesh of W, torch.chunk's uneven split):

    DefaultSavePlanner.set_up_planner + create_local_plan, FileSystemWriter.prepare_local_plan   (each rank)
    DefaultSavePlanner.create_global_plan, FileSystemWriter.prepare_global_plan                  (coordinator)
    DefaultSavePlanner.finish_plan, FileSystemWriter.write_data                                  (each rank)
    FileSystemWriter.finish                                                                      (coordinator)

What travels between ranks in a real job (the local plans, the central plans, the write results) goes through
pickle here as `all_gather_object` / `scatter_object_list` send it, so `.metadata` holds the objects a real
coordinator holds, and its bytes are those of a real save of that state dict.

The tensors are Llama-3.1-405B's 1,137 (`--names hf`: model.layers.N...; `torchtitan`: torchtitan's names for
the same model, layers.N.attention.wq...), with the real number of rows (what FSDP2 shards) and `--cols`
columns instead of 16,384 or 53,248 (bf16), so the data stays small (about 50 MB per column) while `.metadata`
is the real size: at W=1024, 1,164,278 chunks (the six empty shards of the embedding and of the head past row
128,256 share one chunk, written once, as dcp.save writes them). Every element is a function of its tensor and
index (`value`), so a merge's output can be checked without a reference copy. config.json (huggingface/) is
Llama-3.1-405B's with hidden_size etc. as the tensors have them.

`--model small` saves a whole small Llama instead (SMALL: hidden 256, 32 layers, 4 heads of 64, one KV head,
12M parameters), every tensor at its real shape, so families that check shapes against config.json (torchtitan's
undoes its RoPE permutation per head) merge it: with `--names torchtitan`, a torchtitan model-only save of W ranks.

`--reference FILE` also writes what an exact merge gives (a safetensors file, Hugging Face names; torchtitan's
wq / wk rows permuted to Hugging Face's RoPE layout), so that a test compares without importing these modules
(bench_scale registers a bench-only Megatron table in distmerge when imported).
"""

from __future__ import annotations

import argparse
import json
import math
import pickle
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_scale import LLAMA, llama_tensors  # noqa: E402


def torchtitan_name(name: str) -> str:
    """Llama's Hugging Face name -> torchtitan's (torchtitan/models/llama3: the state dict adapter's table)."""
    table = {"model.embed_tokens.weight": "tok_embeddings.weight", "model.norm.weight": "norm.weight",
             "lm_head.weight": "output.weight"}
    if name in table:
        return table[name]
    parts = name.split(".")  # model.layers.N.<module>.<proj>.weight
    inner = {"self_attn.q_proj": "attention.wq", "self_attn.k_proj": "attention.wk", "self_attn.v_proj": "attention.wv",
             "self_attn.o_proj": "attention.wo", "mlp.gate_proj": "feed_forward.w1", "mlp.down_proj": "feed_forward.w2",
             "mlp.up_proj": "feed_forward.w3", "input_layernorm": "attention_norm",
             "post_attention_layernorm": "ffn_norm"}
    module = ".".join(parts[3:-1])
    return f"layers.{parts[2]}.{inner[module]}.weight"


SMALL = {**LLAMA, "hidden_size": 256, "intermediate_size": 768, "num_attention_heads": 4, "num_key_value_heads": 1,
         "head_dim": 64, "num_hidden_layers": 32, "vocab_size": 4096}


def tensors(names: str, cols: int, model: str) -> list[tuple[str, tuple[int, ...]]]:
    """(name, global shape): 405B's rows and `cols` columns, or SMALL's real shapes."""
    out = []
    for name, shape in llama_tensors(SMALL if model == "small" else LLAMA):
        if model != "small":
            shape = (shape[0],) if len(shape) == 1 else (shape[0], cols)
        out.append((torchtitan_name(name) if names == "torchtitan" else name, shape))
    return out


def value(index: int, start: int, count: int):
    """Elements start..start+count (flat) of tensor `index`: bf16 values that differ between neighbours and
    between tensors, computed the same whichever rank asks."""
    import torch

    flat = torch.arange(start, start + count, dtype=torch.float64)
    return ((flat * 0.6180339887 + index * 0.137) % 1.0 - 0.5).to(torch.bfloat16)


def local_state(specs, world: int, rank: int, mesh):
    """Rank `rank`'s FSDP2 state dict: a DTensor per tensor, Shard(0), its torch.chunk rows."""
    from torch.distributed.tensor import DTensor, Shard

    state = {}
    for index, (name, shape) in enumerate(specs):
        rows, row = shape[0], math.prod(shape[1:])
        step = -(-rows // world)
        start = min(rank * step, rows)
        n = max(0, min(rows - start, step))
        local = value(index, start * row, n * row).view(n, *shape[1:])
        stride = (row, 1) if len(shape) == 2 else (1,)
        state[name] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=shape, stride=stride)
    return state


def as_rank(rank: int, world: int):
    """A fake process group of `world` ranks in which this process is `rank`, and its 1-D mesh."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    return init_device_mesh("cpu", (world,))


def travel(obj):
    """What a collective does to an object it sends: pickled, unpickled (no sharing with the sender's copy)."""
    return pickle.loads(pickle.dumps(obj))


def save(out: Path, world: int, specs) -> None:
    import torch.distributed as dist
    from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemWriter

    def rank_side(rank: int):
        mesh = as_rank(rank, world)
        planner = DefaultSavePlanner()
        writer = FileSystemWriter(str(out), sync_files=False)
        planner.set_up_planner(state_dict=local_state(specs, world, rank, mesh), storage_meta=writer.storage_meta(),
                               is_coordinator=rank == 0)
        writer.set_up_storage_writer(rank == 0, rank=rank, use_collectives=True)
        return planner, writer

    coordinator_planner, coordinator_writer = rank_side(0)
    local_plans = []
    for rank in range(world):  # local_step on every rank, gathered to the coordinator
        planner, writer = (coordinator_planner, coordinator_writer) if rank == 0 else rank_side(rank)
        local_plans.append(travel(writer.prepare_local_plan(planner.create_local_plan())))
        _progress("plan", rank, world)
    plans, metadata = coordinator_planner.create_global_plan(local_plans)
    plans = coordinator_writer.prepare_global_plan(plans)
    del local_plans
    results = []
    for rank in range(world):  # write_data on every rank (its central plan scattered to it), results gathered
        planner, writer = rank_side(rank)
        final = planner.finish_plan(travel(plans[rank]))
        results.append(travel(writer.write_data(final, planner).value()))
        plans[rank] = None
        _progress("write", rank, world)
    coordinator_writer.finish(metadata=metadata, results=results)
    dist.destroy_process_group()


def _progress(what: str, rank: int, world: int) -> None:
    if (rank + 1) % max(1, world // 16) == 0 or rank + 1 == world:
        print(f"make_dcp_scale: {what} {rank + 1}/{world}", flush=True)


def rope_permute(w, heads: int):
    """Meta's interleaved RoPE rows -> Hugging Face's halves, per head: `permute` of transformers'
    convert_llama_weights_to_hf.py, which torchtitan's Llama3StateDictAdapter.to_hf applies to wq and wk."""
    rows, cols = w.shape
    return w.view(heads, rows // heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def write_reference(path: Path, specs, names: str, cols: int, model: str) -> None:
    """Every tensor as an exact merge writes it: `value` under its Hugging Face name (the config ties nothing)."""
    from safetensors.torch import save_file

    sizes = SMALL if model == "small" else LLAMA
    out = {}
    for index, ((name, shape), (spec_name, _)) in enumerate(zip(tensors("hf", cols, model), specs, strict=True)):
        out[name] = value(index, 0, math.prod(shape)).view(shape)
        if names == "torchtitan" and spec_name.endswith((".wq.weight", ".wk.weight")):
            heads = sizes["num_attention_heads" if spec_name.endswith(".wq.weight") else "num_key_value_heads"]
            out[name] = rope_permute(out[name], heads).contiguous()
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(out, str(path))


def write_config(out: Path, specs, names: str, cols: int, model: str) -> None:
    sizes = SMALL if model == "small" else {**LLAMA, "hidden_size": cols, "intermediate_size": cols}
    config = {**sizes, "torch_dtype": "bfloat16",
              "make_dcp_scale": {"names": names, "cols": cols, "model": model, "tensors": len(specs)}}
    (out / "huggingface").mkdir(parents=True, exist_ok=True)
    (out / "huggingface" / "config.json").write_text(json.dumps(config, indent=2))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--names", choices=("hf", "torchtitan"), default="hf")
    parser.add_argument("--cols", type=int, default=4, help="columns of every 2-D tensor (4)")
    parser.add_argument("--model", choices=("405b", "small"), default="405b", help="405B's rows (405b), or SMALL")
    parser.add_argument("--reference", type=Path, help="also write the expected merge here (.safetensors)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    import torch

    torch.set_num_threads(1)
    start = time.perf_counter()
    specs = tensors(args.names, args.cols, args.model)
    args.out.mkdir(parents=True, exist_ok=True)
    save(args.out, args.world, specs)
    write_config(args.out, specs, args.names, args.cols, args.model)
    if args.reference:
        write_reference(args.reference, specs, args.names, args.cols, args.model)
    size = (args.out / ".metadata").stat().st_size
    print(f"make_dcp_scale: W={args.world}, {len(specs)} tensors, .metadata {size / 1e6:.1f} MB, "
          f"{time.perf_counter() - start:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

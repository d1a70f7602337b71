"""Peer for bench_dcp.py: torch's own consolidation of HuggingFaceStorageWriter shards, run on N ranks.

    torchrun --standalone --nproc-per-node N tests/bench/peer_consolidate.py --input HF_SHARDED_DIR --output OUT \\
        [--max-shard-size BYTES] [--json-summary P]

Calls ``torch.distributed.checkpoint._consolidate_hf_safetensors.consolidate_safetensors_files_on_every_rank``
(private API, what ``HuggingFaceStorageWriter(enable_consolidation=True)`` runs after a save). It spreads work
over ranks by output file (file index % world size), so with one output file (any model under 5GB) one rank
does everything and the others only wait: that is how the API works, not a benchmark artefact.

The JSON summary mirrors distmerge's: {"seconds": own timer of the slowest rank, "ranks": [{"rank",
"peak_rss"}]}, since wait4 on torchrun would only see the launcher.
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from pathlib import Path


def tensor_bytes(folder: Path) -> dict[str, int]:
    """Full size of every tensor: the sum of its chunks' sizes over all shard files (headers only)."""
    sizes: dict[str, int] = {}
    for path in sorted(folder.glob("*.safetensors")):
        with open(path, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        for name, entry in header.items():
            if name != "__metadata__":
                start, end = entry["data_offsets"]
                sizes[name] = sizes.get(name, 0) + end - start
    return sizes


def fqn_mapping(folder: Path, max_shard_size: int) -> dict[str, int]:
    """Tensor name -> output file index from 1, filled greedily up to max_shard_size like Hugging Face's splitter,
    so that the output has as many files as distmerge's (one, at the default 5GB)."""
    mapping, index, used = {}, 1, 0
    for name, size in sorted(tensor_bytes(folder).items()):
        if used and used + size > max_shard_size:
            index, used = index + 1, 0
        mapping[name], used = index, used + size
    return mapping


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input", type=Path, required=True, help="folder of shard-*-model-*.safetensors")
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--max-shard-size", type=int, default=5 * 10**9, help="bytes per output file (5GB)")
    parser.add_argument("--json-summary", type=Path)
    args = parser.parse_args()
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint._consolidate_hf_safetensors import consolidate_safetensors_files_on_every_rank

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    dist.barrier()  # start every rank's clock together, after imports and rendezvous (as distmerge's own timer)
    start = time.perf_counter()
    if rank == 0:
        args.output.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    mapping = fqn_mapping(args.input, args.max_shard_size)
    consolidate_safetensors_files_on_every_rank(str(args.input), str(args.output), mapping, num_threads=1)
    seconds = time.perf_counter() - start  # the call ends in a barrier: every rank has finished by now
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    gathered: list[dict] | None = [{} for _ in range(world)] if rank == 0 else None
    dist.gather_object({"rank": rank, "peak_rss": peak, "seconds": seconds}, gathered, dst=0)
    if rank == 0 and args.json_summary:
        assert gathered is not None
        summary = {"seconds": max(r["seconds"] for r in gathered), "ranks": gathered}
        args.json_summary.write_text(json.dumps(summary, indent=2) + "\n")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

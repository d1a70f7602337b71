"""Baseline for bench_fsdp.py: a single-process "load every shard, concatenate, save" merger.

It works the way verl's FSDP model merger does: every rank file is fully loaded into memory at once (no
mmap), each tensor is concatenated along its shard dim, and only then is anything written, so its peak
memory is about twice the model. Unlike verl it keeps the checkpoint's dtype (verl casts to bf16), so its
output must equal distmerge's default output tensor for tensor.

    python tests/bench/baseline_merge.py --input CKPT --output OUT [--max-shard-size BYTES]
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

RANK_FILE = re.compile(r"^model_world_size_(\d+)_rank_(\d+)\.pt$")


def rank_files(ckpt: Path) -> list[Path]:
    found = {}
    for path in ckpt.iterdir():
        m = RANK_FILE.match(path.name)
        if m:
            found[int(m[2])] = (int(m[1]), path)
    world = {w for w, _ in found.values()}
    if len(world) != 1 or sorted(found) != list(range(world.pop())):
        raise SystemExit(f"baseline: {ckpt}: expected model_world_size_W_rank_0..W-1.pt, found ranks {sorted(found)}")
    return [found[r][1] for r in sorted(found)]


def load_and_merge(files: list[Path]) -> dict:
    import torch
    import torch.distributed.tensor  # noqa: F401 - registers DTensor so weights_only=True can load it
    from torch.distributed.tensor import DTensor, Shard

    def load(path: Path) -> dict:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=False)

    # verl loads the rank files concurrently with a thread pool; doing the same keeps the baseline honest.
    with ThreadPoolExecutor(max_workers=min(32, len(files))) as pool:
        shards = list(pool.map(load, files))
    merged = {}
    for key, first in shards[0].items():
        if not isinstance(first, DTensor):
            merged[key] = first
            continue
        if len(first.placements) != 1:
            raise SystemExit(f"baseline: {key}: only 1-D meshes are supported, got {first.placements}")
        placement = first.placements[0]
        if isinstance(placement, Shard):
            merged[key] = torch.cat([s[key].to_local() for s in shards], dim=placement.dim)
        else:  # Replicate: every rank holds the whole tensor, rank 0's copy will do
            merged[key] = first.to_local()
    return merged  # the shards are freed on return, as in verl: the peak is shards + merged


def save(merged: dict, out: Path, max_shard_size: int) -> None:
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file

    # The same splitter save_pretrained uses, so the file layout is what a Hugging Face save would produce.
    split = split_torch_state_dict_into_shards(
        merged, filename_pattern="model{suffix}.safetensors", max_shard_size=max_shard_size
    )
    out.mkdir(parents=True, exist_ok=True)
    for filename, names in split.filename_to_tensors.items():
        save_file({n: merged[n].contiguous() for n in names}, str(out / filename), metadata={"format": "pt"})
    # Always write the index (HF skips it for one file): distmerge always writes one, keep the layouts alike.
    index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input", type=Path, required=True)
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--max-shard-size", type=int, default=5 * 10**9, help="bytes (default 5GB, like HF)")
    parser.add_argument("--json-summary", type=Path, help="write {'seconds': merge time after imports}")
    args = parser.parse_args()
    import torch.distributed.tensor  # noqa: F401 - imported before the clock starts, as distmerge's are

    start = time.perf_counter()  # the merge's own time after imports, measured like distmerge's
    merged = load_and_merge(rank_files(args.input))
    save(merged, args.output, args.max_shard_size)
    finish(args, start)
    return 0


def finish(args: argparse.Namespace, start: float) -> None:
    """Copy the config beside the weights and report the own timer (shared with the other peers)."""
    hf_config = args.input / "huggingface" / "config.json"
    if hf_config.exists():
        shutil.copy(hf_config, args.output / "config.json")
    if args.json_summary:
        args.json_summary.write_text(json.dumps({"seconds": time.perf_counter() - start}))


if __name__ == "__main__":
    raise SystemExit(main())

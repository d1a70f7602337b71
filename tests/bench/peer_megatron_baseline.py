"""Baseline for bench_megatron.py: the usual "load every mp_rank file, concatenate, convert, save" merger.

It works the way the common Megatron -> Hugging Face converters do (verl's Megatron model merger and many
conversion scripts): every ``model_optim_rng.pt`` is loaded whole with ``torch.load(weights_only=False)``
(a thread pool, as verl does; unpickling ``args`` needs megatron-core importable), TP slices are concatenated
per tensor, pipeline stages' layers renumbered, QKV split per query group, gate/up split per TP slice, the
vocabulary padding trimmed, and only then is anything written (save_file shards + index, like save_pretrained).
Its peak memory is therefore about every rank file plus the merged model.

    python tests/bench/peer_megatron_baseline.py --input CKPT --hf-config HFDIR --output OUT [--max-shard-size B]
"""

from __future__ import annotations

import argparse
import json
import re
import resource
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from baseline_merge import save

RANK_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?$")
COLUMN = ("linear_qkv.weight", "linear_fc1.weight", "word_embeddings.weight", "output_layer.weight")  # TP on dim 0
ROW = ("linear_proj.weight", "linear_fc2.weight")  # TP on dim 1; everything else is replicated
LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
HF_NAMES = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
}


def rank_files(ckpt: Path) -> dict[tuple[int, int], Path]:
    """{(tp, pp): file} of the save named in latest_checkpointed_iteration.txt."""
    tracker = (ckpt / "latest_checkpointed_iteration.txt").read_text().strip()
    save_dir = ckpt / ("release" if tracker == "release" else f"iter_{int(tracker):07d}")
    found = {}
    for path in sorted(save_dir.iterdir()):
        m = RANK_DIR.match(path.name)
        if m:
            found[(int(m[1]), int(m[2] or 0))] = path / "model_optim_rng.pt"
    return found


def load_all(files: dict[tuple[int, int], Path]) -> dict[tuple[int, int], dict]:
    import torch

    def load(path: Path) -> dict:
        return torch.load(path, map_location="cpu", weights_only=False)["model"]

    with ThreadPoolExecutor(max_workers=min(32, len(files))) as pool:
        return dict(zip(files, pool.map(load, files.values()), strict=True))


def concat_tp(shards: list, key: str):  # noqa: ANN201 - torch types stay out of the module imports
    """One Megatron tensor from its TP slices; linear_fc1 slices are each [gate_i; up_i], so regroup them."""
    import torch

    if key.endswith("linear_fc1.weight"):
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    if key.endswith(COLUMN):
        return torch.cat(shards, dim=0)
    if key.endswith(ROW):
        return torch.cat(shards, dim=1)
    return shards[0]  # replicated: every TP rank holds the same copy


def to_hf(name: str, tensor, config: dict, out: dict) -> None:  # noqa: ANN001
    """Store one global Megatron tensor under its Hugging Face name(s) in out. Slices are cloned: save_file
    refuses tensors that share storage, and a trimmed view would keep the padded rows alive."""
    heads, groups = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    if name == "embedding.word_embeddings.weight":
        out["model.embed_tokens.weight"] = tensor[: config["vocab_size"]].clone()
    elif name == "output_layer.weight":
        out["lm_head.weight"] = tensor[: config["vocab_size"]].clone()
    elif name == "decoder.final_layernorm.weight":
        out["model.norm.weight"] = tensor
    elif m := LAYER.match(name):
        prefix, rest = f"model.layers.{m[1]}.", m[2]
        if rest == "self_attention.linear_qkv.weight":
            # Rows per query group: [heads/groups q heads; k; v], head_dim rows each.
            per_group = tensor.reshape(groups, (heads // groups + 2) * head_dim, -1)
            q, k, v = per_group.split([heads // groups * head_dim, head_dim, head_dim], dim=1)
            for proj, t in zip("qkv", (q, k, v), strict=True):
                out[f"{prefix}self_attn.{proj}_proj.weight"] = t.reshape(-1, t.shape[-1]).clone()
        elif rest == "mlp.linear_fc1.weight":
            gate, up = tensor.chunk(2, dim=0)
            out[prefix + "mlp.gate_proj.weight"], out[prefix + "mlp.up_proj.weight"] = gate.clone(), up.clone()
        else:
            out[prefix + HF_NAMES[rest]] = tensor
    else:
        raise SystemExit(f"baseline: no Hugging Face name for {name}")


def merge(states: dict[tuple[int, int], dict], config: dict) -> dict:
    tps = sorted({tp for tp, _ in states})
    offset, out = 0, {}
    for pp in sorted({pp for _, pp in states}):
        stage = [states[(tp, pp)] for tp in tps]
        layers = set()
        for key, first in stage[0].items():
            if key.endswith("_extra_state") or first is None:
                continue
            tensor = concat_tp([s[key] for s in stage], key)
            if m := LAYER.match(key):  # layer numbers restart at 0 on every stage
                layers.add(int(m[1]))
                key = f"decoder.layers.{int(m[1]) + offset}.{m[2]}"
            to_hf(key, tensor, config, out)
        offset += len(layers)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input", type=Path, required=True, help="folder with latest_checkpointed_iteration.txt")
    parser.add_argument("--hf-config", type=Path, required=True, help="folder with the model's config.json")
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--max-shard-size", type=int, default=5 * 10**9, help="bytes (default 5GB, like HF)")
    parser.add_argument("--json-summary", type=Path, help="write {'seconds': merge time after imports, 'peak_rss'}")
    args = parser.parse_args()
    # Imported before the clock starts, as distmerge's are (the unpickler would import megatron on first use).
    import megatron.core.transformer.enums  # noqa: F401
    import torch  # noqa: F401

    start = time.perf_counter()
    config = json.loads((args.hf_config / "config.json").read_text())
    states = load_all(rank_files(args.input))
    merged = merge(states, config)
    del states  # as in verl: the loaded files are dropped before saving, the peak is files + merged model
    save(merged, args.output, args.max_shard_size)
    shutil.copy(args.hf_config / "config.json", args.output / "config.json")
    if args.json_summary:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
        args.json_summary.write_text(json.dumps({"seconds": time.perf_counter() - start, "peak_rss": peak}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Peer for bench_import.py: "the plain way" to turn a Hugging Face Llama into a Megatron-LM torch_dist checkpoint,
as megatron-core's conversion examples do it, in one process.

    python tests/bench/peer_megatron_import.py --input HF_DIR --output OUT [--json-summary S]

One process with a gloo group of world size 1 (megatron-core needs a process group) and model parallel sizes 1:

1. the Hugging Face state dict loaded whole (safetensors load_file);
2. megatron-core's GPTModel built on CPU (local spec, float32; perform_initialization off: its random init would
   be overwritten, and skipping it is in the peer's favour);
3. its state dict made from the Hugging Face tensors (fused QKV per query group, fc1 = [gate; up], the vocabulary
   padded to a multiple of 128 with the last row, as Megatron-LM's converter pads) and loaded into the model;
4. ``dist_checkpointing.save`` of ``{"model": model.sharded_state_dict(), "args": ..., "iteration": 0}`` into
   OUT/release, as Megatron-LM's save_checkpoint calls it, and the tracker "release".

The chunks are TP=1 x PP=1's (whole tensors): megatron-core loads them at any TP x PP, as it loads distmerge's TP2 x
PP2 folder at TP=1; the bytes are the same model's. Peak memory: the Hugging Face tensors plus the model.
The torch_dist writer starts a "spawn" multiprocessing Manager that re-imports this file: everything runs under
``if __name__ == "__main__"``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def megatron_state(hf: dict, config: dict, padded: int) -> dict:
    """The GPTModel's parameters at TP=1 from the Hugging Face tensors (Megatron's documented layout)."""
    import torch

    heads, groups = config["num_attention_heads"], config["num_key_value_heads"]
    hd = config.get("head_dim") or config["hidden_size"] // heads

    def pad(w):
        return torch.cat([w, w[-1:].expand(padded - w.shape[0], -1)])

    out = {"embedding.word_embeddings.weight": pad(hf.pop("model.embed_tokens.weight")),
           "output_layer.weight": pad(hf.pop("lm_head.weight")),
           "decoder.final_layernorm.weight": hf.pop("model.norm.weight")}
    for i in range(config["num_hidden_layers"]):
        p, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        q = hf.pop(p + "self_attn.q_proj.weight").view(groups, heads // groups * hd, -1)
        k = hf.pop(p + "self_attn.k_proj.weight").view(groups, hd, -1)
        v = hf.pop(p + "self_attn.v_proj.weight").view(groups, hd, -1)
        out[m + "self_attention.linear_qkv.weight"] = torch.cat([q, k, v], dim=1).reshape(-1, q.shape[-1])
        out[m + "input_layernorm.weight"] = hf.pop(p + "input_layernorm.weight")
        out[m + "self_attention.linear_proj.weight"] = hf.pop(p + "self_attn.o_proj.weight")
        out[m + "mlp.linear_fc1.weight"] = torch.cat([hf.pop(p + "mlp.gate_proj.weight"),
                                                      hf.pop(p + "mlp.up_proj.weight")])
        out[m + "pre_mlp_layernorm.weight"] = hf.pop(p + "post_attention_layernorm.weight")
        out[m + "mlp.linear_fc2.weight"] = hf.pop(p + "mlp.down_proj.weight")
    return out


def convert(src: Path, dst: Path) -> None:
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from safetensors.torch import load_file

    sys.path.insert(0, str(ROOT))
    from tests.fixtures import make_megatron as mk
    from tests.fixtures import megatron_models as mm

    mk.patch_cuda_for_cpu()
    dist.init_process_group("gloo", rank=0, world_size=1)
    ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    config = json.loads((src / "config.json").read_text())
    padded = -(-config["vocab_size"] // 128) * 128
    hf = load_file(str(src / "model.safetensors"))  # 1. whole
    fam = mm.Family("llama", "LlamaConfig", config, perturb_1d=False)
    tc = mm.megatron_config(fam, 1, 1, None, 1)
    tc.perform_initialization = False
    model = GPTModel(config=tc, transformer_layer_spec=mm.layer_spec(fam), vocab_size=padded,  # 2.
                     max_sequence_length=config["max_position_embeddings"], pre_process=True, post_process=True,
                     share_embeddings_and_output_weights=False, position_embedding_type="rope")
    missing, unexpected = model.load_state_dict(megatron_state(hf, config, padded), strict=False)  # 3.
    assert not unexpected and all(k.endswith("_extra_state") for k in missing), (missing, unexpected)
    del hf
    release = dst / "release"
    release.mkdir(parents=True)
    content = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
    metadata = dict(content, dp_cp_group=ps.get_data_parallel_group(with_context_parallel=True))
    args = argparse.Namespace(tensor_model_parallel_size=1, pipeline_model_parallel_size=1, padded_vocab_size=padded,
                              num_layers=config["num_hidden_layers"])
    state = {"model": model.sharded_state_dict(metadata=metadata), "args": args, "checkpoint_version": 3.0,
             "iteration": 0}
    dist_checkpointing.save(state, str(release), content_metadata=content)  # 4.
    (dst / "latest_checkpointed_iteration.txt").write_text("release")
    ps.destroy_model_parallel()
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input", type=Path, required=True)
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--json-summary", type=Path)
    args = parser.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29400 + os.getpid() % 1000))
    start = time.perf_counter()
    convert(args.input, args.output)
    seconds = time.perf_counter() - start
    if args.json_summary:
        args.json_summary.write_text(json.dumps({"seconds": seconds, "peak_rss": resource.getrusage(
            resource.RUSAGE_SELF).ru_maxrss * 1024}))
    print(f"peer_megatron_import: {seconds:.2f} s -> {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

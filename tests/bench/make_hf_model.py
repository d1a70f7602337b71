"""Write a Llama-shaped Hugging Face model of about --size bytes (fp32) for bench_import.py: config.json and one
model.safetensors of seeded random weights, as save_pretrained lays them out (LlamaForCausalLM's names and shapes,
read off the model built on the meta device). No training library is needed, and it takes seconds, not minutes.

    python tests/bench/make_hf_model.py --out DIR --size 0.8GB [--even-layers]

The shape is make_ckpt.llama_shape's (Llama-7B proportions, GQA, vocab 32000, untied); --even-layers rounds the
layer count down to an even number, so PP=2 divides it.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from common import parse_size
from make_ckpt import llama_shape


def hf_shape(size: int, even_layers: bool) -> dict:
    shape = llama_shape(size)
    if even_layers:
        layers = shape["num_hidden_layers"]
        per_layer = (shape["params"] - 2 * shape["vocab_size"] * shape["hidden_size"] - shape["hidden_size"]) // layers
        shape["num_hidden_layers"] = max(2, layers // 2 * 2)
        shape["params"] += (shape["num_hidden_layers"] - layers) * per_layer
    return shape


def make(out: Path, size: int, even_layers: bool) -> dict:
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = hf_shape(size, even_layers)
    config = LlamaConfig(**{k: v for k, v in shape.items() if k != "params"}, tie_word_embeddings=False,
                         architectures=["LlamaForCausalLM"],
                         max_position_embeddings=4096, torch_dtype="float32")
    with torch.device("meta"):
        names = {k: tuple(v.shape) for k, v in LlamaForCausalLM(config).state_dict().items()}
    gen = torch.Generator().manual_seed(0)
    tensors = {k: (torch.randn(s, generator=gen) * 0.02) for k, s in names.items()}
    out.mkdir(parents=True, exist_ok=True)
    config.to_json_file(str(out / "config.json"))
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return {"tensors": len(tensors), "bytes": sum(t.numel() * 4 for t in tensors.values()), **shape}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--size", type=parse_size, default=parse_size("0.8GB"))
    parser.add_argument("--even-layers", action="store_true")
    args = parser.parse_args()
    made = make(args.out, args.size, args.even_layers)
    print(f"make_hf_model: {made['tensors']} tensors, {made['bytes'] / 1e9:.2f} GB, {made['num_hidden_layers']} "
          f"layers, hidden {made['hidden_size']} -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

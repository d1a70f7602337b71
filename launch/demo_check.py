"""Check a merged demo model against the reference the saving job wrote: exact tensors, same logits."""

import json
import sys
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM


def main(merged: Path, reference: Path) -> int:
    index = json.loads((merged / "model.safetensors.index.json").read_text())
    config = json.loads((merged / "config.json").read_text())
    with safe_open(reference / "model.safetensors", framework="pt") as ref:
        expected = set(ref.keys()) - ({"lm_head.weight"} if config.get("tie_word_embeddings") else set())
        assert set(index["weight_map"]) == expected, "tensor names differ from the reference"
        for name, file in index["weight_map"].items():
            with safe_open(merged / file, framework="pt") as out:
                assert torch.equal(out.get_tensor(name), ref.get_tensor(name)), f"{name} differs"
    print(f"tensors: {len(expected)} of {len(expected)} equal to the reference (torch.equal)")
    saved = torch.load(reference / "logits.pt", weights_only=True)
    model = AutoModelForCausalLM.from_pretrained(merged).eval()
    with torch.no_grad():
        logits = model(saved["input_ids"]).logits.float()
    diff = (logits - saved["logits"]).abs().max().item()
    assert diff <= 1e-5, f"logits differ by {diff}"
    print(f"logits: from_pretrained(merged) matches the original model (max abs diff {diff:.1e})")
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), Path(sys.argv[2])))

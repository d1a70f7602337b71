"""DeepSpeed's own reference for a save and the comparison with it (test_merge_deepspeed.py, test_merge_openrlhf.py)."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open


def reference(ckpt: Path, name: str) -> dict[str, torch.Tensor]:
    with safe_open(ckpt.parent / f"{ckpt.name}_reference" / name, framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def assert_same(merged: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert sorted(merged) == sorted(expected)
    for key, want in expected.items():
        assert merged[key].dtype == want.dtype and torch.equal(merged[key], want), key

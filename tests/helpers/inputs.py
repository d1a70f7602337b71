"""The folder a user passes for a fixture (test_quantize*.py)."""

from __future__ import annotations

from pathlib import Path


def input_of(ckpt: Path) -> Path:
    """The folder a user passes (an HF Trainer's checkpoint-N inside a DeepSpeed fixture)."""
    return next(ckpt.glob("checkpoint-*"), ckpt)

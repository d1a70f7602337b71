"""verify of a checkpoint against a reference, and what its output and verdict say (test_verify_*.py,
test_verl_commands.py)."""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path

from safetensors.torch import load_file, save_file

from distmerge.front.cli import main as distmerge_main
from tests.conftest import input_untouched, reference_dir, tree_digest


def verify(*args: object) -> int:
    return distmerge_main(["verify", *map(str, args)])


def verdict(capsys) -> str:
    return [line for line in capsys.readouterr().out.splitlines() if line.startswith("verify:")][-1]


@contextmanager
def nothing_written(ckpt: Path, *folders: Path):
    """The checkpoint (every file, folder and link under it) and its reference untouched; nothing new beside the
    checkpoint (an output folder) nor in `folders` (the working directory), at any depth."""
    before = [tree_digest(f) for f in folders]
    beside = sorted(os.listdir(ckpt.parent))
    with input_untouched(ckpt, reference_dir(ckpt)):
        yield
    assert sorted(os.listdir(ckpt.parent)) == beside
    for folder, was in zip(folders, before, strict=True):
        assert tree_digest(folder) == was, folder


def bumped_reference(ref: Path, dst: Path, name: str) -> Path:
    """A copy of the reference folder's model.safetensors with one element of `name` changed by 1e-2."""
    state = load_file(ref / "model.safetensors")
    state[name] = state[name].clone()
    state[name].view(-1)[5] += 1e-2
    dst.mkdir()
    save_file(state, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def one_error(capsys) -> str:
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("distmerge: error: "), lines
    return lines[0]


def settled(rep: dict) -> dict:
    """The report with each cosine to 12 digits: its float64 sums are torch's, whose order follows the thread
    count (torchrun runs one thread per process), so an exact tensor's cosine is 1 or 1 - 1e-16 (compare.py)."""
    for t in rep["tensors"]:
        if t["figures"]:
            t["figures"]["cosine"] = round(t["figures"]["cosine"], 12)
    return rep

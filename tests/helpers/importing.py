"""What the import tests share (tests/test_import_*.py): running `distmerge import` in this process, a folder's bytes,
Megatron-LM's vocabulary padding, and the torchrun job that has a training library load the imported folders."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from distmerge.front.cli import main as distmerge_main
from tests.conftest import REPO
from tests.helpers.ports import free_port


def import_inproc(*args: object) -> int:
    """`distmerge import --quiet ARGS` in this process: its exit status."""
    return distmerge_main(["import", "--quiet", *map(str, args)])


def folder_bytes(root: Path) -> dict[str, bytes]:
    """Every file under `root`, by its path inside it."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def padded_vocab(vocab: int, tp: int, divisible_by: int) -> int:
    """Megatron-LM's _vocab_size_with_padding: up to a multiple of divisible_by x TP."""
    multiple = divisible_by * tp
    return -(-vocab // multiple) * multiple


def load_with(loader: str, nproc: int, cases: list[str], result: Path) -> dict:
    """tests/fixtures/`loader` under torchrun (N processes): the training library's own load of each case, its
    findings written as JSON to `result`."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--nnodes", "1",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
           str(REPO / "tests" / "fixtures" / loader), "--result", str(result),
           *[a for c in cases for a in ("--case", c)]]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "PYTHONPATH": str(REPO)}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=env, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(result.read_text())


def save_hf_model(family: str, folder: Path) -> Path:
    """The fixtures' seeded tiny transformers model of `family` (megatron_models.FAMILIES), as save_pretrained
    writes it, in `folder`."""
    from tests.fixtures import megatron_models as mm

    mm.build_hf_model(mm.FAMILIES[family]).save_pretrained(folder, safe_serialization=True)
    return folder

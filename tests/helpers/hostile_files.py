"""Damaged copies of real saves and the one line a merge of each must end in (test_hostile_*.py)."""

from __future__ import annotations

import resource
import shutil
import signal
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from distmerge.front.cli import main as distmerge_main
from tests.conftest import input_untouched, reference_dir, tree_digest

SECONDS, MEMORY = 10, 3 << 29  # per case: wall time, address space beyond what the test process holds


@contextmanager
def bounded(seconds: int = SECONDS, memory: int = MEMORY):
    """The block must end within `seconds` (SIGALRM interrupts a blocking open or a Python loop) and allocate
    less than `memory` of new address space (RLIMIT_AS, lowered for the block and restored)."""
    with open("/proc/self/status") as f:
        vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (vm + memory, hard))

    def stop(*_):
        raise TimeoutError(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, stop)
    signal.alarm(seconds)
    start = time.monotonic()
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    assert time.monotonic() - start < seconds


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    return make_outside(tmp_path)


def make_outside(tmp_path: Path) -> Path:
    """A folder beside the input that links may point to: a secret and a config.json someone else owns."""
    folder = tmp_path / "outside"
    folder.mkdir()
    (folder / "secret_token.txt").write_text("hf_secret\n")
    (folder / "config.json").write_text('{"model_type": "llama"}\n')
    return folder


def run(command: str, ckpt: Path, out: Path, outside: Path, capsys, *args: str,
        bounds: tuple[int, int] = (SECONDS, MEMORY)) -> tuple[int, list[str]]:
    before = tree_digest(outside)
    with input_untouched(ckpt), bounded(*bounds):  # hashing the input before and after is outside the bound
        if command == "merge":
            code = distmerge_main(["merge", "--quiet", "--input", str(ckpt), "--output", str(out), *args])
        else:
            code = distmerge_main(["inspect", str(ckpt), *args])
    captured = capsys.readouterr()
    assert tree_digest(outside) == before, "a file outside the input changed"
    assert not out.exists() or not list(out.rglob("secret_token.txt")), "an outside file was copied into the output"
    assert "Traceback" not in captured.err
    return code, [line for line in captured.err.splitlines() if line.strip()]


def refused(code: int, lines: list[str], words: str, out: Path) -> None:
    assert code == 1 and len(lines) == 1 and lines[0].startswith("distmerge: error: "), lines
    assert words in lines[0], lines[0]
    assert "internal error" not in lines[0], lines[0]
    assert not (out / "model.safetensors.index.json").exists()


def rank(ckpt: Path, r: int) -> Path:
    return ckpt / f"model_world_size_4_rank_{r}.pt"


def swap(a: Path, b: Path, relabelled: bool = False) -> None:
    """Exchange two rank files; `relabelled`: also rewrite the folder name torch.save put inside each zip (same
    length, so offsets and CRCs stay valid), as if each had been saved under its new name."""
    data_a, data_b = a.read_bytes(), b.read_bytes()
    if relabelled:
        tag_a, tag_b = f"{a.stem}/".encode(), f"{b.stem}/".encode()
        data_a, data_b = data_a.replace(tag_a, tag_b), data_b.replace(tag_b, tag_a)
    a.write_bytes(data_b)
    b.write_bytes(data_a)


SAVE = "iter_0000001"


def megatron_copy(megatron_ckpts, tmp_path: Path) -> Path:
    original = megatron_ckpts["megatron_tp2pp2"]
    ckpt = Path(shutil.copytree(original, tmp_path / "ckpt", symlinks=True))
    shutil.copytree(reference_dir(original) / "huggingface", ckpt / "huggingface")
    return ckpt


def optim(ckpt: Path, r: int) -> Path:
    return ckpt / "global_step2" / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt"

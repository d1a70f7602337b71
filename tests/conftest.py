"""Shared fixtures: real sharded checkpoints, made once per test session by real FSDP jobs."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from distmerge.cli import main as distmerge_main

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def fsdp_ckpts(tmp_path_factory) -> dict[str, Path]:
    """{case: checkpoint folder}; each case's reference sits beside it as `{case}_reference/`."""
    from tests.fixtures.build import build_fsdp_fixtures

    return built_once("fsdp", build_fsdp_fixtures, tmp_path_factory)


@pytest.fixture(scope="session")
def dcp_ckpts(tmp_path_factory) -> dict[str, Path]:
    """Real dcp.save folders and HuggingFaceStorageWriter shards (tests/fixtures/make_dcp.py)."""
    from tests.fixtures.build import build_dcp_fixtures

    return built_once("dcp", build_dcp_fixtures, tmp_path_factory)


@pytest.fixture(scope="session")
def ds_ckpts(tmp_path_factory) -> dict[str, Path]:
    """Real DeepSpeed ZeRO saves by deepspeed.initialize and the HF Trainer (tests/fixtures/make_deepspeed.py)."""
    from tests.fixtures.deepspeed_cases import build_deepspeed_fixtures

    return built_once("deepspeed", build_deepspeed_fixtures, tmp_path_factory)


@pytest.fixture(scope="session")
def megatron_ckpts(tmp_path_factory) -> dict[str, Path]:
    """Real megatron-core saves (tests/fixtures/make_megatron.py); references beside them, as for FSDP."""
    from tests.fixtures.build import build_megatron_fixtures

    return built_once("megatron", build_megatron_fixtures, tmp_path_factory)


@pytest.fixture(scope="session")
def tt_ckpts(tmp_path_factory) -> dict[str, Path]:
    """Real torchtitan dumps saved by its own CheckpointManager (tests/fixtures/make_torchtitan.py); references
    beside them in `{case}_reference/`."""
    from tests.fixtures.make_torchtitan import build_torchtitan_fixtures

    return built_once("torchtitan", build_torchtitan_fixtures, tmp_path_factory)


# The scripts each fixture family is made by: a change to any of them rebuilds that family's cached saves.
FIXTURE_SOURCES = {
    "fsdp": ("build.py", "make_fsdp.py", "make_lora.py"),
    "dcp": ("build.py", "make_dcp.py", "make_fsdp.py"),
    "megatron": ("build.py", "make_megatron.py", "megatron_models.py", "megatron_moe.py"),
    "deepspeed": ("deepspeed_cases.py", "make_deepspeed.py", "make_fsdp.py"),
    "torchtitan": ("make_torchtitan.py", "torchtitan_cases.py"),
    "vl": ("make_vl.py", "make_fsdp.py"),
}


def built_once(name: str, build, tmp_path_factory) -> dict[str, Path]:
    """Build a fixture family in a fresh temp folder, or, when DISTMERGE_FIXTURE_CACHE names a folder (a
    developer's shortcut; CI never sets it), once per version of tests/fixtures/ and then reuse it across
    pytest runs. Tests copy a fixture before damaging it, so the cached saves stay as the jobs wrote them."""
    cache = os.environ.get("DISTMERGE_FIXTURE_CACHE")
    if not cache:
        return build(tmp_path_factory.mktemp(name))
    digest = hashlib.sha256()
    for source in FIXTURE_SOURCES[name]:
        digest.update(source.encode() + (REPO / "tests" / "fixtures" / source).read_bytes())
    root = Path(cache) / f"{name}-{digest.hexdigest()[:12]}"
    root.parent.mkdir(parents=True, exist_ok=True)
    with open(root.parent / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # several pytest runs at once: one builds, the others wait
        listing = root / ".cases.json"
        if listing.exists():
            return {case: root / rel for case, rel in json.loads(listing.read_text()).items()}
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir()
        cases = build(root)
        listing.write_text(json.dumps({case: str(path.relative_to(root)) for case, path in cases.items()}))
        return cases


@pytest.fixture(scope="session")
def vl_ckpts(tmp_path_factory) -> dict[str, Path]:
    """A real FSDP2 save of a tiny Qwen2.5-VL (tests/fixtures/make_vl.py); save_pretrained's output beside it."""
    from tests.fixtures.make_vl import build_vl_fixtures

    return built_once("vl", build_vl_fixtures, tmp_path_factory)


def reference_dir(ckpt: Path) -> Path:
    return ckpt.parent / f"{ckpt.name}_reference"


def merge_inproc(*args: str) -> int:
    """One process, no torchrun: the same code path as `python -m distmerge`."""
    return distmerge_main(["merge", "--quiet", *map(str, args)])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(nproc: int, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    """A real `torchrun --nproc-per-node N -m distmerge ...` job on loopback."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--nnodes", "1",
        "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "-m", "distmerge", *map(str, args),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)


def load_merged(out: Path) -> dict[str, torch.Tensor]:
    index = json.loads((out / "model.safetensors.index.json").read_text())
    tensors = {}
    for name in sorted(set(index["weight_map"].values())):
        with safe_open(out / name, framework="pt") as f:
            for key in f.keys():
                assert index["weight_map"][key] == name
                tensors[key] = f.get_tensor(key)
    assert set(tensors) == set(index["weight_map"])
    return tensors


def load_reference(ckpt: Path) -> dict[str, torch.Tensor]:
    with safe_open(reference_dir(ckpt) / "model.safetensors", framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def expected_tensors(ckpt: Path) -> dict[str, torch.Tensor]:
    """The reference state dict as a merged model should hold it: no tied head when the config ties."""
    ref = load_reference(ckpt)
    config = json.loads((ckpt / "huggingface" / "config.json").read_text())
    if config.get("tie_word_embeddings", True):
        ref.pop("lm_head.weight", None)
    return ref


def assert_exact(merged: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert sorted(merged) == sorted(expected), "keys differ"
    for key, ref in expected.items():
        assert merged[key].dtype == ref.dtype, key
        assert torch.equal(merged[key], ref), key


def tree_bytes(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


def assert_refused(ckpt: Path, out: Path, words: str, capsys, *args: str) -> None:
    """A merge of a bad input: exit 1, one error line that says `words`, no index, the input untouched."""
    before = tree_bytes(ckpt)
    assert merge_inproc("--input", ckpt, "--output", out, *args) == 1
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("distmerge: error: "), lines
    assert words in lines[0], lines[0]
    assert not (out / "model.safetensors.index.json").exists()
    assert tree_bytes(ckpt) == before


def assert_reference_logits(merged: Path, ckpt: Path) -> None:
    """from_pretrained(merged) gives the logits the original model gave in the saving job."""
    from transformers import AutoModelForCausalLM

    ref = torch.load(reference_dir(ckpt) / "logits.pt", weights_only=True)
    model = AutoModelForCausalLM.from_pretrained(merged).eval()
    with torch.no_grad():
        logits = model(ref["input_ids"]).logits.float()
    torch.testing.assert_close(logits, ref["logits"], rtol=0, atol=1e-5)


def merge_each(ckpts: dict[str, Path], cases: list[str], root: Path) -> dict[str, Path]:
    """Every case merged once by one process, into root/case (module fixtures reuse these)."""
    for case in cases:
        assert merge_inproc("--input", ckpts[case], "--output", root / case) == 0, case
    return {case: root / case for case in cases}

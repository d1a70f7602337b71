"""The input-format contract, checked on a real sample of every registered format (formats/base.py).

A new format is picked up from the registry by itself: it only needs a row in SAMPLES (a real checkpoint
made by the trainer's own code), and then gets every test here. What each test proves:
- detection: the registry's detection order finds the format on its own sample;
- coverage: scan + open of every file give inventories in which each tensor is covered exactly once,
  and every fragment's bytes can be read where the format says they are;
- memory: the reader keeps no fragment it hands out (the plan holds them);
- replicas: every copy of a replicated block holds the same bytes as the copy the merge keeps;
- truncation: a truncated input file is refused with one error line, and no index is written.
"""

from __future__ import annotations

import gc
import inspect
import math
import shutil
from pathlib import Path

import pytest
import torch

from distmerge.engine import discover as disc
from distmerge.engine import plan as planning
from distmerge.engine.reader import Reader
from distmerge.formats import registry
from distmerge.formats.registry import REGISTERED
from tests.conftest import merge_inproc, reference_dir

# format -> (session fixture holding real checkpoints, case); cases with replicated blocks where they exist.
SAMPLES = {
    "fsdp": ("fsdp_ckpts", "fsdp2_llama_hsdp_2x2"),
    "deepspeed": ("ds_ckpts", "ds_z2_odd_w3"),  # flat partitions that start mid-row
    "megatron": ("megatron_ckpts", "megatron_tp2pp2"),
    "megatron-dist": ("megatron_ckpts", "megatron_dist_tp2pp2"),
    "dcp": ("dcp_ckpts", "dcp_qwen2_tied_hsdp_2x2"),
    "dcp-hf": ("dcp_ckpts", "dcp_llama_hfwriter_w4"),
    "torchtitan": ("tt_ckpts", "tt_qwen3_moe_w4"),
}
FORMATS = [f.name for f in registry.all_formats()]


def sample(request, name: str) -> tuple[Path, list[str]]:
    """The sample's folder and the arguments that give it a config (Megatron saves carry none)."""
    fixture, case = SAMPLES[name]
    ckpt = request.getfixturevalue(fixture)[case]
    hf = reference_dir(ckpt) / "huggingface"
    return ckpt, ["--hf-config", str(hf)] if hf.is_dir() else []


def opened(ckpt: Path, hf_args: list[str]) -> tuple[disc.Discovery, Reader, list]:
    found = disc.discover(ckpt, "auto", Path(hf_args[1]) if hf_args else None, {})
    reader = Reader(found.scan, registry.get(found.scan.format))
    return found, reader, reader.open(list(range(len(found.scan.files))))


def test_every_registered_format_has_a_sample():
    assert set(SAMPLES) == set(REGISTERED), "add a real sample checkpoint of each new format to SAMPLES"


@pytest.mark.parametrize("name", FORMATS)
def test_detected_as_itself(name, request):
    ckpt, _ = sample(request, name)
    assert registry.pick(ckpt).name == name


@pytest.mark.parametrize("name", FORMATS)
def test_inventories_cover_each_tensor_once(name, request):
    found, reader, fragments = opened(*sample(request, name))
    try:
        sources = planning.merge_inventories(fragments, found.scan.files)  # raises on gaps and overlaps
        assert sources
        for source in sources.values():
            assert sum(f.numel for f in source.fragments) == math.prod(source.meta.shape), source.meta.name
            for frag in source.fragments:
                reader.read_into(frag, torch.empty(frag.nbytes, dtype=torch.uint8))
        chosen = sum(f.nbytes for s in sources.values() for f in s.fragments)
        assert reader.bytes_read == chosen
    finally:
        reader.close()


@pytest.mark.parametrize("name", FORMATS)
def test_the_reader_keeps_no_fragment_it_hands_out(name, request):
    """The inventory open returns is the caller's alone: the merge packs it, gathers it and plans from the
    gathered copies, so a fragment the reader kept too was held twice (a 1024-rank DCP save's 1.16 million: ~0.3
    GB of 1.5 at N=1, issue #42). Shown to fail: Reader.open keeping each OpenedFile's fragments."""
    found, reader, fragments = opened(*sample(request, name))
    try:
        assert fragments
        some = fragments[:: max(1, len(fragments) // 50)]
        for frag in some:
            holders = [r for r in gc.get_referrers(frag) if r is not fragments and r is not some
                       and not inspect.isframe(r)]
            assert holders == [], f"{frag.name} is also held by {[type(r).__name__ for r in holders]}"
    finally:
        reader.close()


@pytest.mark.parametrize("name", FORMATS)
def test_replicas_agree(name, request):
    found, reader, fragments = opened(*sample(request, name))
    try:
        sources = planning.merge_inventories(fragments, found.scan.files)
        for source in sources.values():
            kept = {f.region: f for f in source.fragments}
            for copy in source.replicas:
                assert copy.region in kept, f"{copy.name}: a replica of a block nobody keeps"
                assert _bytes(reader, copy) == _bytes(reader, kept[copy.region]), copy.name
    finally:
        reader.close()


@pytest.mark.parametrize("name", FORMATS)
def test_truncated_file_is_refused(name, request, tmp_path, capfd):
    ckpt, hf_args = sample(request, name)
    broken = tmp_path / "ckpt"
    shutil.copytree(ckpt, broken, symlinks=True)
    found = disc.discover(broken, "auto", Path(hf_args[1]) if hf_args else None, {})
    largest = max(found.scan.files, key=lambda f: f.size)
    path = Path(found.scan.root) / largest.path
    with open(path, "r+b") as f:
        f.truncate(largest.size // 2)
    capfd.readouterr()
    assert merge_inproc("--input", broken, "--output", tmp_path / "out", *hf_args) != 0
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("distmerge: error: "), err
    assert not (tmp_path / "out" / "model.safetensors.index.json").exists()


def _bytes(reader: Reader, frag) -> bytes:
    data = torch.empty(frag.nbytes, dtype=torch.uint8)
    reader.read_into(frag, data, count=False)
    return data.numpy().tobytes()

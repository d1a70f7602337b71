"""Hostile and broken inputs: each gives one clear line, exit 1, no index, and leaves the input as it was.

Each case damages a private copy of a real checkpoint the way it happens in practice (an interrupted copy,
a file from another run, a stray link) and names the words the error must contain."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import assert_refused, merge_inproc

W4 = "fsdp2_llama_w4"


def rank(ckpt: Path, r: int) -> Path:
    return ckpt / f"model_world_size_4_rank_{r}.pt"


def truncate(ckpt: Path, ckpts) -> None:
    data = rank(ckpt, 2).read_bytes()
    rank(ckpt, 2).write_bytes(data[: len(data) // 3])


def zero_bytes(ckpt: Path, ckpts) -> None:
    rank(ckpt, 3).write_bytes(b"")


def random_bytes(ckpt: Path, ckpts) -> None:
    rank(ckpt, 1).write_bytes(os.urandom(4096))


def extra_rank(ckpt: Path, ckpts) -> None:
    shutil.copy(rank(ckpt, 0), ckpt / "model_world_size_4_rank_4.pt")


def mixed_world_sizes(ckpt: Path, ckpts) -> None:
    shutil.copy(ckpts["fsdp2_llama_w2"] / "model_world_size_2_rank_0.pt", ckpt)


def other_model(ckpt: Path, ckpts) -> None:
    # the qwen2 run's rank 1 file under this run's name: different tensors and shapes
    shutil.copy(ckpts["fsdp2_qwen2_tied_w4"] / "model_world_size_4_rank_1.pt", rank(ckpt, 1))


def only_optimizer(ckpt: Path, ckpts) -> None:
    for r in range(4):
        rank(ckpt, r).unlink()


def invalid_config(ckpt: Path, ckpts) -> None:
    (ckpt / "huggingface" / "config.json").write_text("{not json")


def link_out_of_input(ckpt: Path, ckpts) -> None:
    outside = ckpt.parent / "elsewhere.pt"
    rank(ckpt, 0).rename(outside)
    rank(ckpt, 0).symlink_to(outside)


CASES: dict[str, tuple[Callable, str]] = {
    "truncated": (truncate, "rank_2.pt"),
    "zero-byte": (zero_bytes, "is empty (0 bytes)"),
    "random bytes": (random_bytes, "is not a torch.save file"),
    "extra rank": (extra_rank, "unexpected rank files for ranks 4"),
    "mixed world sizes": (mixed_world_sizes, "mixes checkpoints of world sizes [2, 4]"),
    "another model's file": (other_model, "another"),
    "only optimizer files": (only_optimizer, "holds only optimizer files"),
    "invalid config.json": (invalid_config, "is not valid JSON"),
    "link out of the input": (link_out_of_input, "leads outside the input folder"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input(case, fsdp_ckpts, tmp_path, capsys):
    damage, words = CASES[case]
    ckpt = Path(shutil.copytree(fsdp_ckpts[W4], tmp_path / "ckpt", symlinks=True))
    damage(ckpt, fsdp_ckpts)
    assert_refused(ckpt, tmp_path / "out", words, capsys)


@pytest.mark.parametrize(("make", "words"), [
    (lambda tmp: tmp / "absent", "does not exist"),
    (lambda tmp: (tmp / "empty").mkdir() or tmp / "empty", "is empty"),
    (lambda tmp: (tmp / "file.pt").write_bytes(b"x") and tmp / "file.pt", "is not a folder"),
])
def test_missing_or_empty_input(make, words, tmp_path, capsys):
    assert merge_inproc("--input", make(tmp_path), "--output", tmp_path / "out") == 1
    assert words in capsys.readouterr().err


def test_output_equal_to_input_is_refused(fsdp_ckpts, tmp_path, capsys):
    ckpt = Path(shutil.copytree(fsdp_ckpts[W4], tmp_path / "ckpt"))
    assert merge_inproc("--input", ckpt, "--output", ckpt, "--overwrite") == 1
    assert "inside the input" in capsys.readouterr().err


def test_dcp_metadata_pointing_outside_is_refused(tmp_path, capsys):
    """A .metadata whose storage path climbs out of the folder (`../`): never opened."""
    import pickle

    from distmerge.formats.torch_private import dcp as private

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "__0_0.distcp").write_bytes(b"")
    meta = private.DcpMetadata.of([private.Chunk(
        fqn="w", dtype=__import__("torch").float32, global_shape=(2,), offsets=(0,), lengths=(2,),
        file="../secret.distcp", offset=0, length=8)])
    from distmerge.formats.dcp import folder as dcp

    dcp._metadata.cache_clear()
    (ckpt / ".metadata").write_bytes(pickle.dumps(0))
    original = dcp.load_metadata
    dcp.load_metadata = lambda src, root: meta
    try:
        assert merge_inproc("--input", ckpt, "--output", tmp_path / "out", "--hf-config", tmp_path) == 1
    finally:
        dcp.load_metadata = original
    assert "leads outside the input folder" in capsys.readouterr().err

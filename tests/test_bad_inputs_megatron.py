"""Broken Megatron saves: each gives one clear line, exit 1, no index, and leaves the input as it was.

Each case damages a private copy of a real megatron-core save (tests/fixtures/make_megatron.py)."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import assert_refused, merge_inproc, reference_dir

SAVE = "iter_0000001"


def rank_file(ckpt: Path, folder: str) -> Path:
    return ckpt / SAVE / folder / "model_optim_rng.pt"


def missing_stage(ckpt: Path) -> None:
    shutil.rmtree(ckpt / SAVE / "mp_rank_01_001")


def missing_tp_rank(ckpt: Path) -> None:
    for stage in ("000", "001"):
        shutil.rmtree(ckpt / SAVE / f"mp_rank_01_{stage}")


def duplicated_spelling(ckpt: Path) -> None:
    shutil.copytree(ckpt / SAVE / "mp_rank_00_000", ckpt / SAVE / "mp_rank_00")


def duplicated_file(ckpt: Path) -> None:
    shutil.copy(rank_file(ckpt, "mp_rank_01_000"), ckpt / SAVE / "mp_rank_01_000" / "model.pt")


def empty_rank_folder(ckpt: Path) -> None:
    rank_file(ckpt, "mp_rank_00_001").unlink()


def truncated(ckpt: Path) -> None:
    path = rank_file(ckpt, "mp_rank_01_001")
    path.write_bytes(path.read_bytes()[:5000])


def file_of_another_save(ckpt: Path) -> None:
    """The TP-only save's rank 1 file (both layers) in place of stage 0's: layer 1 then has three pieces."""
    shutil.copy(rank_file(ckpt.parent / "megatron_tp2", "mp_rank_01"), rank_file(ckpt, "mp_rank_01_000"))


def file_of_another_iteration(ckpt: Path) -> None:
    """The same run's rank file saved at iteration 2 (re-saved with megatron-core importable, as Megatron-LM does)."""
    import torch

    path = rank_file(ckpt, "mp_rank_00_001")
    state = torch.load(path, weights_only=False)
    state["iteration"] = 2
    torch.save(state, path)


def wrong_heads_in_config(ckpt: Path) -> None:
    edit_config(ckpt, num_attention_heads=8)


def unknown_architecture(ckpt: Path) -> None:
    edit_config(ckpt, architectures=["GPT2LMHeadModel"], model_type="gpt2")


def edit_config(ckpt: Path, **changes) -> None:
    path = ckpt / "huggingface" / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


class RunsCode:
    def __reduce__(self):
        return (os.system, ("touch distmerge-was-here",))


def code_in_pickle(ckpt: Path) -> None:
    """A rank file whose pickle calls os.system when loaded with a plain pickle/torch.load."""
    path = rank_file(ckpt, "mp_rank_01_001")
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as archive:
        archive.writestr("model_optim_rng/data.pkl", pickle.dumps({"model": {"w": RunsCode()}}, protocol=2))


CASES: dict[str, tuple[Callable, str]] = {
    "pipeline stage folder missing": (missing_stage, "rank folders missing for TP 1 PP 1"),
    "tensor-parallel rank missing": (missing_tp_rank, "args say tensor_model_parallel_size=2 but the mp_rank "
                                                      "folders make 1"),
    "two spellings of one rank": (duplicated_spelling, "mixes mp_rank folder spellings"),
    "model.pt beside model_optim_rng.pt": (duplicated_file, "holds both model_optim_rng.pt and model.pt"),
    "rank folder without its file": (empty_rank_folder, "has no model_optim_rng.pt or model.pt"),
    "truncated rank file": (truncated, "is not a torch.save file"),
    "rank file of another save": (file_of_another_save, "was saved by another run: its args say "
                                                        "pipeline_model_parallel_size=1"),
    "rank file of another iteration": (file_of_another_iteration, "saved at iteration 2, not 1"),
    "config with other head counts": (wrong_heads_in_config, "wrong config.json?"),
    "architecture without a mapping": (unknown_architecture, "has no Megatron mapping"),
    "pickle that runs code": (code_in_pickle, "global posix.system is not allowed"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_megatron_input(case, megatron_ckpts, tmp_path, monkeypatch, capsys):
    damage, words = CASES[case]
    original = megatron_ckpts["megatron_tp2pp2"]
    ckpt = Path(shutil.copytree(original, tmp_path / "megatron_tp2pp2"))
    shutil.copytree(megatron_ckpts["megatron_tp2"], tmp_path / "megatron_tp2")
    shutil.copytree(reference_dir(original) / "huggingface", ckpt / "huggingface")
    damage(ckpt)
    monkeypatch.chdir(tmp_path)
    assert_refused(ckpt, tmp_path / "out", words, capsys)
    assert not (tmp_path / "distmerge-was-here").exists()


def test_torch_dist_file_missing(megatron_ckpts, tmp_path, capsys):
    original = megatron_ckpts["megatron_dist_tp2pp2"]
    ckpt = Path(shutil.copytree(original, tmp_path / "ckpt"))
    (ckpt / SAVE / "__3_0.distcp").unlink()
    config = reference_dir(original) / "huggingface"
    assert merge_inproc("--input", ckpt, "--output", tmp_path / "out", "--hf-config", config) == 1
    assert "__3_0.distcp, which is missing" in capsys.readouterr().err

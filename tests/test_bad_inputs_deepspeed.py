"""Broken or unusual DeepSpeed saves: each gives one clear line, exit 1, no index, and leaves the input as it was.

Each case damages a private copy of a real DeepSpeed save (tests/fixtures/make_deepspeed.py)."""

from __future__ import annotations

import os
import pickle
import shutil
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import assert_refused, merge_inproc

TAG = "global_step2"


def optim(ckpt: Path, rank: int) -> Path:
    return ckpt / TAG / f"bf16_zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"


def missing_rank(ckpt: Path, _: Path) -> list[str]:
    optim(ckpt, 1).unlink()
    return []


def file_of_a_smaller_run(ckpt: Path, others: Path) -> list[str]:
    """Rank 2's optimizer file replaced by rank 0's of a run with 2 data-parallel ranks (the same model)."""
    shutil.copy(optim(others / "ds_z1_bf16_w2", 0), optim(ckpt, 2))
    return []


def no_optimizer_files(ckpt: Path, _: Path) -> list[str]:
    for rank in range(3):
        optim(ckpt, rank).unlink()
    return []


def expert_parallel_files(ckpt: Path, _: Path) -> list[str]:
    (ckpt / TAG / "expp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"")
    return []


def unknown_tag(ckpt: Path, _: Path) -> list[str]:
    return ["--tag", "global_step7"]


def no_latest(ckpt: Path, _: Path) -> list[str]:
    (ckpt / "latest").unlink()
    return []


class RunsCode:
    def __reduce__(self):
        return (os.system, ("touch distmerge-was-here",))


def code_in_pickle(ckpt: Path, _: Path) -> list[str]:
    with zipfile.ZipFile(optim(ckpt, 1), "w", zipfile.ZIP_STORED) as archive:
        archive.writestr("archive/data.pkl", pickle.dumps({"optimizer_state_dict": RunsCode()}, protocol=2))
    return []


CASES: dict[str, tuple[Callable, str]] = {
    "optimizer file of a rank missing": (missing_rank, "optimizer files of data-parallel ranks [1] are missing"),
    "optimizer file of another run": (file_of_a_smaller_run, "was saved by 2 data-parallel ranks, this save has 3"),
    "masters asked, no optimizer files": (no_optimizer_files, "pass --weights module"),
    "DeepSpeed-MoE expert files": (expert_parallel_files, "expert-parallel files (expp_rank_*): not supported"),
    "a tag that is not there": (unknown_tag, "has no save 'global_step7' (tags found: global_step2)"),
    "no latest file": (no_latest, "has no `latest` file: pass --tag (tags found: global_step2)"),
    "pickle that runs code": (code_in_pickle, "global posix.system is not allowed"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_deepspeed_input(case, ds_ckpts, tmp_path, monkeypatch, capsys):
    damage, words = CASES[case]
    ckpt = Path(shutil.copytree(ds_ckpts["ds_z2_odd_w3"], tmp_path / "ckpt"))
    extra = damage(ckpt, ds_ckpts["ds_z2_odd_w3"].parent)
    monkeypatch.chdir(tmp_path)
    assert_refused(ckpt, tmp_path / "out", words, capsys, *extra)
    assert not (tmp_path / "distmerge-was-here").exists()


def test_zero3_has_no_module_weights(ds_ckpts, tmp_path, capsys):
    assert merge_inproc("--input", ds_ckpts["ds_z3_fp32_w2"], "--output", tmp_path, "--weights", "module") == 1
    assert "a ZeRO-3 save keeps no whole module weights" in capsys.readouterr().err


def test_trainer_output_folder_names_a_checkpoint(ds_ckpts, tmp_path, capsys):
    assert merge_inproc("--input", ds_ckpts["ds_trainer_z2_w2"].parent / "ds_trainer_z2_w2", "--output",
                        tmp_path) == 1
    assert "holds Hugging Face Trainer checkpoints: pass one of them" in capsys.readouterr().err


def test_a_deepspeed_option_on_another_format(fsdp_ckpts, tmp_path, capsys):
    assert merge_inproc("--input", fsdp_ckpts["fsdp2_llama_w2"], "--output", tmp_path, "--tag", "x") == 1
    assert "--tag applies to deepspeed input" in capsys.readouterr().err

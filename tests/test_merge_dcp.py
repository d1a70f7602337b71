"""End to end on real torch.distributed.checkpoint folders saved by FSDP2 jobs (dcp.save, and PyTorch's
HuggingFaceStorageWriter in distributed mode): exact tensors, from_pretrained logits, N-independence."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.conftest import (
    assert_exact,
    assert_reference_logits,
    expected_tensors,
    load_merged,
    merge_each,
    merge_inproc,
    torchrun,
    tree_bytes,
)

CASES = [
    "dcp_llama_w2",
    "dcp_llama_wrapped_w4",
    "dcp_qwen2_tied_hsdp_2x2",
    "dcp_llama_bf16_w4",
    "dcp_llama_buffers_w2",
    "dcp_llama_hfwriter_w4",
]


@pytest.fixture(scope="module")
def dcp_merged(dcp_ckpts, tmp_path_factory) -> dict[str, Path]:
    return merge_each(dcp_ckpts, CASES, tmp_path_factory.mktemp("dcp_merged"))


@pytest.mark.parametrize("case", CASES)
def test_dcp_merged_equals_reference(case, dcp_ckpts, dcp_merged):
    assert_exact(load_merged(dcp_merged[case]), expected_tensors(dcp_ckpts[case]))


@pytest.mark.parametrize("case", ["dcp_llama_wrapped_w4", "dcp_qwen2_tied_hsdp_2x2", "dcp_llama_hfwriter_w4"])
def test_dcp_from_pretrained_gives_reference_logits(case, dcp_ckpts, dcp_merged):
    assert_reference_logits(dcp_merged[case], dcp_ckpts[case])


def test_integer_and_bool_buffers_survive_a_cast(dcp_ckpts, tmp_path):
    ckpt = dcp_ckpts["dcp_llama_buffers_w2"]
    assert merge_inproc("--input", ckpt, "--output", tmp_path / "out", "--dtype", "bf16") == 0
    merged = load_merged(tmp_path / "out")
    ints = {k: v for k, v in expected_tensors(ckpt).items() if not v.is_floating_point()}
    assert {v.dtype for v in ints.values()} == {torch.int64, torch.bool}
    for key, ref in ints.items():
        assert merged[key].dtype == ref.dtype and torch.equal(merged[key], ref), key
    assert all(v.dtype == torch.bfloat16 for v in merged.values() if v.is_floating_point())


def test_wrapped_checkpoint_skips_optimizer_and_says_so(dcp_ckpts, tmp_path):
    summary = tmp_path / "s.json"
    assert merge_inproc("--input", dcp_ckpts["dcp_llama_wrapped_w4"], "--output", tmp_path / "o",
                        "--json-summary", summary) == 0
    data = json.loads(summary.read_text())
    assert data["format"] == "dcp"
    assert any("not model weights" in note for note in data["notes"])


@pytest.mark.torchrun
@pytest.mark.parametrize("case", ["dcp_llama_wrapped_w4", "dcp_llama_hfwriter_w4"])
def test_dcp_torchrun_byte_identical(case, dcp_ckpts, tmp_path):
    args = ["--input", dcp_ckpts[case], "--max-shard-size", "60KB"]
    assert merge_inproc(*args, "--output", tmp_path / "n1") == 0
    run = torchrun(2, "merge", *args, "--quiet", "--output", tmp_path / "n2")
    assert run.returncode == 0, run.stderr[-3000:]
    assert tree_bytes(tmp_path / "n1") == tree_bytes(tmp_path / "n2")


def test_missing_distcp_file_is_named(dcp_ckpts, tmp_path, capsys):
    ckpt = Path(shutil.copytree(dcp_ckpts["dcp_llama_w2"], tmp_path / "ckpt"))
    (ckpt / "__1_0.distcp").unlink()
    assert merge_inproc("--input", ckpt, "--output", tmp_path / "out") == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "__1_0.distcp, which is missing" in err[0]

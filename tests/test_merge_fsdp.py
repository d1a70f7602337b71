"""End to end on real FSDP checkpoints: every merged tensor equals the full state dict gathered in the
saving job (torch.equal), the model loads with from_pretrained and gives the reference logits, and the
output bytes do not depend on how many processes merged it."""

from __future__ import annotations

import json

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
    "fsdp2_llama_w1",
    "fsdp2_llama_w2",
    "fsdp2_llama_w4",
    "fsdp2_qwen2_tied_w4",
    "fsdp2_llama_hsdp_2x2",
    "fsdp2_llama_shard1_w4",
    "fsdp2_llama_bf16_w4",
    "fsdp1_llama_nomesh_w4",
    "fsdp1_llama_mesh_w4",
]


@pytest.fixture(scope="module")
def merged_n1(fsdp_ckpts, tmp_path_factory) -> dict:
    """Every case merged once by one process; later tests compare against these."""
    return merge_each(fsdp_ckpts, CASES, tmp_path_factory.mktemp("merged_n1"))


@pytest.mark.parametrize("case", CASES)
def test_merged_equals_reference(case, fsdp_ckpts, merged_n1):
    assert_exact(load_merged(merged_n1[case]), expected_tensors(fsdp_ckpts[case]))


@pytest.mark.parametrize("case", ["fsdp2_llama_w4", "fsdp2_qwen2_tied_w4", "fsdp2_llama_bf16_w4"])
def test_from_pretrained_gives_reference_logits(case, merged_n1, fsdp_ckpts):
    assert_reference_logits(merged_n1[case], fsdp_ckpts[case])


def test_tied_head_not_written_and_config_kept(merged_n1, fsdp_ckpts):
    out = merged_n1["fsdp2_qwen2_tied_w4"]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert "lm_head.weight" not in index["weight_map"]
    assert "model.embed_tokens.weight" in index["weight_map"]
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is True
    for name in ("generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (out / name).is_file(), name


def test_index_counts_bytes(merged_n1):
    out = merged_n1["fsdp2_llama_w4"]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    total = sum(t.numel() * t.element_size() for t in load_merged(out).values())
    assert index["metadata"]["total_size"] == total


def test_dtype_cast_to_bf16(fsdp_ckpts, tmp_path):
    ckpt = fsdp_ckpts["fsdp2_llama_w2"]
    assert merge_inproc("--input", ckpt, "--output", tmp_path / "bf16", "--dtype", "bf16") == 0
    expected = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in expected_tensors(ckpt).items()}
    assert_exact(load_merged(tmp_path / "bf16"), expected)
    config = json.loads((tmp_path / "bf16" / "config.json").read_text())
    assert "bfloat16" in {config.get("dtype"), config.get("torch_dtype")}


@pytest.mark.torchrun
@pytest.mark.parametrize(("case", "nproc"), [("fsdp2_llama_w4", 2), ("fsdp2_llama_w4", 3), ("fsdp2_qwen2_tied_w4", 2),
                                             ("fsdp2_llama_w1", 2)])
def test_torchrun_output_is_byte_identical(case, nproc, fsdp_ckpts, tmp_path):
    """N processes, several output files: the same bytes as one process writing them all."""
    args = ["--input", fsdp_ckpts[case], "--max-shard-size", "60KB", "--quiet"]
    assert merge_inproc(*args[:-1], "--output", tmp_path / "n1") == 0
    run = torchrun(nproc, "merge", *args, "--output", tmp_path / "nN", "--json-summary", tmp_path / "s.json")
    assert run.returncode == 0, run.stderr[-3000:]
    one, many = tree_bytes(tmp_path / "n1"), tree_bytes(tmp_path / "nN")
    assert len([n for n in one if n.endswith(".safetensors")]) > 2
    assert one == many
    summary = json.loads((tmp_path / "s.json").read_text())
    assert [r["rank"] for r in summary["ranks"]] == list(range(nproc))
    assert sum(r["bytes_read"] for r in summary["ranks"]) == summary["total_bytes"]  # each byte read once


def test_inspect_reports_layout(fsdp_ckpts, capsys):
    from distmerge.front.cli import main

    assert main(["inspect", str(fsdp_ckpts["fsdp2_llama_hsdp_2x2"]), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["format"] == "fsdp" and info["world_size"] == 4
    assert any("ddp=2, fsdp=2" in k for k in info["sharding"])
    assert info["tensors"] == len(expected_tensors(fsdp_ckpts["fsdp2_llama_hsdp_2x2"]))

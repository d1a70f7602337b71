"""`distmerge verify --merged CHECKPOINT --reference CHECKPOINT`: one model saved under two distributed strategies
(an FSDP2 save, a DCP save and Megatron TP=2 x PP=2 saves of the same weights: tests/fixtures/make_twins.py), both
merged in memory and compared, nothing written. Bit-exact with one process and with a 2-process torchrun job; a
Megatron save whose fused QKV rows were interleaved wrongly fails naming that layer's q, k and v; names and shapes
on one side only are reported as verify reports them for a folder."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import REPO, input_untouched, reference_dir, torchrun
from tests.helpers.verify_checkpoint import nothing_written, one_error, settled, verdict, verify
from tests.hostile_pickles import records_of, write_zip

# pair: (--merged: fixture family and case, --reference: fixture family and case)
PAIRS = {
    "fsdp2_vs_megatron_tp2pp2": (("twin_ckpts", "fsdp2_from_megatron_w2"), ("megatron_ckpts", "megatron_tp2pp2")),
    "dcp_vs_megatron_dist_tp2pp2": (("twin_ckpts", "dcp_from_megatron_w2"),
                                    ("megatron_ckpts", "megatron_dist_tp2pp2")),
    "fsdp2_vs_dcp": (("twin_ckpts", "fsdp2_from_megatron_w2"), ("twin_ckpts", "dcp_from_megatron_w2")),
    "megatron_legacy_vs_dist": (("megatron_ckpts", "megatron_tp2pp2"), ("megatron_ckpts", "megatron_dist_tp2")),
    # tied embeddings on both sides: neither plan writes lm_head
    "megatron_qwen2_tied_legacy_vs_dist": (("megatron_ckpts", "megatron_qwen2_tp2"),
                                           ("megatron_ckpts", "megatron_dist_qwen2_tp2pp2")),
}
TENSORS = {"megatron_qwen2_tied_legacy_vs_dist": 26}
QKV = [f"model.layers.0.self_attn.{x}_proj.weight" for x in "kqv"]  # in the report's (natural name) order


def config_args(ckpt: Path, flag: str) -> list[str]:
    """A Megatron save keeps no config.json: its fixture's reference folder has it."""
    return [] if (ckpt / "huggingface").is_dir() else [flag, str(reference_dir(ckpt) / "huggingface")]


def sides(request, pair: str) -> tuple[Path, Path]:
    (fam_a, case_a), (fam_b, case_b) = PAIRS[pair]
    return request.getfixturevalue(fam_a)[case_a], request.getfixturevalue(fam_b)[case_b]


def pair_args(merged: Path, reference: Path) -> list[str]:
    return ["--merged", str(merged), *config_args(merged, "--hf-config"), "--reference", str(reference),
            *config_args(reference, "--reference-hf-config")]


@pytest.mark.parametrize("pair", PAIRS)
def test_one_model_two_strategies_bit_exact_writing_nothing(pair, request, tmp_path, monkeypatch, capsys):
    merged, reference = sides(request, pair)
    monkeypatch.chdir(tmp_path)  # where a stray relative write would land
    beside = sorted(os.listdir(reference.parent))
    with nothing_written(merged), input_untouched(reference, reference_dir(reference)):
        assert verify(*pair_args(merged, reference), "--json", tmp_path / "r.json") == 0
    assert sorted(os.listdir(reference.parent)) == beside and os.listdir(tmp_path) == ["r.json"]
    out = capsys.readouterr().out
    assert out.splitlines()[-1] == f"verify: PASS {TENSORS.get(pair, 21)} tensors bit-exact", out
    assert "reference checkpoint merged in memory, nothing written" in out
    run = json.loads((tmp_path / "r.json").read_text())["run"]
    assert run["checkpoint"]["format"] != run["reference_checkpoint"]["format"] or pair.startswith("fsdp2_vs")


def test_budget_of_one_byte_and_dtype_on_both_sides(twin_ckpts, megatron_ckpts, capsys):
    """Every component its own round; --dtype bf16 casts both sides, so no cast is left to report."""
    args = pair_args(twin_ckpts["fsdp2_from_megatron_w2"], megatron_ckpts["megatron_tp2pp2"])
    assert verify(*args, "--budget", "1") == 0
    assert verdict(capsys) == "verify: PASS 21 tensors bit-exact"
    assert verify(*args, "--dtype", "bf16") == 0
    assert verdict(capsys) == "verify: PASS 21 tensors bit-exact"


def misinterleaved(ckpt: Path, dst: Path) -> Path:
    """A copy of the Megatron TP=2 x PP=2 save whose layer 0 linear_qkv on TP rank 0 (query group 0: rows of
    q heads 0 and 1, then k head 0, then v head 0, 16 rows each) has its heads in the wrong slots: k, q1, v, q0
    (torch.save's zip rewritten with the record's bytes changed)."""
    shutil.copytree(ckpt, dst)
    ref = load_file(reference_dir(ckpt) / "model.safetensors")
    q, k, v = (ref[f"model.layers.0.self_attn.{x}_proj.weight"][:rows] for x, rows in (("q", 32), ("k", 16), ("v", 16)))
    path = dst / "iter_0000001" / "mp_rank_00_000" / "model_optim_rng.pt"
    records = records_of(path)
    [record] = [r for r in records if r.data == torch.cat([q, k, v]).numpy().tobytes()]
    record.data = torch.cat([k, q[16:], v, q[:16]]).numpy().tobytes()
    write_zip(path, records)
    return dst


def test_wrongly_interleaved_qkv_fails_naming_q_k_v(twin_ckpts, megatron_ckpts, tmp_path, capsys):
    bad = misinterleaved(megatron_ckpts["megatron_tp2pp2"], tmp_path / "megatron_tp2pp2")
    fsdp = twin_ckpts["fsdp2_from_megatron_w2"]
    args = ["--merged", fsdp, "--reference", bad, "--reference-hf-config",
            reference_dir(megatron_ckpts["megatron_tp2pp2"]) / "huggingface"]
    assert verify(*args, "--json", tmp_path / "r.json") == 1
    line = verdict(capsys)
    assert line.startswith("verify: FAIL 3 of 21 tensors: "), line
    failed = [t["name"] for t in json.loads((tmp_path / "r.json").read_text())["tensors"] if not t["passed"]]
    assert failed == QKV
    for name in QKV:
        assert f"{name} (values differ: max abs" in line, line


def test_names_and_shapes_on_one_side_only_are_reported(twin_ckpts, megatron_ckpts, capsys, tmp_path):
    """make_twins.py's edited FSDP save: up_proj of layer 1 left out, an extra_proj added, gate_proj of layer 0
    transposed; settled from the two plans, never assembled."""
    args = pair_args(twin_ckpts["fsdp2_from_megatron_edited_w2"], megatron_ckpts["megatron_tp2pp2"])
    assert verify(*args, "--json", tmp_path / "r.json") == 1
    assert verdict(capsys) == (
        "verify: FAIL 3 of 22 tensors: model.layers.0.mlp.gate_proj.weight (shape [64, 128], reference [128, 64] "
        "(transposed)), model.layers.1.mlp.extra_proj.weight (extra in merged), model.layers.1.mlp.up_proj.weight "
        "(missing in merged)")
    rep = json.loads((tmp_path / "r.json").read_text())
    assert sum(rep["run"]["compared_per_rank"]) == 19 and rep["counts"]["bit_exact"] == 19


def test_refusals(twin_ckpts, megatron_ckpts, tmp_path, capsys):
    fsdp, megatron = twin_ckpts["fsdp2_from_megatron_w2"], megatron_ckpts["megatron_tp2pp2"]
    ref = reference_dir(fsdp)
    assert verify("--merged", fsdp, "--reference", ref, "--reference-hf-config", ref / "huggingface") == 1
    assert f"--reference {ref} is a finished model; --reference-hf-config: options of the merge" in one_error(capsys)
    assert verify("--merged", fsdp, "--reference", megatron) == 1  # a Megatron save brings no config.json
    assert "has no huggingface/ folder; pass --reference-hf-config DIR" in one_error(capsys)


@pytest.mark.torchrun
@pytest.mark.parametrize("pair", ["fsdp2_vs_megatron_tp2pp2", "dcp_vs_megatron_dist_tp2pp2"])
def test_two_processes_agree_with_one(pair, request, tmp_path):
    merged, reference = sides(request, pair)
    args = [*pair_args(merged, reference), "--device", "cpu", "--budget", "100KB"]
    assert verify(*args, "--json", tmp_path / "one.json") == 0
    repo = (sorted(os.listdir(REPO)), os.stat(REPO).st_mtime_ns)  # torchrun's working directory
    with nothing_written(merged), input_untouched(reference):
        run = torchrun(2, "verify", *args, "--json", tmp_path / "two.json")
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    assert (sorted(os.listdir(REPO)), os.stat(REPO).st_mtime_ns) == repo
    one, two = (settled(json.loads((tmp_path / f"{n}.json").read_text())) for n in ("one", "two"))
    assert two["run"]["processes"] == 2 and all(n > 0 for n in two["run"]["compared_per_rank"])
    assert sum(two["run"]["compared_per_rank"]) == 21
    one.pop("run"), two.pop("run")
    assert one == two
    assert run.stdout.count("verify: PASS 21 tensors bit-exact") == 1  # rank 0 speaks for all


@pytest.mark.torchrun
def test_two_processes_name_the_misinterleaved_layer(twin_ckpts, megatron_ckpts, tmp_path):
    bad = misinterleaved(megatron_ckpts["megatron_tp2pp2"], tmp_path / "megatron_tp2pp2")
    run = torchrun(2, "verify", "--merged", twin_ckpts["fsdp2_from_megatron_w2"], "--reference", bad,
                   "--reference-hf-config", reference_dir(megatron_ckpts["megatron_tp2pp2"]) / "huggingface",
                   "--device", "cpu", real=True)
    assert run.returncode != 0
    lines = [line for line in run.stdout.splitlines() if line.startswith("verify:")]
    assert len(lines) == 1 and lines[0].startswith("verify: FAIL 3 of 21 tensors: "), run.stdout
    assert all(f"{name} (values differ" in lines[0] for name in QKV), lines[0]


@pytest.mark.torchrun
def test_an_error_on_rank_1_in_a_later_round_is_raised_by_every_rank(twin_ckpts, megatron_ckpts, tmp_path):
    """Both sides' exchanges of the next round are in flight when rank 1 fails in round 2 (the engine's test hook):
    every rank raises the same line and the job ends (the in-flight exchanges of both sides are drained)."""
    logs = tmp_path / "logs"
    args = pair_args(twin_ckpts["fsdp2_from_megatron_w2"], megatron_ckpts["megatron_tp2pp2"])
    run = torchrun(2, "verify", *args, "--device", "cpu", "--budget", "16KiB", launcher=("--log-dir", str(logs)),
                   env={"DISTMERGE_TEST_FAIL_AT": "1:2"})
    assert run.returncode != 0
    raised = {int(p.parent.name): json.loads(p.read_text())["message"] for p in logs.glob("*/attempt_0/*/error.json")}
    line = "distmerge: error: test fault (DISTMERGE_TEST_FAIL_AT) on rank 1 in round 2"
    assert raised == {0: line, 1: line}, raised

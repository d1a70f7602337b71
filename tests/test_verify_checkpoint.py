"""`distmerge verify --merged CHECKPOINT`: real checkpoints of every format merged in memory and compared with the
reference their saving job wrote. Nothing is written (no output folder, no temporary file, the inputs untouched);
the records are those `verify` of the merged folder gives; one process and a 2-process torchrun job agree; one
changed element is named; --dtype and the Python entry point work as in merge."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.conftest import REPO, merge_inproc, reference_dir, torchrun
from tests.helpers.verify_checkpoint import bumped_reference, nothing_written, one_error, settled, verdict, verify

SHARD = "300KB"  # the llama fixture in 3 planned files: file names in the records, work for two ranks

# case: (fixture family, reference inside its reference folder or "" for the folder, extra options, tensors)
CASES = {
    "fsdp2_llama_w4": ("fsdp_ckpts", "", (), 21),
    "fsdp2_llama_hsdp_2x2": ("fsdp_ckpts", "", (), 21),
    "fsdp2_qwen2_tied_w4": ("fsdp_ckpts", "", (), 27),  # the reference's lm_head against the merged embedding
    "dcp_llama_w2": ("dcp_ckpts", "", (), 21),
    "megatron_tp2pp2": ("megatron_ckpts", "", ("--hf-config", "{ref}/huggingface"), 21),
    "ds_z3_fp32_w2": ("ds_ckpts", "", (), 21),
    "tt_llama3_gqa_tied_w3": ("tt_ckpts", "hf_state.safetensors", (), 20),
    "critic_fsdp2_qwen2": ("critic_ckpts", "", (), 28),
}


def case_args(request, case: str) -> tuple[Path, list[str]]:
    """The checkpoint, and verify's arguments for it: --merged, --reference and the case's own options."""
    family, ref_name, extra, _ = CASES[case]
    ckpt = request.getfixturevalue(family)[case]
    ref = reference_dir(ckpt)
    return ckpt, ["--merged", str(ckpt), "--reference", str(ref / ref_name if ref_name else ref),
                  *(a.format(ref=ref) for a in extra)]


@pytest.mark.parametrize("case", CASES)
def test_checkpoint_passes_bit_exact_writing_nothing(case, request, tmp_path, monkeypatch, capsys):
    ckpt, args = case_args(request, case)
    monkeypatch.chdir(tmp_path)  # where a stray relative write would land
    with nothing_written(ckpt, tmp_path):
        assert verify(*args) == 0
    line = verdict(capsys)
    tensors = CASES[case][3]
    assert line.startswith(f"verify: PASS {tensors} tensors"), line
    assert line.endswith("bit-exact") or "bit-exact" in line and "values" not in line, line


def test_the_records_are_those_of_the_merged_folder(fsdp_ckpts, tmp_path, capsys):
    """Every figure, outcome, note and planned file name equal; only `run` says how verify ran."""
    ckpt = fsdp_ckpts["fsdp2_qwen2_tied_w4"]
    ref = reference_dir(ckpt)
    assert merge_inproc("--input", ckpt, "--output", tmp_path / "merged", "--max-shard-size", SHARD) == 0
    assert verify("--merged", tmp_path / "merged", "--reference", ref, "--json", tmp_path / "folder.json") == 0
    assert verify("--merged", ckpt, "--reference", ref, "--max-shard-size", SHARD, "--json", tmp_path / "c.json") == 0
    folder, memory = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("folder", "c"))
    assert memory["run"]["checkpoint"]["format"] == "fsdp" and "checkpoint" not in folder["run"]
    assert len({t["file"] for t in memory["tensors"]}) == 2
    for key in ("verdict", "summary", "criteria", "counts", "tensors", "logits"):
        assert memory[key] == folder[key], key


@pytest.mark.parametrize("case", ["fsdp2_llama_w4", "megatron_tp2pp2"])
def test_one_changed_element_fails_and_is_named(case, request, tmp_path, capsys):
    ckpt, args = case_args(request, case)
    name = "model.layers.1.mlp.down_proj.weight"
    bad = bumped_reference(reference_dir(ckpt), tmp_path / "bad", name)
    args[args.index("--reference") + 1] = str(bad)
    assert verify(*args, "--json", tmp_path / "r.json") == 1
    line = verdict(capsys)
    assert line.startswith(f"verify: FAIL 1 of 21 tensors: {name} (values differ: max abs 0.01"), line
    failed = [t for t in json.loads((tmp_path / "r.json").read_text())["tensors"] if not t["passed"]]
    assert [t["name"] for t in failed] == [name] and failed[0]["figures"]["outside"] == 1


def test_names_and_shapes_are_settled_from_the_plan(fsdp_ckpts, tmp_path, capsys):
    """Missing, extra and transposed: decided from the plan's targets and the reference's headers, worded as
    verify of a merged folder words them; those tensors are never assembled."""
    ckpt = fsdp_ckpts["fsdp2_llama_w4"]
    state = load_file(reference_dir(ckpt) / "model.safetensors")
    state.pop("model.layers.1.mlp.up_proj.weight")
    state["model.extra.bias"] = torch.zeros(3)
    state["model.layers.0.mlp.gate_proj.weight"] = state["model.layers.0.mlp.gate_proj.weight"].T.contiguous()
    save_file(state, tmp_path / "ref.safetensors")
    assert verify("--merged", ckpt, "--reference", tmp_path / "ref.safetensors", "--json", tmp_path / "r.json") == 1
    assert verdict(capsys) == (
        "verify: FAIL 3 of 22 tensors: model.extra.bias (missing in merged), model.layers.0.mlp.gate_proj.weight "
        "(shape [138, 64], reference [64, 138] (transposed)), model.layers.1.mlp.up_proj.weight (extra in merged)")
    rep = json.loads((tmp_path / "r.json").read_text())
    assert sum(rep["run"]["compared_per_rank"]) == 19 and rep["counts"]["bit_exact"] == 19


def test_dtype_bf16_against_a_bf16_reference(fsdp_ckpts, tmp_path, capsys):
    ckpt = fsdp_ckpts["fsdp2_llama_w4"]
    state = load_file(reference_dir(ckpt) / "model.safetensors")
    assert {v.dtype for v in state.values()} == {torch.float32}  # so the bf16 reference is a cast
    state = {k: v.bfloat16() for k, v in state.items()}
    save_file(state, tmp_path / "bf16.safetensors")
    assert verify("--merged", ckpt, "--reference", tmp_path / "bf16.safetensors", "--dtype", "bf16") == 0
    assert verdict(capsys) == "verify: PASS 21 tensors bit-exact"
    # against the fp32 reference the cast was asked for, as with merge --dtype bf16 --verify-against
    assert verify("--merged", ckpt, "--reference", reference_dir(ckpt), "--dtype", "bf16") == 0
    assert verdict(capsys) == ("verify: PASS 21 tensors (21 bit-exact, 21 compared after casting the reference "
                               "F32->BF16)")


def test_lora_run_fused_and_as_base_plus_adapter(fsdp_ckpts, capsys):
    ckpt = fsdp_ckpts["fsdp2_llama_lora_w2"]
    ref = reference_dir(ckpt)
    assert verify("--merged", ckpt, "--reference", ref / "merged.safetensors", "--lora", "merge") == 0
    assert verdict(capsys) == "verify: PASS 21 tensors bit-exact"
    assert verify("--merged", ckpt, "--reference", ref / "base.safetensors") == 0  # the model files: the base
    assert verdict(capsys) == "verify: PASS 21 tensors bit-exact"


def test_a_budget_of_one_byte_still_passes(megatron_ckpts, capsys):
    """Each unit its own round: the rounds, the exchange and the comparison at their finest."""
    ckpt = megatron_ckpts["megatron_tp2pp2"]
    ref = reference_dir(ckpt)
    assert verify("--merged", ckpt, "--reference", ref, "--hf-config", ref / "huggingface", "--budget", "1") == 0
    assert verdict(capsys) == "verify: PASS 21 tensors bit-exact"


def test_python_entry_point(megatron_ckpts, tmp_path):
    """What another command (a verl-style `test`) calls: VerifyOptions with merge's options, inside a group."""
    from distmerge.distributed.comm import process_group
    from distmerge.engine.inputs import InputSpec
    from distmerge.engine.prepare import OutputSettings
    from distmerge.verifier import VerifyOptions, verify_and_report
    from distmerge.verifier.run import verify as verify_api

    ckpt = megatron_ckpts["megatron_tp2pp2"]
    ref = reference_dir(ckpt)
    merged = InputSpec(locations=ckpt, format="megatron", hf_config=ref / "huggingface",
                       format_options={"iteration": "1"})
    opts = VerifyOptions(merged=merged, reference=ref, settings=OutputSettings(budget_bytes=2**20), quiet=True,
                         json=tmp_path / "r.json")
    with process_group(device="cpu", timeout_s=60) as comm:
        result = verify_api(opts, comm)
        assert result.passed and result.format == "megatron" and len(result.checks) == 21
        assert verify_and_report(opts, comm) == 0
    assert json.loads((tmp_path / "r.json").read_text())["counts"]["bit_exact"] == 21


def test_options_that_do_not_apply_are_refused(fsdp_ckpts, tmp_path, capsys):
    ckpt = fsdp_ckpts["fsdp2_llama_w4"]
    ref = reference_dir(ckpt)
    assert verify("--merged", ckpt, "--reference", ref, "--logits") == 1
    assert f"--logits runs both models, and --merged {ckpt} is a checkpoint" in one_error(capsys)
    assert merge_inproc("--input", ckpt, "--output", tmp_path / "m") == 0
    assert verify("--merged", tmp_path / "m", "--reference", ref, "--dtype", "bf16", "--budget", "1MiB") == 1
    assert "is a finished model; --dtype, --budget: options of the merge of a training checkpoint" in one_error(
        capsys)
    assert verify("--merged", tmp_path / "m", "--reference", ref, "--hf-config", ref) == 1
    assert f"--merged {tmp_path / 'm'} is a finished model; --hf-config: options of the merge" in one_error(capsys)


@pytest.mark.torchrun
@pytest.mark.parametrize("case", CASES)
def test_two_processes_agree_with_one(case, request, tmp_path):
    ckpt, args = case_args(request, case)
    args += ["--max-shard-size", SHARD, "--device", "cpu"]
    assert verify(*args, "--json", tmp_path / "one.json") == 0
    repo = (sorted(os.listdir(REPO)), os.stat(REPO).st_mtime_ns)  # torchrun's working directory
    with nothing_written(ckpt):
        run = torchrun(2, "verify", *args, "--json", tmp_path / "two.json")
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    assert (sorted(os.listdir(REPO)), os.stat(REPO).st_mtime_ns) == repo
    assert sorted(p.name for p in tmp_path.iterdir()) == ["one.json", "two.json"]
    one, two = (settled(json.loads((tmp_path / f"{n}.json").read_text())) for n in ("one", "two"))
    assert two["run"]["processes"] == 2 and all(n > 0 for n in two["run"]["compared_per_rank"])
    assert sum(two["run"]["compared_per_rank"]) == CASES[case][3] == one["counts"]["bit_exact"] + one["counts"][
        "tied_heads"]
    one.pop("run"), two.pop("run")
    assert one == two
    assert run.stdout.count(f"verify: PASS {CASES[case][3]} tensors") == 1  # rank 0 speaks for all


@pytest.mark.torchrun
def test_two_processes_name_a_changed_element(fsdp_ckpts, tmp_path):
    ckpt = fsdp_ckpts["fsdp2_llama_w4"]
    name = "model.embed_tokens.weight"
    bad = bumped_reference(reference_dir(ckpt), tmp_path / "bad", name)
    # a small budget: many rounds, each packed into the send buffer the round before went out from (exchange.py,
    # send_sets=1): a round packed over one still in flight would change the other tensors' bytes too
    run = torchrun(2, "verify", "--merged", ckpt, "--reference", bad, "--device", "cpu", "--budget", "64KiB",
                   real=True)
    assert run.returncode != 0
    lines = [line for line in run.stdout.splitlines() if line.startswith("verify:")]
    assert lines == [f"verify: FAIL 1 of 21 tensors: {name} (values differ: max abs 0.01)"], run.stdout


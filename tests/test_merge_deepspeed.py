"""End to end on real DeepSpeed ZeRO saves (tests/fixtures/make_deepspeed.py: deepspeed.initialize and the HF
Trainer on CPU/gloo, real optimizer steps, engine.save_checkpoint): every merged tensor equals the fp32 master
weights gathered from the live optimizer in the saving job, `--dtype bf16` equals the 16-bit module weights,
`from_pretrained` gives the trained logits, and 1, 2, 3 processes write the same bytes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.conftest import load_merged, merge_each, merge_inproc, torchrun, tree_bytes
from tests.fixtures.deepspeed_cases import DS_CASES
from tests.helpers.deepspeed import assert_same, reference

STAGE0 = [c for c, case in DS_CASES.items() if case.stage == 0]
LORA = [c for c, case in DS_CASES.items() if case.lora]
# OpenRLHF's save needs --hf-config: tests/test_merge_openrlhf.py
MASTERS = [c for c, case in DS_CASES.items() if c not in STAGE0 + LORA and case.driver != "openrlhf"]


def input_dir(ckpt: Path) -> Path:
    """The folder a user passes: the HF Trainer's checkpoint-N, else the folder holding `latest`."""
    return next(ckpt.glob("checkpoint-*"), ckpt)


@pytest.fixture(scope="module")
def ds_merged(ds_ckpts, tmp_path_factory) -> dict[str, Path]:
    inputs = {c: input_dir(ds_ckpts[c]) for c in MASTERS + STAGE0}
    return merge_each(inputs, MASTERS + STAGE0, tmp_path_factory.mktemp("ds_merged"))


@pytest.mark.parametrize("case", MASTERS)
def test_merged_equals_the_fp32_masters(case, ds_ckpts, ds_merged):
    assert_same(load_merged(ds_merged[case]), reference(ds_ckpts[case], "masters.safetensors"))
    config = json.loads((ds_merged[case] / "config.json").read_text())
    assert config.get("dtype", config.get("torch_dtype")) == "float32"


@pytest.mark.parametrize("case", STAGE0)
def test_stage0_merges_the_module(case, ds_ckpts, ds_merged):
    """Stage 0 keeps its fp32 copies in the optimizer without parameter names: the module is the model."""
    assert_same(load_merged(ds_merged[case]), reference(ds_ckpts[case], "module.safetensors"))


@pytest.mark.parametrize("case", ["ds_z2_odd_w3", "ds_z1_bf16opt_w3", "ds_z3_subgroups_w4", "ds_trainer_z2_w2"])
def test_bf16_cast_equals_the_module_weights(case, ds_ckpts, tmp_path):
    assert merge_inproc("--input", input_dir(ds_ckpts[case]), "--output", tmp_path, "--dtype", "bf16") == 0
    assert_same(load_merged(tmp_path), reference(ds_ckpts[case], "module.safetensors"))


@pytest.mark.parametrize("case", ["ds_z2_frozen_w4", "ds_z1_frozen_w4", "ds_z2_qwen2_tied_w4"])
def test_module_weights_on_request(case, ds_ckpts, tmp_path):
    assert merge_inproc("--input", input_dir(ds_ckpts[case]), "--output", tmp_path, "--weights", "module") == 0
    assert_same(load_merged(tmp_path), reference(ds_ckpts[case], "module.safetensors"))


@pytest.mark.parametrize("case", ["ds_z2_qwen2_tied_w4", "ds_z3_subgroups_w4", "ds_trainer_z3_qwen2_w2"])
def test_from_pretrained_gives_the_trained_logits(case, ds_ckpts, ds_merged):
    from transformers import AutoModelForCausalLM

    ref = torch.load(ds_ckpts[case].parent / f"{case}_reference" / "logits.pt", weights_only=True)
    model = AutoModelForCausalLM.from_pretrained(ds_merged[case]).eval()
    with torch.no_grad():
        logits = model(ref["input_ids"]).logits.float()
    torch.testing.assert_close(logits, ref["logits"].float(), rtol=0, atol=1e-5)


def test_trainer_checkpoint_keeps_only_the_model_files(ds_merged):
    out = ds_merged["ds_trainer_z2_w2"]
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "generation_config.json"} <= names
    assert not names & {"latest", "zero_to_fp32.py", "zero_to_torch.py", "trainer_state.json", "training_args.bin"}


@pytest.mark.torchrun
@pytest.mark.parametrize("case", ["ds_z2_round_robin_w3", "ds_z3_subgroups_w4"])
def test_any_number_of_processes_writes_the_same_bytes(case, ds_ckpts, ds_merged, tmp_path):
    for n in (2, 3):
        out = tmp_path / f"n{n}"
        run = torchrun(n, "merge", "--input", input_dir(ds_ckpts[case]), "--output", out, "--quiet")
        assert run.returncode == 0, run.stderr[-2000:]
        assert tree_bytes(out) == tree_bytes(ds_merged[case])


def test_lora_only_save_says_what_it_is(ds_ckpts, tmp_path, capsys):
    """The HF Trainer saves a PEFT run without its frozen base weights (and without config.json): fusing needs
    the base, and the error names the option (the merges themselves: tests/test_lora_only.py)."""
    ckpt = ds_ckpts[LORA[0]]
    config = ckpt.parent / f"{ckpt.name}_reference"
    args = ("--input", input_dir(ckpt), "--output", tmp_path, "--hf-config", config, "--lora", "merge")
    assert merge_inproc(*args) == 1
    assert "holds LoRA weights only" in (err := capsys.readouterr().err) and "pass --base-model DIR" in err


def test_inspect_describes_the_save(ds_ckpts, capsys):
    from distmerge.front.cli import main

    assert main(["inspect", str(ds_ckpts["ds_z2_odd_w3"]), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["format"] == "deepspeed" and info["world_size"] == 3
    assert set(info["sharding"]) == {"ZeRO-1/2 fp32 partition"} and info["tensors"] == 21
    assert info["model_type"] == "llama"  # the fixture's config has no `architectures`: the table says llama
    assert main(["inspect", str(ds_ckpts["ds_z2_odd_w3"])]) == 0
    assert "│ model    │ llama, tied embeddings: False" in capsys.readouterr().out

"""OpenRLHF's DeepSpeed checkpoints: a real DeepSpeed engine saved the way OpenRLHF's DeepspeedStrategy.save_ckpt
saves its actor (`{ckpt_path}/_actor/latest` + `global_stepN/`, client state), its Hugging Face model apart (the
`--save_path` folder, passed as --hf-config). Fixture: `ds_openrlhf_z2_w2` in tests/fixtures/deepspeed_cases.py."""

from __future__ import annotations

import json

import torch

from tests.conftest import load_merged, merge_inproc, reference_dir
from tests.helpers.deepspeed import assert_same, reference

CASE = "ds_openrlhf_z2_w2"


def test_actor_folder_merges_to_the_fp32_masters_with_the_hf_config(ds_ckpts, tmp_path):
    from transformers import AutoModelForCausalLM

    ckpt = ds_ckpts[CASE]
    hf_model = reference_dir(ckpt) / "hf_model"
    assert merge_inproc("--input", ckpt / "_actor", "--output", tmp_path, "--hf-config", hf_model) == 0
    assert_same(load_merged(tmp_path), reference(ckpt, "masters.safetensors"))
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == "llama" and config.get("dtype", config.get("torch_dtype")) == "float32"
    assert (tmp_path / "tokenizer_config.json").exists()  # the tokenizer comes with the --hf-config folder
    ref = torch.load(reference_dir(ckpt) / "logits.pt", weights_only=True)
    model = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        torch.testing.assert_close(model(ref["input_ids"]).logits.float(), ref["logits"].float(), rtol=0, atol=1e-5)


def test_ckpt_path_above_the_actor_says_which_folder_to_pass(ds_ckpts, tmp_path, capsys):
    ckpt = ds_ckpts[CASE]
    hf_model = reference_dir(ckpt) / "hf_model"
    assert merge_inproc("--input", ckpt, "--output", tmp_path / "out", "--hf-config", hf_model) != 0
    err = capsys.readouterr().err
    assert "_actor" in err and err.count("distmerge: error:") == 1, err


def test_actor_folder_without_a_config_asks_for_hf_config(ds_ckpts, tmp_path, capsys):
    assert merge_inproc("--input", ds_ckpts[CASE] / "_actor", "--output", tmp_path / "out") != 0
    err = capsys.readouterr().err
    assert "--hf-config" in err and err.count("distmerge: error:") == 1, err
    assert not (tmp_path / "out" / "model.safetensors.index.json").exists()

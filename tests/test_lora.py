"""LoRA runs saved as verl saves them (a PEFT-wrapped tiny Llama, r=8, alpha=16 on q_proj/v_proj with
nonzero lora_B, sharded by real FSDP2 at W=2): the adapter loads with PEFT and gives the PEFT model's
logits; --lora merge equals merge_and_unload(); what cannot be handled is refused, never dropped."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from distmerge.errors import InputError
from distmerge.families.base import FamilyContext, SourceMeta
from distmerge.families.lora.family import LORA_FAMILY
from distmerge.formats.base import Hints
from tests.conftest import assert_exact, load_merged, merge_inproc, reference_dir

CASE = "fsdp2_llama_lora_w2"


def load_file(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(path, framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


@pytest.fixture(scope="module")
def adapter_out(fsdp_ckpts, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("lora") / "adapter"
    assert merge_inproc("--input", fsdp_ckpts[CASE], "--output", out) == 0
    return out


def test_adapter_mode_writes_the_base_model_and_a_peft_adapter(fsdp_ckpts, adapter_out):
    ref = reference_dir(fsdp_ckpts[CASE])
    assert_exact(load_merged(adapter_out), load_file(ref / "base.safetensors"))
    config = json.loads((adapter_out / "lora_adapter" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["peft_type"]) == (8, 16, "LORA")
    assert config["target_modules"] == ["q_proj", "v_proj"] and config["base_model_name_or_path"]
    full = load_file(ref / "model.safetensors")
    adapter = load_file(adapter_out / "lora_adapter" / "adapter_model.safetensors")
    expected = {k.replace(".default.", "."): v for k, v in full.items() if ".lora_" in k}
    assert_exact(adapter, expected)
    assert not any(".lora_" in k for k in json.loads((adapter_out / "model.safetensors.index.json").read_text())
                   ["weight_map"])


def test_adapter_loads_with_peft_and_gives_the_trained_logits(fsdp_ckpts, adapter_out):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    saved = torch.load(reference_dir(fsdp_ckpts[CASE]) / "logits.pt", weights_only=True)
    base = AutoModelForCausalLM.from_pretrained(adapter_out).eval()
    with torch.no_grad():
        base_logits = base(saved["input_ids"]).logits.float()
        model = PeftModel.from_pretrained(base, adapter_out / "lora_adapter").eval()
        logits = model(saved["input_ids"]).logits.float()
    torch.testing.assert_close(logits, saved["logits"], rtol=0, atol=1e-5)
    assert (base_logits - saved["logits"]).abs().max() > 1e-3  # the adapter really changes the model


def test_merge_mode_equals_merge_and_unload(fsdp_ckpts, tmp_path):
    from transformers import AutoModelForCausalLM

    ref = reference_dir(fsdp_ckpts[CASE])
    assert merge_inproc("--input", fsdp_ckpts[CASE], "--output", tmp_path / "fused", "--lora", "merge") == 0
    merged, expected = load_merged(tmp_path / "fused"), load_file(ref / "merged.safetensors")
    assert sorted(merged) == sorted(expected)
    for key, value in expected.items():
        torch.testing.assert_close(merged[key], value, rtol=0, atol=1e-6, msg=key)
    assert not (tmp_path / "fused" / "lora_adapter").exists()
    saved = torch.load(ref / "logits.pt", weights_only=True)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "fused").eval()
    with torch.no_grad():
        logits = model(saved["input_ids"]).logits.float()
    torch.testing.assert_close(logits, saved["merged_logits"], rtol=0, atol=1e-5)


def test_missing_meta_needs_lora_alpha(fsdp_ckpts, tmp_path, capsys):
    ckpt = Path(shutil.copytree(fsdp_ckpts[CASE], tmp_path / "ckpt"))
    (ckpt / "lora_train_meta.json").unlink()
    assert merge_inproc("--input", ckpt, "--output", tmp_path / "a") == 1
    assert "pass --lora-alpha" in capsys.readouterr().err
    assert merge_inproc("--input", ckpt, "--output", tmp_path / "b", "--lora-alpha", "16") == 0
    assert json.loads((tmp_path / "b" / "lora_adapter" / "adapter_config.json").read_text())["lora_alpha"] == 16


def test_zero_alpha_is_refused(fsdp_ckpts, tmp_path, capsys):
    ckpt = Path(shutil.copytree(fsdp_ckpts[CASE], tmp_path / "ckpt"))
    (ckpt / "lora_train_meta.json").write_text(json.dumps({"r": 8, "lora_alpha": 0, "task_type": "CAUSAL_LM"}))
    assert merge_inproc("--input", ckpt, "--output", tmp_path / "a") == 1
    assert "lora_alpha is 0" in capsys.readouterr().err


@pytest.mark.parametrize(("key", "words"), [
    ("base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector.default.weight", "DoRA"),
    ("base_model.model.model.embed_tokens.lora_embedding_A.default", "embedding"),
    ("base_model.model.lm_head.modules_to_save.default.weight", "modules_to_save"),
])
def test_unsupported_peft_variants_are_refused(key, words):
    """Key names as PEFT's LoraModel writes them (peft/tuners/lora/layer.py: lora_magnitude_vector,
    lora_embedding_A; peft/utils/other.py: ModulesToSaveWrapper's modules_to_save)."""
    q = "base_model.model.model.layers.0.self_attn.q_proj"
    sources = {n: SourceMeta(name=n, dtype="F32", shape=s) for n, s in [
        (f"{q}.base_layer.weight", (8, 8)), (f"{q}.lora_A.default.weight", (2, 8)),
        (f"{q}.lora_B.default.weight", (8, 2)), (key, (8,)),
    ]}
    with pytest.raises(InputError, match=words):
        LORA_FAMILY.units(sources, FamilyContext(config={}, cast=None, hints=Hints(lora_meta={"lora_alpha": 4})))

"""Vision-language output in hub names (distmerge/families/hub_names.py): what `save_pretrained` writes.

The table is checked against the installed transformers itself (a tiny model of each type saved by its own
`save_pretrained`); the merge against a real FSDP2 save of a tiny Qwen2.5-VL (tests/fixtures/make_vl.py), whose
rank files carry the module names (`model.language_model.*`, `model.visual.*`). Shown failing: with the hf
family writing source names unchanged, the merge test fails (the merged names are not save_pretrained's).
`verify` maps both sides to hub names, so it pairs a module-named reference with either naming.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from distmerge.families.hub_names import HUB_PREFIXES, to_hub, to_module
from tests.conftest import load_merged, merge_inproc, reference_dir, torchrun, tree_bytes

CASE = "fsdp2_qwen2_5_vl_tied_w2"


def tiny(model_type: str):
    """A tiny transformers model of `model_type`, built from its config class with small sizes."""
    import transformers as T

    llama = T.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                          num_key_value_heads=1, vocab_size=64)
    clip = T.CLIPVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                              image_size=28, patch_size=14)
    qwen_text = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                     num_key_value_heads=1, vocab_size=64, rope_scaling={"type": "mrope", "mrope_section": [2, 2, 4]})
    builders = {
        "qwen2_vl": lambda: T.Qwen2VLForConditionalGeneration(T.Qwen2VLConfig(
            text_config=qwen_text, vision_config=dict(depth=1, embed_dim=16, hidden_size=32, num_heads=2))),
        "qwen2_5_vl": lambda: T.Qwen2_5_VLForConditionalGeneration(T.Qwen2_5_VLConfig(
            text_config=qwen_text, vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2,
                                                      out_hidden_size=32, fullatt_block_indexes=[0]))),
        "llava": lambda: T.LlavaForConditionalGeneration(T.LlavaConfig(text_config=llama, vision_config=clip)),
        "llava_next": lambda: T.LlavaNextForConditionalGeneration(T.LlavaNextConfig(text_config=llama,
                                                                                  vision_config=clip)),
        "llava_onevision": lambda: T.LlavaOnevisionForConditionalGeneration(T.LlavaOnevisionConfig(
            text_config=llama, vision_config=clip)),
    }
    return builders[model_type]()


def saved_names(folder) -> set[str]:
    names: set[str] = set()
    for path in folder.glob("*.safetensors"):
        with safe_open(path, framework="pt") as f:
            names |= set(f.keys())
    return names


@pytest.mark.parametrize("model_type", sorted(HUB_PREFIXES))
def test_table_gives_the_names_save_pretrained_writes(model_type, tmp_path):
    model = tiny(model_type)
    assert model.config.model_type == model_type
    module = list(model.state_dict())
    model.save_pretrained(tmp_path)
    rules = HUB_PREFIXES[model_type]
    assert {to_hub(n, rules) for n in module} == saved_names(tmp_path)
    assert [to_module(to_hub(n, rules), rules) for n in module] == module  # and back, for verify
    assert {to_hub(n, rules) for n in saved_names(tmp_path)} == saved_names(tmp_path)  # hub names pass unchanged


@pytest.fixture(scope="module")
def vl_merged(vl_ckpts, tmp_path_factory):
    out = tmp_path_factory.mktemp("vl") / "n1"
    assert merge_inproc("--input", vl_ckpts[CASE], "--output", out) == 0
    return out


def test_merged_vl_equals_save_pretrained_tensor_for_tensor(vl_ckpts, vl_merged):
    hub = reference_dir(vl_ckpts[CASE]) / "hub"
    merged = load_merged(vl_merged)
    expected = {}
    for path in hub.glob("*.safetensors"):
        with safe_open(path, framework="pt") as f:
            expected |= {k: f.get_tensor(k) for k in f.keys()}
    assert sorted(merged) == sorted(expected)
    assert any(k.startswith("visual.") for k in merged) and "lm_head.weight" not in merged  # hub names, tied
    for name, want in expected.items():
        assert merged[name].dtype == want.dtype and torch.equal(merged[name], want), name
    config = json.loads((vl_merged / "config.json").read_text())
    assert config["model_type"] == "qwen2_5_vl"


def test_merged_vl_loads_and_gives_the_trained_logits(vl_ckpts, vl_merged):
    from transformers import AutoModelForImageTextToText

    ref = torch.load(reference_dir(vl_ckpts[CASE]) / "logits.pt", weights_only=True)
    model, info = AutoModelForImageTextToText.from_pretrained(vl_merged, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    with torch.no_grad():
        logits = model.eval()(input_ids=ref["input_ids"]).logits.float()
    torch.testing.assert_close(logits, ref["logits"], rtol=0, atol=0)


@pytest.mark.parametrize("reference", ["hub", "module.safetensors"])
def test_verify_pairs_hub_and_module_names_both_ways(reference, vl_ckpts, vl_merged, capsys):
    from distmerge.front.cli import main

    ref = reference_dir(vl_ckpts[CASE]) / reference
    extra = ["--logits"] if reference == "hub" else []
    assert main(["verify", "--merged", str(vl_merged), "--reference", str(ref), "--quiet", *extra]) == 0
    out = capsys.readouterr()
    assert "FAIL" not in out.out + out.err


@pytest.mark.torchrun
def test_two_processes_write_the_same_bytes(vl_ckpts, vl_merged, tmp_path):
    run = torchrun(2, "merge", "--input", vl_ckpts[CASE], "--output", tmp_path / "n2", "--quiet")
    assert run.returncode == 0, run.stderr[-2000:]
    assert tree_bytes(tmp_path / "n2") == tree_bytes(vl_merged)


def test_megatron_vision_language_save_is_refused_in_one_line(megatron_ckpts, vl_ckpts, tmp_path, capsys):
    vl_config = reference_dir(vl_ckpts[CASE]) / "hub"
    code = merge_inproc("--input", megatron_ckpts["megatron_tp2"], "--output", tmp_path / "out",
                        "--hf-config", vl_config)
    err = capsys.readouterr().err
    assert code == 1 and err.count("distmerge: error:") == 1 and "vision-language" in err, err
    assert not (tmp_path / "out" / "model.safetensors.index.json").exists()

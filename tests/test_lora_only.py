"""LoRA-only saves: rank files that hold lora_A / lora_B and no base weights.

Two real saves: verl's FSDP2 save with checkpoint.save_lora_only=True (tests/fixtures/make_lora_only.py: a PEFT
tiny Llama, r=8, alpha=16 on q_proj/v_proj, W=2, its base model beside it as a sharded Hugging Face folder), and
the HF Trainer's DeepSpeed ZeRO-2 save of a PEFT model (tests/fixtures/make_deepspeed.py, ds_trainer_lora_z2_w2:
fp32 masters of the adapter, frozen bf16 base left out of the save).

Without a base only lora_adapter/ is written (PEFT format, loads onto the base with PeftModel.from_pretrained);
with --base-model DIR the base weights are read from the folder by the same engine (base model + adapter, or
fused with --lora merge); a folder that is not this adapter's base, or --lora merge without one, is one line.

How each test was seen to fail (the feature broken on purpose, then restored): noted in its docstring.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from distmerge.families.lora.transforms import lora_fuse
from distmerge.front.cli import main as distmerge_main
from tests.conftest import assert_exact, assert_refused, load_merged, merge_inproc, reference_dir, torchrun

CASE = "fsdp2_llama_lora_only_w2"
DS_CASE = "ds_trainer_lora_z2_w2"
SCALE = 16 / 8  # lora_alpha / r of both fixtures
ADAPTER = Path("lora_adapter")


def load_file(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(path, framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def lora_tensors(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The live LoRA factors under PEFT's saved names (adapter name `default` dropped)."""
    return {k.replace(".default.", "."): v for k, v in state.items() if ".lora_" in k}


def fused_reference(base: dict[str, torch.Tensor], lora: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """W + (B @ A) * alpha / r per adapted module, from the reference tensors (the fused computation
    test_lora.py checks against PEFT's merge_and_unload)."""
    out = dict(base)
    for key, a in lora.items():
        if ".lora_A." in key:
            module = key.split(".lora_A.")[0].removeprefix("base_model.model.")
            b = lora[key.replace(".lora_A.", ".lora_B.")]
            (out[f"{module}.weight"],) = lora_fuse([base[f"{module}.weight"], a, b], scale=SCALE)
    return out


def peft_logits(base_dir: Path, adapter_dir: Path, ids: torch.Tensor, dtype=None) -> torch.Tensor:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, **({"dtype": dtype} if dtype else {})).eval()
    model = PeftModel.from_pretrained(base, adapter_dir).eval()
    with torch.no_grad():
        return model(ids).logits.float()


@pytest.fixture(scope="module")
def verl(lora_only_ckpts) -> tuple[Path, Path]:
    ckpt = lora_only_ckpts[CASE]
    return ckpt, reference_dir(ckpt)


@pytest.fixture(scope="module")
def merged(verl, tmp_path_factory) -> dict[str, Path]:
    """The verl save merged three ways by one process: adapter only, --base-model, --base-model --lora merge."""
    ckpt, ref = verl
    root = tmp_path_factory.mktemp("lora_only")
    base = ["--base-model", ref / "base_model"]
    for name, args in {"adapter": [], "base": base, "fused": [*base, "--lora", "merge"]}.items():
        assert merge_inproc("--input", ckpt, "--output", root / name, *args) == 0, name
    return {name: root / name for name in ("adapter", "base", "fused")}


def test_without_a_base_only_the_adapter_is_written(verl, merged, tmp_path, capsys):
    """Shown to fail: with finalize's adapter-only branch removed, config.json and an empty index are written
    (a folder that looks like a model and would load with random weights)."""
    ckpt, ref = verl
    out = merged["adapter"]
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == ["distmerge.manifest.json",
                                                                                   "lora_adapter"]
    assert sorted(p.name for p in (out / ADAPTER).iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    assert_exact(load_file(out / ADAPTER / "adapter_model.safetensors"), lora_tensors(load_file(ref /
                                                                                                "model.safetensors")))
    config = json.loads((out / ADAPTER / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["target_modules"]) == (8, 16, ["q_proj", "v_proj"])
    assert distmerge_main(["merge", "-i", str(ckpt), "-o", str(tmp_path / "loud")]) == 0
    assert "only the adapter" in " ".join(capsys.readouterr().out.split())


def test_the_adapter_alone_loads_with_peft_and_gives_the_trained_logits(verl, merged):
    """Shown to fail: with lora_B's units dropped from the adapter, PEFT leaves B at zero and the logits
    are the base model's (off by ~0.05)."""
    _, ref = verl
    saved = torch.load(ref / "logits.pt", weights_only=True)
    logits = peft_logits(ref / "base_model", merged["adapter"] / ADAPTER, saved["input_ids"])
    torch.testing.assert_close(logits, saved["logits"], rtol=0, atol=1e-5)


def test_base_model_folder_gives_the_whole_model(verl, merged):
    """Shown to fail: with base_model.open_file's byte offsets shifted by one element, the base tensors
    differ; with lora_base.find returning None, no model is written."""
    _, ref = verl
    out = merged["base"]
    assert_exact(load_merged(out), load_file(ref / "base.safetensors"))
    assert_exact(load_file(out / ADAPTER / "adapter_model.safetensors"),
                 lora_tensors(load_file(ref / "model.safetensors")))
    saved = torch.load(ref / "logits.pt", weights_only=True)
    torch.testing.assert_close(peft_logits(out, out / ADAPTER, saved["input_ids"]), saved["logits"], rtol=0,
                               atol=1e-5)


def test_fused_with_the_base_model_folder(verl, merged):
    """Shown to fail: with the fused units' scale halved, the adapted weights differ from the reference."""
    from transformers import AutoModelForCausalLM

    _, ref = verl
    out = merged["fused"]
    expected = fused_reference(load_file(ref / "base.safetensors"), lora_tensors(load_file(ref / "model.safetensors")))
    assert_exact(load_merged(out), expected)
    for key, value in load_file(ref / "merged.safetensors").items():  # PEFT's merge_and_unload
        torch.testing.assert_close(expected[key], value, rtol=0, atol=1e-6, msg=key)
    assert not (out / ADAPTER).exists()
    saved = torch.load(ref / "logits.pt", weights_only=True)
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        torch.testing.assert_close(model(saved["input_ids"]).logits.float(), saved["merged_logits"], rtol=0,
                                   atol=1e-5)


@pytest.mark.torchrun
def test_two_processes_write_the_same_bytes(verl, merged, tmp_path):
    """Shown to fail: with rank 1 reading its base files 4 bytes off, N=2's model.safetensors differs from N=1's
    (the base files are spread over both ranks, and the bytes travel to the owner)."""
    ckpt, ref = verl
    out = tmp_path / "n2"
    summary = tmp_path / "summary.json"
    run = torchrun(2, "merge", "--input", ckpt, "--output", out, "--base-model", ref / "base_model", "--quiet",
                   "--json-summary", summary)
    assert run.returncode == 0, run.stderr[-2000:]
    ranks = json.loads(summary.read_text())["ranks"]  # each base byte read once, the base files spread over both
    assert sum(r["bytes_read"] for r in ranks) == json.loads(summary.read_text())["total_bytes"]
    assert all(r["bytes_read"] > 0 for r in ranks)
    for sub in (Path("."), ADAPTER):
        one, two = merged["base"] / sub, out / sub
        names = sorted(p.name for p in one.iterdir() if p.is_file())
        assert names == sorted(p.name for p in two.iterdir() if p.is_file())
        assert all((one / n).read_bytes() == (two / n).read_bytes() for n in names), sub


def test_lora_merge_without_a_base_says_which_option(verl, tmp_path, capsys):
    """Shown to fail: with the check in LoraFamily._adapter_only removed, --lora merge writes the adapter."""
    ckpt, _ = verl
    assert_refused(ckpt, tmp_path / "out", "pass --base-model DIR", capsys, "--lora", "merge")
    assert not (tmp_path / "out" / ADAPTER / "adapter_config.json").exists()


def bad_folder(ref: Path, tmp_path: Path, how: str) -> Path:
    """The base folder, broken one way (a copy: the cached fixture stays as the job wrote it)."""
    folder = Path(shutil.copytree(ref / "base_model", tmp_path / how))
    if how == "no_config":
        (folder / "config.json").unlink()
    elif how == "no_weights":
        for p in folder.glob("model*"):
            p.unlink()
    else:
        weights = load_file(ref / "base.safetensors")
        key = "model.layers.1.self_attn.v_proj.weight"
        if how == "missing":
            del weights[key]
        else:  # another model: the projection has other rows than B @ A
            weights[key] = torch.zeros(48, weights[key].shape[1])
        for p in folder.glob("model*"):
            p.unlink()
        save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


@pytest.mark.parametrize(("how", "words"), [
    ("no_config", "has no config.json"),
    ("no_weights", "has neither model.safetensors nor model.safetensors.index.json"),
    ("missing", "has no model.layers.1.self_attn.v_proj.weight"),
    ("other_shape", "has shape [48, 64], the LoRA adapter needs [32, 64]"),
])
def test_a_folder_that_is_not_the_base_is_one_line(how, words, verl, tmp_path, capsys):
    """Shown to fail: with lora_base.check_fits skipped, `missing` fails in the wrapped family with another
    message and `other_shape` is written as a model the adapter does not fit."""
    ckpt, ref = verl
    folder = bad_folder(ref, tmp_path, how)
    for mode in ("adapter", "merge"):
        out = tmp_path / f"out_{mode}"
        assert_refused(ckpt, out, words, capsys, "--base-model", folder, "--lora", mode)
        assert not (out / ADAPTER / "adapter_config.json").exists()


def test_a_whole_lora_save_does_not_read_the_folder(fsdp_ckpts, verl, capsys):
    """A save holding its base (make_lora.py) with --base-model DIR: the folder names the base, none of it is read.
    Shown to fail: with prepare's split removed, the folder's tensors reach the LoRA family as checkpoint names."""
    _, ref = verl
    args = ["inspect", str(fsdp_ckpts["fsdp2_llama_lora_w2"]), "--json", "--base-model", str(ref / "base_model")]
    assert distmerge_main(args) == 0
    info = json.loads(capsys.readouterr().out)
    assert any("weights were not needed" in n for n in info["notes"]), info["notes"]
    assert [f["name"] for f in info["output_files"]] == ["model.safetensors", "lora_adapter/adapter_model.safetensors"]


# -- the HF Trainer's DeepSpeed save of a PEFT model (issue 11's LoRA item) ---------------------------------------
@pytest.fixture(scope="module")
def trainer(ds_ckpts) -> tuple[Path, Path]:
    ckpt = ds_ckpts[DS_CASE]
    return next(ckpt.glob("checkpoint-*")), reference_dir(ckpt)


def trainer_lora(ref: Path) -> dict[str, torch.Tensor]:
    return lora_tensors(load_file(ref / "masters.safetensors"))  # the live fp32 masters of A and B


def test_trainer_save_adapter_only(trainer, tmp_path):
    """Shown to fail: with the adapter's targets cast to bf16, they differ from the live fp32 masters."""
    ckpt, ref = trainer
    out = tmp_path / "out"
    assert merge_inproc("--input", ckpt, "--output", out, "--hf-config", ref) == 0
    assert_exact(load_file(out / ADAPTER / "adapter_model.safetensors"), trainer_lora(ref))
    assert not (out / "config.json").exists() and not (out / "model.safetensors.index.json").exists()


def test_trainer_save_with_base_model(trainer, tmp_path):
    """The Trainer's checkpoint has no config.json: the base folder's serves. Shown to fail: with discover not
    handed the base folder, the merge stops (no config.json, no base weights)."""
    ckpt, ref = trainer
    out = tmp_path / "out"
    assert merge_inproc("--input", ckpt, "--output", out, "--base-model", ref / "base") == 0
    assert_exact(load_merged(out), load_file(ref / "base" / "model.safetensors"))
    assert_exact(load_file(out / ADAPTER / "adapter_model.safetensors"), trainer_lora(ref))
    saved = torch.load(ref / "logits.pt", weights_only=True)  # the fp32 model holding the masters, merged
    logits = peft_logits(out, out / ADAPTER, saved["input_ids"], dtype=torch.float32)
    torch.testing.assert_close(logits, saved["logits"], rtol=0, atol=1e-5)


def test_trainer_save_fused(trainer, tmp_path):
    """Fused into the bf16 base, as merge_and_unload does in float32 and casts back. Shown to fail: with the
    fused scale halved, the adapted weights differ."""
    ckpt, ref = trainer
    out = tmp_path / "out"
    assert merge_inproc("--input", ckpt, "--output", out, "--base-model", ref / "base", "--lora", "merge") == 0
    expected = fused_reference(load_file(ref / "base" / "model.safetensors"), trainer_lora(ref))
    merged = load_merged(out)
    assert_exact(merged, expected)
    for key, value in load_file(ref / "model.safetensors").items():  # the saving job's fp32 merge_and_unload
        torch.testing.assert_close(merged[key], value.to(merged[key].dtype), msg=key)


def test_two_lora_only_saves_averaged_with_their_shared_base(verl, tmp_path):
    """Two LoRA-only saves averaged with --base-model and --lora merge: the base folder's weight is one source that
    both inputs' units share (average/units.py), read once and used by each input's step. Each output tensor is the
    formula's, float64(w1 x fused1 + w2 x fused2) cast back, with fused = W + (B @ A) x alpha / r from the
    references. The second save is a copy of the first under another name, so the formula's value is known. torch's
    deterministic mode fills new tensors with NaN, so a source assembled from nothing shows. Seen failing with the
    shared source dropped after the first input's step: 20 of 21 tensors NaN (uninitialised memory without the
    fill)."""
    ckpt, ref = verl
    twin = Path(shutil.copytree(ckpt, tmp_path / "twin"))
    weights = (0.25, 0.75)
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        assert merge_inproc("--input", ckpt, "--input", twin, "--average", "--average-weights",
                            ",".join(map(str, weights)), "--base-model", ref / "base_model", "--lora", "merge",
                            "--output", tmp_path / "out") == 0
    finally:
        torch.use_deterministic_algorithms(before)
    fused = fused_reference(load_file(ref / "base.safetensors"), lora_tensors(load_file(ref / "model.safetensors")))
    expected = {k: (weights[0] * t.double() + weights[1] * t.double()).to(t.dtype) for k, t in fused.items()}
    assert len(expected) == 21
    assert_exact(load_merged(tmp_path / "out"), expected)

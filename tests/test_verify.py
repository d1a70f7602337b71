"""`distmerge verify` on real merges of real FSDP checkpoints: a clean merge passes bit-exact against the
state dict the training job saved; each defect planted in a copy of the merged files is caught and named;
one process and a 2-process torchrun job give the same verdict and the same JSON."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tests.conftest import load_reference, merge_inproc, reference_dir, torchrun
from tests.helpers.verify import SHARD, bump, verify

INDEX = "model.safetensors.index.json"


def report(path: Path) -> dict:
    return json.loads(path.read_text())


def by_name(rep: dict) -> dict[str, dict]:
    return {t["name"]: t for t in rep["tensors"]}


def verdict(capsys) -> str:
    return [line for line in capsys.readouterr().out.splitlines() if line.startswith("verify:")][-1]


@pytest.fixture(scope="module")
def llama(fsdp_ckpts, tmp_path_factory) -> dict[str, Path]:
    ckpt = fsdp_ckpts["fsdp2_llama_w4"]
    out = tmp_path_factory.mktemp("verify") / "llama"
    assert merge_inproc("--input", ckpt, "--output", out, "--max-shard-size", SHARD) == 0
    assert len(json.loads((out / INDEX).read_text())["weight_map"]) == 21
    return {"ckpt": ckpt, "merged": out, "reference": reference_dir(ckpt)}


def edited(src: Path, dst: Path, edits: dict[str, Callable[[dict[str, torch.Tensor]], None]]) -> Path:
    """A copy of a merged folder where `edits[tensor]` rewrites the tensors of the file holding `tensor`
    (change, delete, add); the index follows, as a consistent (if wrong) output would have it."""
    shutil.copytree(src, dst)
    index = json.loads((dst / INDEX).read_text())
    for anchor, edit in edits.items():
        file = index["weight_map"][anchor]
        with safe_open(dst / file, framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        edit(tensors)
        save_file(tensors, dst / file, metadata={"format": "pt"})
        index["weight_map"] = {k: v for k, v in index["weight_map"].items() if v != file}
        index["weight_map"].update(dict.fromkeys(tensors, file))
    (dst / INDEX).write_text(json.dumps(index))
    return dst


def test_clean_merge_passes_bit_exact(llama, tmp_path, capsys):
    assert verify("--merged", llama["merged"], "--reference", llama["reference"], "--json", tmp_path / "r.json") == 0
    assert verdict(capsys) == "verify: PASS 21 tensors bit-exact"
    rep = report(tmp_path / "r.json")
    assert rep["verdict"] == "PASS" and rep["counts"]["bit_exact"] == 21 == len(rep["tensors"])
    assert all(t["bit_exact"] and t["figures"]["max_abs"] == 0 and t["figures"]["cosine"] == pytest.approx(1)
               for t in rep["tensors"])


DEFECTS = {
    "value": (
        {"model.norm.weight": bump("model.norm.weight")},
        "model.norm.weight (values differ: max abs 0.01)",
    ),
    "missing": (
        {"model.layers.1.mlp.up_proj.weight": lambda t: t.pop("model.layers.1.mlp.up_proj.weight")},
        "model.layers.1.mlp.up_proj.weight (missing in merged)",
    ),
    "extra": (
        {"model.norm.weight": lambda t: t.update({"model.extra.bias": torch.zeros(3)})},
        "model.extra.bias (extra in merged)",
    ),
    "transposed": (
        {"model.layers.0.mlp.gate_proj.weight": lambda t: t.update(
            {"model.layers.0.mlp.gate_proj.weight": t["model.layers.0.mlp.gate_proj.weight"].T.contiguous()})},
        "model.layers.0.mlp.gate_proj.weight (shape [64, 138], reference [138, 64] (transposed))",
    ),
    "dtype": (
        {"model.layers.0.self_attn.q_proj.weight": lambda t: t.update(
            {"model.layers.0.self_attn.q_proj.weight": t["model.layers.0.self_attn.q_proj.weight"].bfloat16()})},
        "model.layers.0.self_attn.q_proj.weight (dtype BF16, reference F32, equal after the cast)",
    ),
}


@pytest.mark.parametrize("defect", DEFECTS)
def test_defect_is_caught_and_named(defect, llama, tmp_path, capsys):
    edits, expected = DEFECTS[defect]
    bad = edited(llama["merged"], tmp_path / "bad", edits)
    assert verify("--merged", bad, "--reference", llama["reference"], "--json", tmp_path / "r.json") == 1
    line = verdict(capsys)
    assert line.startswith(f"verify: FAIL 1 of {22 if defect == 'extra' else 21} tensors: {expected}"), line
    failed = [t for t in report(tmp_path / "r.json")["tensors"] if not t["passed"]]
    assert [t["name"] for t in failed] == [expected.split(" ")[0]]


def test_dtype_change_passes_within_tolerance_and_says_cast(llama, tmp_path, capsys):
    name = "model.layers.0.self_attn.q_proj.weight"
    bad = edited(llama["merged"], tmp_path / "bad", {name: lambda t: t.update({name: t[name].bfloat16()})})
    args = ("--merged", bad, "--reference", llama["reference"], "--atol", "1e-2", "--json", tmp_path / "r.json")
    assert verify(*args) == 0
    assert verdict(capsys) == ("verify: PASS 21 tensors (21 bit-exact, 1 compared after casting the reference "
                               "F32->BF16)")
    tensor = by_name(report(tmp_path / "r.json"))[name]
    assert (tensor["cast"], tensor["dtype"], tensor["reference_dtype"]) == ("F32->BF16", "BF16", "F32")


def test_value_outside_tolerance_is_named_with_figures(llama, tmp_path, capsys):
    bad = edited(llama["merged"], tmp_path / "bad", {"model.norm.weight": bump("model.norm.weight")})
    args = ("--merged", bad, "--reference", llama["reference"], "--json", tmp_path / "r.json")
    assert verify(*args, "--atol", "1e-3", "--min-cosine", "0.99") == 1
    assert "1 element(s) outside atol 0.001 + rtol 0 x |ref|" in verdict(capsys)
    assert verify(*args, "--atol", "2e-2") == 0  # the same change, inside a looser tolerance
    out = capsys.readouterr().out
    assert "model.norm.weight" in out and "within tolerance" in report(tmp_path / "r.json")["summary"]


@pytest.fixture(scope="module")
def qwen_tied(fsdp_ckpts, tmp_path_factory) -> dict[str, Path]:
    ckpt = fsdp_ckpts["fsdp2_qwen2_tied_w4"]
    out = tmp_path_factory.mktemp("verify") / "qwen"
    assert merge_inproc("--input", ckpt, "--output", out) == 0
    return {"merged": out, "reference": reference_dir(ckpt) / "model.safetensors", "ckpt": ckpt}


def test_tied_head_missing_in_merged_is_accepted(qwen_tied, tmp_path, capsys):
    assert "lm_head.weight" not in json.loads((qwen_tied["merged"] / INDEX).read_text())["weight_map"]
    assert verify("--merged", qwen_tied["merged"], "--reference", qwen_tied["reference"],
                  "--json", tmp_path / "r.json") == 0
    assert verdict(capsys) == "verify: PASS 27 tensors (26 bit-exact, 1 tied head (lm_head.weight))"
    head = by_name(report(tmp_path / "r.json"))["lm_head.weight"]
    assert head["passed"] and head["bit_exact"] and "compared reference lm_head.weight with merged" in head["note"]
    counts = json.loads((tmp_path / "r.json").read_text())["counts"]  # the numbers the verdict line says
    assert (counts["tensors"], counts["bit_exact"], counts["tied_heads"]) == (27, 26, 1)


def test_tied_head_that_differs_from_the_embedding_fails(qwen_tied, tmp_path, capsys):
    state = load_reference(qwen_tied["ckpt"])
    state["lm_head.weight"] = state["lm_head.weight"] * 2
    save_file(state, tmp_path / "ref.safetensors")
    assert verify("--merged", qwen_tied["merged"], "--reference", tmp_path / "ref.safetensors", "--quiet") == 1
    assert "lm_head.weight (values differ: max abs" in verdict(capsys)


def test_reference_as_pytorch_model_bin(llama, tmp_path, capsys):
    torch.save(load_reference(llama["ckpt"]), tmp_path / "pytorch_model.bin")
    assert verify("--merged", llama["merged"], "--reference", tmp_path / "pytorch_model.bin", "--quiet") == 0
    assert verdict(capsys) == "verify: PASS 21 tensors bit-exact"


def test_reference_as_a_sharded_folder_with_an_index(llama, tmp_path, capsys):
    """A Hugging Face save split over several files: the reference's index says where each tensor is."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(llama["merged"])
    model.save_pretrained(tmp_path / "hf", max_shard_size="200KB")
    assert len(list((tmp_path / "hf").glob("model-*.safetensors"))) > 1
    assert verify("--merged", llama["merged"], "--reference", tmp_path / "hf", "--quiet") == 0
    assert verdict(capsys) == "verify: PASS 21 tensors bit-exact"


def test_logits(llama, tmp_path, capsys):
    assert verify("--merged", llama["merged"], "--reference", llama["reference"], "--logits",
                  "--json", tmp_path / "r.json") == 0
    assert verdict(capsys) == "verify: PASS 21 tensors bit-exact; logits max abs 0, KL 0"
    logits = report(tmp_path / "r.json")["logits"]
    assert logits["passed"] and logits["input_shape"] == [2, 32] and logits["figures"]["max_abs"] == 0


def test_merge_verify_against(llama, tmp_path, capsys):
    args = ("--input", llama["ckpt"], "--verify-against", llama["reference"])
    assert merge_inproc(*args, "--output", tmp_path / "same") == 0
    assert verdict(capsys) == "verify: PASS 21 tensors bit-exact"
    assert merge_inproc(*args, "--output", tmp_path / "bf16", "--dtype", "bf16") == 0  # the cast was asked for
    assert verdict(capsys) == ("verify: PASS 21 tensors (21 bit-exact, 21 compared after casting the reference "
                               "F32->BF16)")


def test_merged_without_index_is_refused(llama, tmp_path, capsys):
    shutil.copytree(llama["merged"], tmp_path / "m")
    (tmp_path / "m" / INDEX).unlink()
    assert verify("--merged", tmp_path / "m", "--reference", llama["reference"]) == 1
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("distmerge: error: "), lines
    assert "has no model.safetensors.index.json: the merge did not finish" in lines[0]


def test_missing_reference_is_named(llama, tmp_path, capsys):
    assert verify("--merged", llama["merged"], "--reference", tmp_path / "nope") == 1
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("distmerge: error: ") and str(tmp_path / "nope") in lines[0], lines


@pytest.mark.torchrun
def test_two_processes_agree_with_one(llama, tmp_path, capsys):
    """Defects in files owned by different ranks; the report must not depend on the process count."""
    weight_map = json.loads((llama["merged"] / INDEX).read_text())["weight_map"]
    first, last = "model.embed_tokens.weight", "model.norm.weight"
    assert weight_map[first] != weight_map[last]
    bad = edited(llama["merged"], tmp_path / "bad", {first: bump(first), last: bump(last)})
    args = ("verify", "--merged", bad, "--reference", llama["reference"], "--device", "cpu")
    assert verify(*args[1:], "--json", tmp_path / "one.json") == 1
    run = torchrun(2, *args, "--json", tmp_path / "two.json")
    assert run.returncode != 0, run.stdout + run.stderr[-3000:]
    one, two = report(tmp_path / "one.json"), report(tmp_path / "two.json")
    assert two["run"]["processes"] == 2 and all(n > 0 for n in two["run"]["compared_per_rank"])
    assert sum(two["run"]["compared_per_rank"]) == 21
    one.pop("run"), two.pop("run")
    assert one == two
    line = verdict(capsys)
    assert line.startswith("verify: FAIL 2 of 21 tensors: ") and first in line and last in line, line
    assert line in run.stdout.splitlines()
    assert run.stdout.count("verify: FAIL") == 1  # rank 0 speaks for all

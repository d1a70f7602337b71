"""merge --input A --input B ... --average (docs/average.md): every floating tensor is, exactly,

    acc = 0 (float64); for each input i in order: acc += float64(w_i) * float64(x_i); out = acc.to(dtype)

computed here from the saving jobs' own state dicts (the fixtures' references), never by distmerge, and compared
with torch.equal. The inputs are real saves of one architecture (different weights per case: make_fsdp.py seeds each
case by its name) by FSDP2 at W = 1, 2, 4 (Shard(0), Shard(1), HSDP), by dcp.save, and saves made here by dcp.save
(a shape or an integer buffer changed, an EMA copy beside the weights)."""

from __future__ import annotations

import json
import shutil
import weakref
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import distmerge
from distmerge.engine import fold as engine_fold
from distmerge.front.cli import main as distmerge_main
from tests.conftest import (
    assert_exact,
    expected_tensors,
    input_untouched,
    load_merged,
    merge_inproc,
    reference_dir,
    torchrun,
    tree_bytes,
)
from tests.helpers.average import average, ckpt, dcp_save, ema_save, inputs
from tests.helpers.fp8_recipe import recipe_block


def refused(capsys, *args: str, code: int = 1) -> str:
    """A merge that must fail: its exit status, one error line (returned), nothing written, the inputs untouched."""
    argv = [str(a) for a in args]
    out = Path(argv[argv.index("--output") + 1])
    if code == 2:  # argparse's own refusal of a value: its usage line, then the error
        with pytest.raises(SystemExit) as stop:
            distmerge_main(["merge", "--quiet", *argv])
        assert stop.value.code == 2
        return capsys.readouterr().err.strip().splitlines()[-1]
    assert merge_inproc(*argv) == code  # which checks that every input is untouched
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("distmerge: error: "), lines
    assert not out.exists() or not [p for p in out.iterdir() if p.name.endswith((".safetensors", ".json"))]
    return lines[0]


THREE = ("fsdp:fsdp2_llama_w1", "fsdp:fsdp2_llama_w4", "dcp:dcp_llama_w2")  # W = 1, 4 and a DCP save of W = 2


def test_the_average_of_three_formats_and_world_sizes_is_the_formula(request, tmp_path, capsys):
    """FSDP2 W=1, FSDP2 W=4, DCP W=2: three models of one architecture, default weights 1/3; one note says so."""
    ckpts = [ckpt(s, request) for s in THREE]
    assert merge_inproc(*inputs(*ckpts), "--output", tmp_path / "avg", "--average",
                        "--json-summary", tmp_path / "s.json") == 0
    assert_exact(load_merged(tmp_path / "avg"), average([expected_tensors(c) for c in ckpts]))
    summary = json.loads((tmp_path / "s.json").read_text())
    assert "average of 3 inputs, weights 1/3 each" in summary["notes"]
    assert sum(r["bytes_read"] for r in summary["ranks"]) == 3 * summary["total_bytes"]  # each input once
    assert json.loads((tmp_path / "avg" / "config.json").read_text())["model_type"] == "llama"


@pytest.mark.torchrun
def test_two_processes_write_the_bytes_of_one(fsdp_ckpts, dcp_ckpts, tmp_path):
    """Shard(1), HSDP replicas and a wrapped DCP save, weights of any sign and sum: 2 processes under torchrun and
    one process write the same bytes, the formula's."""
    ckpts = [fsdp_ckpts["fsdp2_llama_shard1_w4"], fsdp_ckpts["fsdp2_llama_hsdp_2x2"], dcp_ckpts["dcp_llama_wrapped_w4"]]
    weights = [0.5, -0.25, 1.5]
    args = [*inputs(*ckpts), "--average", "--average-weights", "0.5,-0.25,1.5"]
    assert merge_inproc(*args, "--output", tmp_path / "one") == 0
    run = torchrun(2, "merge", *args, "--output", tmp_path / "two", "--quiet")
    assert run.returncode == 0, run.stderr[-3000:]
    assert tree_bytes(tmp_path / "one") == tree_bytes(tmp_path / "two")
    assert_exact(load_merged(tmp_path / "one"), average([expected_tensors(c) for c in ckpts], weights))


def test_bf16_inputs_are_summed_in_float64_and_cast_once(fsdp_ckpts, dcp_ckpts, tmp_path):
    ckpts = [fsdp_ckpts["fsdp2_llama_bf16_w4"], dcp_ckpts["dcp_llama_bf16_w4"]]
    assert merge_inproc(*inputs(*ckpts), "--output", tmp_path / "avg", "--average", "--average-weights", "0.3,0.7") == 0
    merged = load_merged(tmp_path / "avg")
    assert_exact(merged, average([expected_tensors(c) for c in ckpts], [0.3, 0.7]))
    assert {t.dtype for t in merged.values()} == {torch.bfloat16}


def test_inputs_of_two_dtypes_need_dtype(fsdp_ckpts, tmp_path, capsys):
    """fp32 and bf16 saves: refused without --dtype (naming the first tensor), averaged in one dtype with it."""
    ckpts = [fsdp_ckpts["fsdp2_llama_w4"], fsdp_ckpts["fsdp2_llama_bf16_w4"]]
    line = refused(capsys, *inputs(*ckpts), "--output", tmp_path / "no", "--average")
    assert ("input 2 (" in line and "differs from input 1 (" in line and "at lm_head.weight: dtype BF16, input 1's "
            "F32 (--dtype writes" in line), line
    assert merge_inproc(*inputs(*ckpts), "--output", tmp_path / "avg", "--average", "--dtype", "bf16") == 0
    assert_exact(load_merged(tmp_path / "avg"), average([expected_tensors(c) for c in ckpts], dtype=torch.bfloat16))


def test_names_and_shapes_are_checked_before_anything_is_read(fsdp_ckpts, tmp_path, capsys):
    """Another architecture (Qwen2: biases on q, k, v), or one tensor of another shape: one line naming the first
    tensor that differs in name order, nothing written."""
    llama = fsdp_ckpts["fsdp2_llama_w4"]
    line = refused(capsys, *inputs(llama, fsdp_ckpts["fsdp2_qwen2_tied_w4"]), "--output", tmp_path / "a", "--average")
    assert "at model.layers.0.self_attn.k_proj.bias: input 1 has no such tensor; nothing was written" in line, line
    tensors = expected_tensors(fsdp_ckpts["fsdp2_llama_w2"])
    tensors["model.norm.weight"] = tensors["model.norm.weight"][:32].clone()
    other = dcp_save(tensors, tmp_path / "narrow", fsdp_ckpts["fsdp2_llama_w2"])
    line = refused(capsys, *inputs(llama, other), "--output", tmp_path / "b", "--average")
    assert f"input 2 ({other})" in line and "at model.norm.weight: shape [32], input 1's [64]" in line, line


def test_integer_and_bool_tensors_must_be_equal(dcp_ckpts, tmp_path, capsys):
    """Equal in every input: written as they are (the floating ones averaged); one element off: one line naming
    the tensor."""
    ckpt = dcp_ckpts["dcp_llama_buffers_w2"]
    copy = shutil.copytree(ckpt, tmp_path / "copy")
    assert merge_inproc(*inputs(ckpt, copy), "--output", tmp_path / "avg", "--average",
                        "--average-weights", "0.25,0.75") == 0
    ref = expected_tensors(ckpt)
    assert_exact(load_merged(tmp_path / "avg"), average([ref, ref], [0.25, 0.75]))
    changed = {**ref, "int_buffer": ref["int_buffer"] + (torch.arange(11) == 7)}
    other = dcp_save(changed, tmp_path / "other", ckpt)
    line = refused(capsys, *inputs(ckpt, other), "--output", tmp_path / "no", "--average")
    assert "int_buffer (int64) differs between input 1 and input 2" in line, line


@pytest.mark.parametrize("args, words", [
    (["--input", "B"], "2 inputs given (--input, repeated): pass --average"),
    (["--average"], "--average needs two or more checkpoints"),
    (["--input", "B", "--average", "--average-weights", "1"], "--average-weights gives 1 weight(s) for 2 inputs"),
    (["--average-weights", "1"], "--average-weights weighs the inputs of --average"),
    (["--input", "A", "--average"], "is given twice"),
], ids=["several-without-average", "average-of-one", "weights-count", "weights-without-average", "twice"])
def test_inputs_and_weights_must_agree(fsdp_ckpts, tmp_path, capsys, args, words):
    named = {"A": str(fsdp_ckpts["fsdp2_llama_w4"]), "B": str(fsdp_ckpts["fsdp2_llama_w2"])}
    line = refused(capsys, "--input", named["A"], "--output", tmp_path / "out", *(named.get(a, a) for a in args))
    assert words in line, line


@pytest.mark.parametrize("weights, words", [("a,b", "not numbers separated by commas"),
                                            ("1,nan", "every weight must be a finite number"), ("", "not numbers")])
def test_weights_that_are_not_numbers(fsdp_ckpts, tmp_path, capsys, weights, words):
    line = refused(capsys, *inputs(fsdp_ckpts["fsdp2_llama_w4"], fsdp_ckpts["fsdp2_llama_w2"]), "--output",
                   tmp_path / "out", "--average", "--average-weights", weights, code=2)
    assert "argument --average-weights" in line and words in line, line


def test_lora_adapters_are_fused_first(fsdp_ckpts, tmp_path, capsys):
    """Adapter output (--lora auto) refused with a line that says to fuse; --lora merge averages the fused weights
    (x_i: each input's fused weight, what a merge of it alone with --lora merge writes)."""
    ckpt = fsdp_ckpts["fsdp2_llama_lora_w2"]
    copy = shutil.copytree(ckpt, tmp_path / "copy")
    line = refused(capsys, *inputs(ckpt, copy), "--output", tmp_path / "no", "--average")
    assert "averaging adapters is not averaging their products (B @ A): pass --lora merge" in line, line
    assert merge_inproc("--input", ckpt, "--output", tmp_path / "fused", "--lora", "merge") == 0
    assert merge_inproc(*inputs(ckpt, copy), "--output", tmp_path / "avg", "--average", "--lora", "merge",
                        "--average-weights", "0.25,0.75") == 0
    fused = load_merged(tmp_path / "fused")
    assert_exact(load_merged(tmp_path / "avg"), average([fused, fused], [0.25, 0.75]))
    assert not (tmp_path / "avg" / "lora_adapter").exists()


def test_the_api_takes_a_list_of_inputs(fsdp_ckpts, dcp_ckpts, tmp_path):
    ckpts = [fsdp_ckpts["fsdp2_llama_w2"], dcp_ckpts["dcp_llama_w2"]]
    with input_untouched(*ckpts):
        result = distmerge.merge([str(c) for c in ckpts], tmp_path / "api", average=True, average_weights=[0.75, 0.25])
    assert result.tensors == 21 and "average of 2 inputs, weights 0.75, 0.25" in result.notes
    assert merge_inproc(*inputs(*ckpts), "--output", tmp_path / "cli", "--average", "--average-weights",
                        "0.75,0.25") == 0
    assert tree_bytes(tmp_path / "api") == tree_bytes(tmp_path / "cli")


def test_resume_knows_the_average(fsdp_ckpts, dcp_ckpts, tmp_path, capsys):
    """A finished average is complete for --resume; other weights, or another input, redo it."""
    ckpts = [fsdp_ckpts["fsdp2_llama_w2"], dcp_ckpts["dcp_llama_w2"]]
    args = [*inputs(*ckpts), "--output", tmp_path / "avg", "--average"]
    assert merge_inproc(*args) == 0
    capsys.readouterr()
    assert distmerge_main(["merge", *map(str, args), "--resume"]) == 0
    assert "already complete" in capsys.readouterr().out
    assert distmerge_main(["merge", *map(str, args), "--resume", "--average-weights", "0.5,0.5"]) == 0
    assert "--average-weights (unset -> [0.5, 0.5]) differs" in capsys.readouterr().out
    third = [*args, *inputs(fsdp_ckpts["fsdp2_llama_w4"]), "--resume"]
    assert distmerge_main(["merge", *map(str, third)]) == 0
    assert "redoing" in capsys.readouterr().out


def test_a_unit_holds_one_input_at_a_time(fsdp_ckpts, dcp_ckpts, tmp_path, monkeypatch):
    """engine/fold.py: while input k of a tensor is folded in, the tensors assembled for the inputs before it are
    gone (weak references dead), so an owner holds one input of a unit, not K. Seen to fail with the groups'
    tensors kept to the end of the unit."""
    ckpts = [fsdp_ckpts["fsdp2_llama_w1"], fsdp_ckpts["fsdp2_llama_w2"], dcp_ckpts["dcp_llama_w2"]]
    assembled: list[weakref.ref] = []
    alive_at_step: list[int] = []
    assemble, step = engine_fold.FoldBuild._assemble, engine_fold.FoldBuild.finish

    def watched_assemble(self, index):
        tensor = assemble(self, index)
        assembled.append(weakref.ref(tensor))
        alive_at_step.append(sum(r() is not None for r in assembled))
        return tensor

    def watched_finish(self):
        assembled.clear()
        step(self)

    monkeypatch.setattr(engine_fold.FoldBuild, "_assemble", watched_assemble)
    monkeypatch.setattr(engine_fold.FoldBuild, "finish", watched_finish)
    assert merge_inproc(*inputs(*ckpts), "--output", tmp_path / "avg", "--average") == 0
    assert len(alive_at_step) == 3 * 21 and max(alive_at_step) == 1, alive_at_step


def test_verify_an_average_against_a_reference_average(fsdp_ckpts, tmp_path, capsys):
    """Two finished models: the average merged, and one computed apart (here: the formula over the references)."""
    ckpts = [fsdp_ckpts["fsdp2_llama_w2"], fsdp_ckpts["fsdp2_llama_w4"]]
    assert merge_inproc(*inputs(*ckpts), "--output", tmp_path / "avg", "--average") == 0
    (tmp_path / "ref").mkdir()
    save_file(average([expected_tensors(c) for c in ckpts]), tmp_path / "ref" / "model.safetensors",
              metadata={"format": "pt"})
    shutil.copy(tmp_path / "avg" / "config.json", tmp_path / "ref" / "config.json")
    capsys.readouterr()
    assert distmerge_main(["verify", "--merged", str(tmp_path / "avg"), "--reference", str(tmp_path / "ref")]) == 0
    assert "verify: PASS 21 tensors bit-exact" in capsys.readouterr().out


# -- EMA copies (torchtitan's layout: ema.state.<fqn>.ema_params.<key>) ------------------------------------------------


def test_ema_key_merges_the_ema_copy(dcp_ckpts, tmp_path, capsys):
    """Without --ema-key: the live weights, a note naming the copies; with it: the copy's tensors, the untracked
    one from the live weights (named); a key the save lacks: an error naming those it has, never the live weights."""
    save, live, copy = ema_save(dcp_ckpts, tmp_path / "ema")
    assert merge_inproc("--input", save, "--output", tmp_path / "live", "--json-summary", tmp_path / "s.json") == 0
    assert_exact(load_merged(tmp_path / "live"), live)
    notes = json.loads((tmp_path / "s.json").read_text())["notes"]
    assert any("holds EMA copies (decay_0p9, decay_0p999), not merged" in n for n in notes), notes
    assert merge_inproc("--input", save, "--output", tmp_path / "copy", "--ema-key", "decay_0p999",
                        "--json-summary", tmp_path / "s.json") == 0
    assert_exact(load_merged(tmp_path / "copy"), {**live, **copy})
    notes = json.loads((tmp_path / "s.json").read_text())["notes"]
    assert ("--ema-key decay_0p999: 20 tensors from the EMA copy; 1 it does not track from the live weights "
            "(model.norm.weight)") in notes, notes
    line = refused(capsys, "--input", save, "--output", tmp_path / "no", "--ema-key", "decay_0p5")
    assert "holds no EMA copy 'decay_0p5'; it holds decay_0p9, decay_0p999" in line, line
    line = refused(capsys, "--input", dcp_ckpts["dcp_llama_w2"], "--output", tmp_path / "no", "--ema-key", "decay_0p9")
    assert "holds no EMA copy (no ema.state.*.ema_params.* entries)" in line, line


def test_an_average_of_ema_copies(dcp_ckpts, fsdp_ckpts, tmp_path, capsys):
    """--ema-key applies to every input, as the other format options do (an FSDP save has none to choose)."""
    save, live, copy = ema_save(dcp_ckpts, tmp_path / "ema")
    other = shutil.copytree(save, tmp_path / "ema2")
    assert merge_inproc(*inputs(save, other), "--output", tmp_path / "avg", "--average", "--ema-key", "decay_0p9",
                        "--average-weights", "0.5,0.5") == 0
    half = {k: v * 0.5 for k, v in copy.items()}
    assert_exact(load_merged(tmp_path / "avg"), average([{**live, **half}] * 2, [0.5, 0.5]))
    line = refused(capsys, *inputs(save, fsdp_ckpts["fsdp2_llama_w4"]), "--output", tmp_path / "no", "--average",
                   "--ema-key", "decay_0p9")
    assert "--ema-key applies to torchtitan, dcp input; fsdp has no such choice" in line, line


def test_quantize_quantizes_the_average(fsdp_ckpts, tmp_path, monkeypatch):
    """--quantize after --average: each attention and MLP weight is the FP8 quantization of the formula's average
    (the published block recipe, written out in tests/helpers/fp8_recipe.py); the other tensors are the average.
    The units are still built an input at a time."""
    ckpts = [fsdp_ckpts["fsdp2_llama_w2"], fsdp_ckpts["fsdp2_llama_w4"]]
    folds = []
    monkeypatch.setattr(engine_fold.FoldBuild, "finish", lambda self, finish=engine_fold.FoldBuild.finish: (
        folds.append(self.unit.transform), finish(self))[1])
    assert merge_inproc(*inputs(*ckpts), "--output", tmp_path / "fp8", "--average", "--quantize", "fp8-block") == 0
    merged, expected = load_merged(tmp_path / "fp8"), average([expected_tensors(c) for c in ckpts])
    linear = {f"model.layers.{layer}.{module}.weight" for layer in range(2) for module in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
        "mlp.up_proj", "mlp.down_proj")}
    assert linear <= set(expected) and set(merged) == set(expected) | {n + "_scale_inv" for n in linear}
    for name, value in expected.items():
        if name in linear:
            weight, scale = recipe_block(value)
            assert torch.equal(merged[name].view(torch.uint8), weight.view(torch.uint8)), name
            assert torch.equal(merged[name + "_scale_inv"], scale), name
        else:
            assert torch.equal(merged[name], value), name
    assert folds.count("quantized") == 14 and len(folds) == 21


def test_a_megatron_save_and_an_fsdp_save_of_one_model(megatron_ckpts, twin_ckpts, tmp_path):
    """Megatron legacy TP2 x PP2 (one unit splits the fused QKV into q, k, v), an FSDP2 save (q, k, v apart) and a
    torch_dist save, of one set of weights (the fixtures save the same model three ways): the units of one layer's
    q, k, v are averaged as one, each input through its own transform."""
    ckpts = [megatron_ckpts["megatron_tp2pp2"], twin_ckpts["fsdp2_from_megatron_w2"],
             megatron_ckpts["megatron_dist_tp2pp2"]]
    hf = reference_dir(ckpts[0]) / "huggingface"
    assert merge_inproc(*inputs(*ckpts), "--output", tmp_path / "avg", "--average", "--hf-config", hf,
                        "--average-weights", "0.2,0.3,0.5") == 0
    refs = [load_file(reference_dir(c) / "model.safetensors") for c in ckpts]
    assert_exact(load_merged(tmp_path / "avg"), average(refs, [0.2, 0.3, 0.5]))

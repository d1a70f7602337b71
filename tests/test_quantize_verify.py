"""`distmerge verify` of an FP8 output (merge --quantize) against the full-precision model: each FP8 weight is
dequantized on the fly and judged against the FP8 bound per tensor; --logits loads the FP8 folder with
transformers (which dequantizes on CPU) and compares logits with the full-precision model's."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from distmerge import api
from distmerge.front.cli import main as distmerge_main
from tests.conftest import merge_inproc, reference_dir

CASE = "fsdp2_llama_w2"  # 138-row MLP weights: a full block and a partial one


@pytest.fixture(scope="module")
def quantized(fsdp_ckpts, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fp8_verify")
    for scheme in ("fp8-block", "fp8-channel"):
        assert merge_inproc("--input", fsdp_ckpts[CASE], "--output", root / scheme, "--quantize", scheme) == 0
    return {scheme: root / scheme for scheme in ("fp8-block", "fp8-channel")}


@pytest.mark.parametrize("scheme", ["fp8-block", "fp8-channel"])
def test_fp8_folder_passes_within_the_bound(scheme, quantized, fsdp_ckpts, capsys):
    result = api.verify(quantized[scheme], reference_dir(fsdp_ckpts[CASE]), logits=scheme == "fp8-block",
                        progress=True)
    out = capsys.readouterr().out
    assert result.passed, out
    fp8_checks = [c for c in result.checks if c.fp8_bound is not None]
    assert len(fp8_checks) == 14 and all(c.outcome == "within FP8 bound" and 0.5 < c.fp8_bound <= 1
                                         for c in fp8_checks)
    assert {c.name for c in result.checks if c.bit_exact} == {"model.embed_tokens.weight", "lm_head.weight",
                                                             "model.norm.weight",
                                                             *(f"model.layers.{i}.{n}.weight" for i in (0, 1) for n in
                                                               ("input_layernorm", "post_attention_layernorm"))}
    assert "14 FP8 weights within the FP8 bound, dequantized" in out
    assert not any(c.name.endswith(("_scale", "_scale_inv")) for c in result.checks)  # read with their weight
    if result.logits is not None:
        assert result.logits.passed and "judged by cosine >= 0.99" in result.logits.note
        assert 0.99 < result.logits.figures.cosine < 1


@pytest.mark.parametrize("scheme", ["fp8-block", "fp8-channel"])
def test_a_wrong_scale_is_named(scheme, quantized, fsdp_ckpts, tmp_path, capsys):
    """One block's (or row's) scale off by 5%: that weight fails, with how far beyond the bound it went."""
    damaged = tmp_path / "damaged"
    shutil.copytree(quantized[scheme], damaged)
    state = load_file(damaged / "model.safetensors")
    scale = "model.layers.1.mlp.down_proj.weight" + ("_scale_inv" if scheme == "fp8-block" else "_scale")
    state[scale] = state[scale].clone()
    state[scale][0, 0] *= 1.05
    save_file(state, damaged / "model.safetensors", metadata={"format": "pt"})
    assert distmerge_main(["verify", "--merged", str(damaged), "--reference",
                           str(reference_dir(fsdp_ckpts[CASE]))]) == 1
    verdict = capsys.readouterr().out.strip().splitlines()[-1]
    assert verdict.startswith("verify: FAIL 1 of 21 tensors: model.layers.1.mlp.down_proj.weight (values differ: ")
    assert "beyond the FP8 bound" in verdict


def test_a_checkpoint_verified_with_quantize_in_memory(fsdp_ckpts, quantized):
    """verify --merged CHECKPOINT --quantize: merged and quantized in memory, nothing written; the same records
    as verify of the folder merge --quantize writes."""
    ref = reference_dir(fsdp_ckpts[CASE])
    in_memory = api.verify(fsdp_ckpts[CASE], ref, quantize="fp8-channel")
    folder = api.verify(quantized["fp8-channel"], ref)
    assert in_memory.passed and in_memory.format == "fsdp"
    assert sorted(in_memory.checks, key=lambda c: c.name) == sorted(folder.checks, key=lambda c: c.name)


def test_quantize_with_a_finished_model_is_refused(quantized, fsdp_ckpts, capsys):
    args = ["verify", "--merged", str(quantized["fp8-block"]), "--reference", str(reference_dir(fsdp_ckpts[CASE])),
            "--quantize", "fp8-block"]
    assert distmerge_main(args) == 1
    assert "--quantize: options of the merge of a training checkpoint" in capsys.readouterr().err


def test_config_of_the_fp8_folder(quantized):
    """What loaders read: the published keys for fp8-block, and the modules left unquantized named for both."""
    block = json.loads((quantized["fp8-block"] / "config.json").read_text())["quantization_config"]
    assert block == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                     "weight_block_size": [128, 128], "modules_to_not_convert": ["lm_head", "model.embed_tokens"]}
    channel = json.loads((quantized["fp8-channel"] / "config.json").read_text())["quantization_config"]
    assert channel["quant_method"] == "compressed-tensors" and channel["format"] == "float-quantized"
    assert channel["ignore"] == ["lm_head", "model.embed_tokens"]
    weights = channel["config_groups"]["group_0"]["weights"]
    assert (weights["type"], weights["strategy"], weights["num_bits"]) == ("float", "channel", 8)
    header = load_file(quantized["fp8-channel"] / "model.safetensors")
    assert header["model.layers.0.mlp.down_proj.weight_scale"].dtype == torch.float32


@pytest.mark.parametrize("scheme", ["fp8-block", "fp8-channel"])
@pytest.mark.parametrize("block", [1000, 2**14])  # 1000: blocks that start mid-row and mid 128-column block
def test_block_by_block_is_the_whole_tensor(scheme, block, monkeypatch):
    """verify's FP8 comparison a block at a time (verifier/bounded.py with quantize/compare.py's decoder, each element
    finding its own scale) gives the figures, the largest error / bound and the count beyond it of the whole tensors
    dequantized at once (as fp8.Scheme.dequantize and fp8.bound do); with one scale off by 5%, the elements it scales
    go beyond."""
    from distmerge.quantize import fp8, schemes
    from distmerge.verifier import blocks
    from distmerge.verifier.bounded import Bounded
    from distmerge.verifier.report import Criteria

    monkeypatch.setitem(blocks.BLOCK, "cpu", block)
    grid, gen = schemes.SCHEMES[scheme], torch.Generator().manual_seed(0)
    r = torch.randn(300, 257, generator=gen).to(torch.bfloat16)
    q, scale = grid.quantize(r)
    for s in (scale, scale.clone().index_put_((torch.tensor([1]), torch.tensor([0])), scale[1, 0] * 1.05)):
        decoder = schemes.SCHEMES[scheme].decoder(tuple(r.shape), [s], torch.device("cpu"))
        run = Bounded(tuple(r.shape), decoder, 0.0, torch.device("cpu"), Criteria(), blocks.Scratch())
        blocks.whole(q, lambda start, count: r.reshape(-1)[start : start + count], run)
        got = grid.dequantize(q, s)
        err, limit = (got - r.float()).abs(), fp8.bound(r, grid.expand(s, tuple(r.shape)))
        assert run.worst == (err / limit).max().item() and run.beyond == int((err > limit).sum())
        assert run.figures() == blocks.figures(got, r.float(), 0.0, 0.0)[1]
    assert run.beyond > 0 and run.worst > 1  # the damaged scale


@pytest.mark.parametrize("scheme", ["fp8-block", "fp8-channel"])
def test_a_finished_fp8_model_against_its_checkpoint(scheme, quantized, fsdp_ckpts, tmp_path):
    """The FP8 folder as --merged, the checkpoint it came from as --reference (merged in memory, its targets compared
    as their bytes arrive, the FP8 weight read a block at a time with its scales): the records of the folder against
    the full-precision folder; a damaged scale is named."""
    ckpt = fsdp_ckpts[CASE]
    swapped = api.verify(quantized[scheme], ckpt)
    folder = api.verify(quantized[scheme], reference_dir(ckpt))
    assert swapped.passed and swapped.reference_format == "fsdp"
    assert sum(c.fp8_bound is not None for c in swapped.checks) == 14
    assert sorted(swapped.checks, key=lambda c: c.name) == sorted(folder.checks, key=lambda c: c.name)
    damaged = shutil.copytree(quantized[scheme], tmp_path / "damaged")
    state = load_file(damaged / "model.safetensors")
    name = "model.layers.0.self_attn.o_proj.weight" + ("_scale_inv" if scheme == "fp8-block" else "_scale")
    state[name] = state[name] * 1.05
    save_file(state, damaged / "model.safetensors", metadata={"format": "pt"})
    failed = [c for c in api.verify(damaged, ckpt).checks if not c.passed]
    assert [c.name for c in failed] == ["model.layers.0.self_attn.o_proj.weight"]
    assert "beyond the FP8 bound" in failed[0].reason


def test_quantize_with_a_checkpoint_as_reference_is_refused(quantized, fsdp_ckpts, capsys):
    """--quantize quantizes the merge of a --merged checkpoint: a checkpoint --reference would be quantized too."""
    ckpt = fsdp_ckpts[CASE]
    assert distmerge_main(["verify", "--merged", str(quantized["fp8-block"]), "--reference", str(ckpt),
                           "--quantize", "fp8-block"]) == 1
    assert "is a finished model (its quantized weights, if any, are compared as written)" in capsys.readouterr().err
    assert distmerge_main(["verify", "--merged", str(ckpt), "--reference", str(fsdp_ckpts["fsdp2_llama_w4"]),
                           "--quantize", "fp8-block"]) == 1
    assert "not a second checkpoint" in capsys.readouterr().err

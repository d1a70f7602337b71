"""`distmerge verify` of a 4-bit output (merge --quantize nvfp4 | mxfp4) against the full-precision model: each
weight's packed bytes are unpacked and dequantized on the fly with its group scales (and global scale) and judged
against the e2m1 bound (quantize/compare.py, verifier/bounded.py); the same records from the folder, from the
checkpoint merged and quantized in memory, and from the folder against the checkpoint it came from."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from distmerge import api
from distmerge.front.cli import main as distmerge_main
from distmerge.quantize import fp4
from tests.conftest import merge_inproc, reference_dir
from tests.helpers import fp4_recipe

CASE = "fsdp2_llama_w2"  # 12 weights quantized; down_proj (138 inputs: not whole groups) kept in float32
SCHEMES = ("nvfp4", "mxfp4")


@pytest.fixture(scope="module")
def quantized(fsdp_ckpts, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fp4_verify")
    for scheme in SCHEMES:
        assert merge_inproc("--input", fsdp_ckpts[CASE], "--output", root / scheme, "--quantize", scheme) == 0
    return {scheme: root / scheme for scheme in SCHEMES}


def bounded(result) -> list:
    return [c for c in result.checks if c.fp8_bound is not None]


@pytest.mark.parametrize("scheme", SCHEMES)
def test_4_bit_folder_passes_within_the_bound(scheme, quantized, fsdp_ckpts, capsys):
    result = api.verify(quantized[scheme], reference_dir(fsdp_ckpts[CASE]), logits=True, progress=True)
    out = capsys.readouterr().out
    assert result.passed, out
    assert len(bounded(result)) == 12 and all(c.outcome == "within FP4 bound" and 0.5 < c.fp8_bound <= 1
                                              for c in bounded(result))
    assert sum(c.bit_exact for c in result.checks) == 9  # embeddings, head, norms, the two down_proj
    assert "12 FP4 weights within the FP4 bound, dequantized" in out
    assert not any(c.name.endswith(("_packed", "_scale", "_global_scale")) for c in result.checks)
    assert result.logits.passed and "4-bit weights" in result.logits.note and result.logits.figures.cosine > 0.99


@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_scale_twice_too_large_is_named(scheme, quantized, fsdp_ckpts, tmp_path, capsys):
    damaged = shutil.copytree(quantized[scheme], tmp_path / "damaged")
    state = load_file(damaged / "model.safetensors")
    name = "model.layers.1.mlp.up_proj.weight_scale"
    scale = state[name].clone()
    if scheme == "nvfp4":
        scale[3, 1] = (scale[3, 1].float() * 2).to(scale.dtype)
    else:
        scale[3, 1] += 1  # the exponent of a power of two
    state[name] = scale
    save_file(state, damaged / "model.safetensors", metadata={"format": "pt"})
    assert distmerge_main(["verify", "--merged", str(damaged), "--reference",
                           str(reference_dir(fsdp_ckpts[CASE]))]) == 1
    verdict = capsys.readouterr().out.strip().splitlines()[-1]
    assert verdict.startswith("verify: FAIL 1 of 21 tensors: model.layers.1.mlp.up_proj.weight (values differ: ")
    assert "beyond the FP4 bound" in verdict


@pytest.mark.parametrize("scheme", SCHEMES)
def test_in_memory_and_against_the_checkpoint_give_the_folder_records(scheme, quantized, fsdp_ckpts):
    """verify --merged CHECKPOINT --quantize (merged and quantized in memory: q/k/v and gate/up are one unit each),
    and the folder against the checkpoint it came from (the checkpoint streamed, the packed weight read a block at a
    time): the records of the folder against the full-precision folder."""
    ckpt, ref = fsdp_ckpts[CASE], reference_dir(fsdp_ckpts[CASE])
    folder = sorted(api.verify(quantized[scheme], ref).checks, key=lambda c: c.name)
    in_memory = api.verify(ckpt, ref, quantize=scheme)
    swapped = api.verify(quantized[scheme], ckpt)
    assert in_memory.passed and swapped.passed and len(bounded(in_memory)) == len(bounded(swapped)) == 12
    assert sorted(in_memory.checks, key=lambda c: c.name) == folder
    assert sorted(swapped.checks, key=lambda c: c.name) == folder


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("block", [1008, 2**14])  # 1008: blocks that start mid-row
def test_block_by_block_is_the_whole_tensor(scheme, block, monkeypatch):
    """The comparison a block at a time gives the figures, the largest error / bound and the count beyond it of the
    whole tensor dequantized at once, by the format's specification (tests/helpers/fp4_recipe.py: e2m1 values times
    their group's scale), each value within e2m1's rounding of the reference."""
    from distmerge.quantize import schemes
    from distmerge.verifier import blocks
    from distmerge.verifier.bounded import Bounded
    from distmerge.verifier.report import Criteria

    monkeypatch.setitem(blocks.BLOCK, "cpu", block)
    row, gen = schemes.SCHEMES[scheme], torch.Generator().manual_seed(0)
    r = torch.randn(96, 320, generator=gen).to(torch.bfloat16)
    shared = row.shared([r])
    packed, scale, *_ = row.quantize(r, shared)
    decoder = schemes.SCHEMES[scheme].decoder(tuple(r.shape), [scale, *[shared] * (shared is not None)],
                                            torch.device("cpu"))
    run = Bounded(tuple(r.shape), decoder, 0.0, torch.device("cpu"), Criteria(), blocks.Scratch())
    blocks.whole(packed, lambda start, count: r.reshape(-1)[start : start + count], run, per=2)
    if scheme == "nvfp4":
        assert [torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                for a, b in zip(fp4_recipe.nvfp4(r, shared), (packed, scale), strict=True)] == [True, True]
        got = fp4_recipe.nvfp4_dequantized(packed, scale, shared)
        each = (scale.float() / shared).repeat_interleave(fp4_recipe.NVFP4_GROUP, dim=1)
    else:
        got = fp4_recipe.mxfp4_dequantized(packed, scale)
        each = torch.pow(2.0, scale.int() - 127).float().repeat_interleave(fp4_recipe.MXFP4_GROUP, dim=1)
    assert bool(fp4_recipe.within_e2m1(got, r, each).all())
    err, limit = (got - r.float()).abs(), fp4.bound(r, each)  # the verifier's bound, as it judges each block
    assert run.worst == (err / limit).max().item() and run.beyond == int((err > limit).sum()) == 0
    assert run.figures() == blocks.figures(got, r.float(), 0.0, 0.0)[1]

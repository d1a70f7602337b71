"""verify's figures block by block (distmerge/verifier/blocks.py): whatever the pieces a target arrives in and their
order, the figures are those of the whole tensors, `equal` is torch.equal, and the figures are the plain
computation's; a checkpoint whose units are direct is compared without any target being built whole."""

from __future__ import annotations

import math
import random

import pytest
import torch

from distmerge.front.cli import main as distmerge_main
from distmerge.verifier import blocks, stream
from distmerge.verifier.blocks import Running, Scratch, Streamed, figures
from tests.conftest import reference_dir

CPU = torch.device("cpu")


def pieces(nbytes: int, rng: random.Random) -> list[tuple[int, int]]:
    """[start, end) byte ranges covering nbytes, cut at random (not at element or block edges), shuffled."""
    cuts = sorted({0, nbytes, *(rng.randrange(nbytes) for _ in range(12))})
    out = list(zip(cuts, cuts[1:], strict=False))
    rng.shuffle(out)
    return out


def streamed(m: torch.Tensor, r: torch.Tensor, rng: random.Random, atol: float = 0.0, rtol: float = 0.0):
    """m's bytes put in random pieces, each block compared with r's: (equal, figures)."""
    step = blocks.block_size(CPU)
    run = Running(m.numel(), CPU, atol, rtol, Scratch())
    flat = r.reshape(-1)

    def block(k: int, mine: torch.Tensor) -> None:
        run.add(k, mine, flat[k * step : k * step + mine.numel()])

    data = memoryview(m.contiguous().reshape(-1).view(torch.uint8).numpy())
    s = Streamed(len(data), m.dtype, block, Scratch())
    for a, b in pieces(len(data), rng):
        s.put(bytearray(data[a:b]), a)  # a copy, as the reader's reused buffer would be
    assert s.done and not s.staged
    return run.equal, run.figures()


def pair(dtype: torch.dtype, numel: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    r = torch.randn(numel, generator=g).to(dtype)
    return r.clone(), r


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_any_pieces_in_any_order_give_the_whole_figures(dtype, monkeypatch):
    monkeypatch.setitem(blocks.BLOCK, "cpu", 1000)  # many blocks, none aligned with the pieces
    rng = random.Random(0)
    m, r = pair(dtype, 10_007, 1)
    assert streamed(m, r, rng) == figures(m, r, 0.0, 0.0)
    assert streamed(m, r, rng)[0] is True
    m.view(-1)[[3, 4_500, 10_006]] += 0.5
    got = streamed(m, r, rng, atol=1e-3)
    assert got == figures(m, r, 1e-3, 0.0) and got[0] is False and got[1].outside == 3


def test_figures_are_the_plain_computation(monkeypatch):
    monkeypatch.setitem(blocks.BLOCK, "cpu", 999)
    m, r = pair(torch.float32, 5_000, 2)
    m = m + torch.randn(5_000, generator=torch.Generator().manual_seed(3)) * 1e-3
    r.view(-1)[7] = 0.0  # a zero reference element: left out of the relative difference
    equal, f = figures(m, r, 1e-4, 1e-3)
    a, b = m.double(), r.double()
    diff = (a - b).abs()
    assert not equal
    assert f.max_abs == diff.max().item() and f.max_ref == b.abs().max().item()
    assert f.max_rel == (diff[b != 0] / b[b != 0].abs()).max().item()
    assert math.isclose(f.mean_abs, diff.mean().item(), rel_tol=1e-12)
    assert math.isclose(f.cosine, torch.nn.functional.cosine_similarity(a, b, dim=0).item(), rel_tol=1e-12)
    assert f.outside == (~torch.isclose(a, b, rtol=1e-3, atol=1e-4)).sum().item()


@pytest.mark.parametrize("values, equal", [
    ([float("nan"), 1.0], False),  # NaN equals nothing, as in torch.equal
    ([float("inf"), 1.0], True),
    ([-0.0, 1.0], True),  # -0.0 == 0.0
])
def test_equal_is_torch_equal_and_special_values_keep_their_figures(values, equal, monkeypatch):
    monkeypatch.setitem(blocks.BLOCK, "cpu", 2)
    m = torch.tensor([*values, 2.0, 3.0])
    r = torch.tensor([abs(v) if v == 0 else v for v in values] + [2.0, 3.0])
    got_equal, f = figures(m, r, 0.0, 0.0)
    assert got_equal is equal is torch.equal(m, r)
    if math.isnan(values[0]) or math.isinf(values[0]):  # NaN (or inf - inf) in the difference propagates
        assert math.isnan(f.max_abs)
    else:
        assert f.max_abs == 0.0 and f.cosine == pytest.approx(1.0)


def test_a_cast_reference_is_compared_in_the_merged_dtype(monkeypatch):
    monkeypatch.setitem(blocks.BLOCK, "cpu", 100)
    m32, _ = pair(torch.float32, 1_000, 4)
    m = m32.to(torch.bfloat16)
    assert figures(m, m32, 0.0, 0.0)[0] is True  # m32 cast to bf16 equals m
    assert streamed(m, m32, random.Random(1))[0] is True


def test_fsdp_checkpoint_targets_are_never_built_whole(fsdp_ckpts, monkeypatch, capsys):
    """Every unit of an FSDP2 save is direct: its targets' bytes are compared as they arrive (the whole-tensor
    path, which held each target and its reference, is never taken on the CPU)."""
    whole = []
    monkeypatch.setattr(stream.StreamSink, "whole", lambda self, name, tensor: whole.append(name))
    ckpt = fsdp_ckpts["fsdp2_llama_w4"]
    assert distmerge_main(["verify", "--merged", str(ckpt), "--reference", str(reference_dir(ckpt)),
                           "--device", "cpu"]) == 0
    assert whole == []
    assert "verify: PASS 21 tensors" in capsys.readouterr().out

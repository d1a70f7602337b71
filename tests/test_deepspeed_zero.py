"""Where ZeRO puts each parameter's master elements (distmerge/formats/deepspeed/zero.py), checked against a
flat buffer built and cut the way DeepSpeed builds and cuts it (stage_1_and_2.py: params + alignment
padding, total padded to 2*W, W equal slices; stage3.py: ceil(numel/W) per rank per parameter). The real
saves are covered end to end in test_merge_deepspeed.py; this pins the arithmetic at the edges (a slice
that starts mid-parameter, a rank whose whole slice is padding, a parameter smaller than W)."""

from __future__ import annotations

import math

import pytest
import torch

from distmerge.formats.deepspeed.zero import flat_pieces, partition_size, stage3_pieces
from distmerge.input import source


def reassemble(pieces_by_rank, slices, numels, names):
    out = {n: torch.full((k,), -1.0) for n, k in zip(names, numels, strict=True)}
    for rank, pieces in pieces_by_rank.items():
        for p in pieces:
            out[p.name][p.start : p.start + p.count] = slices[rank][p.local : p.local + p.count]
    return out


@pytest.mark.parametrize(("numels", "paddings", "world"), [
    ([70070, 4900, 980, 70], [0, 0, 0, 0], 3),
    ([7, 5, 3, 11], [1, 3, 1, 0], 4),  # parameter_alignment zeros after each but the last
    ([3], [0], 8),  # most ranks hold only padding
])
def test_flat_pieces_rebuild_every_parameter(numels, paddings, world):
    names = [f"p{i}" for i in range(len(numels))]
    params = [torch.arange(n, dtype=torch.float32) + 1000 * i for i, n in enumerate(numels)]
    flat = torch.cat([torch.cat([p, torch.zeros(pad)]) for p, pad in zip(params, paddings, strict=True)])
    size = partition_size(flat.numel(), world)
    flat = torch.cat([flat, torch.zeros(size * world - flat.numel())])
    used = sum(numels) + sum(paddings)
    slices = {r: flat[r * size : r * size + max(0, min(size, used - r * size))] for r in range(world)}  # stripped
    pieces = {r: flat_pieces(names, numels, paddings, r, world, slices[r].numel()) for r in range(world)}
    rebuilt = reassemble(pieces, slices, numels, names)
    assert all(torch.equal(rebuilt[n], p) for n, p in zip(names, params, strict=True))
    assert size * world % (2 * world) == 0


@pytest.mark.parametrize(("numels", "world"), [([10, 3, 64], 4), ([1, 2], 3)])
def test_stage3_pieces_rebuild_every_parameter(numels, world):
    names = [f"p{i}" for i in range(len(numels))]
    params = [torch.arange(n, dtype=torch.float32) + 1000 * i for i, n in enumerate(numels)]
    slices, pieces = {}, {}
    for r in range(world):
        parts = []
        for p in params:
            per = math.ceil(p.numel() / world)
            part = p[r * per : (r + 1) * per]
            parts.append(torch.cat([part, torch.zeros(per - part.numel())]))
        slices[r] = torch.cat(parts)
        pieces[r], total = stage3_pieces(names, numels, r, world)
        assert total == slices[r].numel()
    rebuilt = reassemble(pieces, slices, numels, names)
    assert all(torch.equal(rebuilt[n], p) for n, p in zip(names, params, strict=True))


def test_readers_are_spread_by_the_bytes_a_merge_reads(ds_ckpts):
    """A stage-2 save's model-states file holds the whole 16-bit module, which a merge of the masters never reads,
    and each optimizer file is read for its master third: spreading files by size would give one reader the
    module file plus optimizer files (shown failing with plan.assign_readers weighting by `size`)."""
    from dataclasses import replace

    from distmerge.engine.plan import assign_readers
    from distmerge.formats.registry import get

    fmt = get("deepspeed")
    scan = fmt.scan(source.looking_at(ds_ckpts["ds_z2_odd_w3"]), {})
    model = [f for f in scan.files if "model_states" in f.path]
    optims = [f for f in scan.files if "optim_states" in f.path]
    assert len(model) == 1 and model[0].reads == 0 and model[0].size > 0
    assert len(optims) == 3 and all(f.reads == f.size // 3 for f in optims)
    # the tiny fixture's module is small; at the benchmark's size it is the largest file of the save
    files = tuple(replace(f, size=10 * sum(o.size for o in optims)) if f in model else f for f in scan.files)
    readers = assign_readers(files, 3)
    assert sorted(readers[f.index] for f in optims) == [0, 1, 2]  # one optimizer file each

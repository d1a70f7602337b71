"""The coverage check of a source tensor's blocks (plan.merge_inventories): after replicas are removed, the blocks
must lie inside the tensor, not overlap, and add up to all of it. The common layouts (runs of whole rows or flat
ranges, one after another) pass in one step per block (`tiled_in_order`); any other goes through the general check
(`check_coverage`), which words the error."""

from __future__ import annotations

import math
from itertools import product

from distmerge.errors import LayoutError
from distmerge.formats.base import Fragment


def tiled_in_order(shape: tuple[int, ...], blocks: tuple[Fragment, ...]) -> bool:
    """True when the blocks, in region order, are runs of whole rows (or flat ranges) that follow one another from
    the tensor's first element to its last: FSDP's Shard(0), Megatron's dim-0 splits, whole tensors, ZeRO ranges.
    Such blocks lie inside the tensor, do not overlap and cover it. False only says "not this simple case": the
    general check (check_coverage) then decides and words any error. At W=1024 this is 1.2 million blocks, where
    the general check's per-block geometry cost seconds (tests/bench/bench_scale.py)."""
    if not blocks or not shape:
        return False
    flat = blocks[0].flat
    total, rest = (math.prod(shape), None) if flat else (shape[0], shape[1:])
    end = 0
    for b in blocks:
        if b.flat != flat or (not flat and (b.lengths[1:] != rest or any(b.offsets[1:]))):
            return False
        start, count = b.offsets[0], b.lengths[0]
        if count < 0 or not 0 <= start <= total or (count and start != end):
            return False
        end += count
    return end == total


def check_coverage(name: str, shape: tuple[int, ...], blocks: tuple[Fragment, ...]) -> None:
    """Fragments must lie inside the tensor, not overlap, and add up to all of it."""
    for b in blocks:
        if not b.inside_tensor():
            where = f"a block at {list(b.offsets)} of size {list(b.lengths)}"
            raise LayoutError(f"{name}: {where} lies outside its shape {list(shape)}")
    pieces = [b for b in blocks if b.numel]
    if len(pieces) > 1:
        a, b = _first_overlap(pieces)
        if a is not None:
            raise LayoutError(f"{name}: blocks at {list(a.offsets)} and {list(b.offsets)} overlap")
    covered = sum(b.numel for b in blocks)
    if covered != math.prod(shape):
        raise LayoutError(
            f"{name}: the rank files hold {covered} of its {math.prod(shape)} elements: a rank file is missing "
            "or belongs to another checkpoint"
        )


def _first_overlap(blocks: list[Fragment]) -> tuple[Fragment, Fragment] | tuple[None, None]:
    """Runs of the flattened tensor (flat fragments, contiguous blocks) are sorted and compared with their
    neighbour; other blocks are swept along the dimension where their offsets vary most."""
    starts = [b.flat_start() for b in blocks]
    if all(s is not None for s in starts):
        ordered = sorted(zip(starts, blocks, strict=True), key=lambda sb: sb[0])
        for (s, a), (t, b) in zip(ordered, ordered[1:], strict=False):
            if t < s + a.numel:
                return a, b
        return None, None
    if any(b.flat for b in blocks):
        raise LayoutError(f"{blocks[0].name}: flat element ranges mixed with blocks that are not contiguous")
    if (found := _grid_overlap(blocks)) is not False:
        return found
    shape = blocks[0].global_shape
    dim = max(range(len(shape)), key=lambda d: len({b.offsets[d] for b in blocks}))
    ordered = sorted(blocks, key=lambda b: b.offsets[dim])
    for i, a in enumerate(ordered):
        for b in ordered[i + 1 :]:
            if b.offsets[dim] >= a.offsets[dim] + a.lengths[dim]:
                break
            if a.overlaps(b):
                return a, b
    return None, None


CELLS_PER_BLOCK = 8  # the grid check's budget; layouts that need more cells are swept pairwise


def _grid_overlap(blocks: list[Fragment]) -> tuple[Fragment, Fragment] | tuple[None, None] | bool:
    """Blocks placed on the grid their own edges cut: two blocks overlap iff they share a cell. Trainers'
    layouts (per-dimension splits, DCP chunk grids) give one cell per block, so this is O(n log n) where the
    pairwise sweep is quadratic on a 3-D grid. False when the blocks would need more than the budget."""
    ndim = len(blocks[0].global_shape)
    cuts = [{v: i for i, v in enumerate(sorted({b.offsets[d] for b in blocks} |
                                                {b.offsets[d] + b.lengths[d] for b in blocks}))} for d in range(ndim)]
    budget, owner = CELLS_PER_BLOCK * len(blocks), {}
    for b in blocks:
        ranges = [range(cuts[d][b.offsets[d]], cuts[d][b.offsets[d] + b.lengths[d]]) for d in range(ndim)]
        budget -= math.prod(len(r) for r in ranges)
        if budget < 0:
            return False
        for cell in product(*ranges):
            if (other := owner.setdefault(cell, b)) is not b:
                return other, b
    return None, None

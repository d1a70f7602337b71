"""Where each parameter's fp32 master elements sit in DeepSpeed ZeRO's per-rank partitions: pure arithmetic.

Stages 1 and 2, and BF16_Optimizer (deepspeed/runtime/zero/stage_1_and_2.py, runtime/bf16_optimizer.py):

    group g, all ranks:  [ p0 | pad0 | p1 | pad1 | ... | pN | tail ]        params in param_shapes order,
                          <------------- padded to a multiple of 2*W ------------->   each followed by its
    rank r holds         [ r*P, r*P + L_r )      P = padded / W                       param_alignment_paddings
                                                                                     zeros (none for the last)
    ZeRO-1/2 strip the padding that falls in a rank's partition on save (group_paddings); BF16_Optimizer
    keeps it. Either way rank r's slice starts at r*P: a parameter may start in one rank's slice and end in
    the next, and a slice may start mid-row.

Stage 3 (deepspeed/runtime/zero/stage3.py, partitioned_param_data): every parameter is split on its own:

    pn = ceil(numel / W); rank r holds elements [r*pn, (r+1)*pn) of it, the last zero-padded,
    and its fp32 sub-groups concatenated give [ p0's piece | p1's piece | ... ] in param_shapes order.

A piece is (parameter, first element in the parameter, count, first element in the rank's flat buffer).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

START_ALIGNMENT = 2  # nccl_start_alignment_factor: each group is padded to a multiple of 2 * W elements


@dataclass(frozen=True)
class Piece:
    name: str
    start: int  # first element of the parameter held here
    count: int
    local: int  # first element in the rank's flat buffer


def group_starts(numels: list[int], paddings: list[int]) -> tuple[list[int], int]:
    """Each parameter's first element in the group's flat buffer, and the buffer's padded length for W=1
    (the caller aligns it to 2*W)."""
    starts, at = [], 0
    for numel, pad in zip(numels, paddings, strict=True):
        starts.append(at)
        at += numel + pad
    return starts, at


def partition_size(padded_numel: int, world: int) -> int:
    alignment = START_ALIGNMENT * world
    return math.ceil(padded_numel / alignment) * alignment // world


def flat_pieces(names: list[str], numels: list[int], paddings: list[int], rank: int, world: int,
                length: int) -> list[Piece]:
    """Stages 1-2: the pieces of each parameter inside rank `rank`'s saved slice of `length` elements."""
    starts, padded = group_starts(numels, paddings)
    size = partition_size(padded, world)
    begin, end = rank * size, rank * size + length
    pieces = []
    for name, start, numel in zip(names, starts, numels, strict=True):
        lo, hi = max(start, begin), min(start + numel, end)
        if lo < hi:
            pieces.append(Piece(name=name, start=lo - start, count=hi - lo, local=lo - begin))
    return pieces


def stage3_pieces(names: list[str], numels: list[int], rank: int, world: int) -> tuple[list[Piece], int]:
    """Stage 3: each parameter's piece on `rank`, and the flat length all ranks hold (padding included)."""
    pieces, local = [], 0
    for name, numel in zip(names, numels, strict=True):
        per = math.ceil(numel / world)
        count = max(0, min(per, numel - rank * per))
        if count:
            pieces.append(Piece(name=name, start=rank * per, count=count, local=local))
        local += per
    return pieces, local

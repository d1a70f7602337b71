"""Exchange: move fragment bytes from the rank that read them to the rank that owns their unit.

One round = one all_to_all_single of packed uint8 buffers (gloo on CPU, NCCL on GPU). Sender and
receiver derive the same fragment order from the plan, so no sizes or names travel with the bytes.
Each fragment sits in an 8-byte aligned slot, so the receiver can view it as any dtype in place.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch

from distmerge import dtypes
from distmerge.comm import Comm
from distmerge.formats.base import Fragment
from distmerge.plan import Plan
from distmerge.reader import Reader


@dataclass(frozen=True)
class Move:
    frag: Fragment
    reader: int
    owner: int


def frag_bytes(frag: Fragment) -> int:
    return frag.numel * dtypes.itemsize(frag.dtype)


def slot(nbytes: int) -> int:
    return (nbytes + 7) & ~7


def moves(plan: Plan, units: tuple[int, ...]) -> list[Move]:
    """Every fragment the round's units need, with who reads it and who assembles it (plan order)."""
    out = []
    for i in units:
        owner = plan.owner_of_unit[i]
        for name in plan.units[i].sources:
            for frag in plan.sources[name].fragments:
                out.append(Move(frag, plan.readers[frag.file_index], owner))
    return out


def exchange(plan: Plan, units: tuple[int, ...], comm: Comm, reader: Reader) -> dict[Fragment, torch.Tensor]:
    """Send what this rank read for others, return what others read for this rank (uint8 views)."""
    lanes: dict[tuple[int, int], list[Fragment]] = defaultdict(list)
    for m in moves(plan, units):
        if m.reader != m.owner:
            lanes[(m.reader, m.owner)].append(m.frag)
    if not lanes:
        return {}
    me, world = comm.rank, comm.world
    outgoing = [lanes.get((me, d), []) for d in range(world)]
    incoming = [lanes.get((s, me), []) for s in range(world)]
    send_splits = [sum(slot(frag_bytes(f)) for f in frags) for frags in outgoing]
    recv_splits = [sum(slot(frag_bytes(f)) for f in frags) for frags in incoming]

    def pack() -> torch.Tensor:
        buf = torch.empty(sum(send_splits), dtype=torch.uint8)
        at = 0
        for frags in outgoing:
            for f in frags:
                reader.read_into(f, buf[at : at + frag_bytes(f)])
                at += slot(frag_bytes(f))
        return buf

    send = comm.agree(pack)  # a failed read on any rank stops everyone here, before the collective
    recv = comm.all_to_all(send.to(comm.device), send_splits, recv_splits)
    received, at = {}, 0
    for frags in incoming:
        for f in frags:
            received[f] = recv[at : at + frag_bytes(f)]
            at += slot(frag_bytes(f))
    return received

"""Exchange: move fragment bytes from the rank that read them to the rank that owns their unit.

One round = one all_to_all_single of packed uint8 buffers (gloo on CPU, NCCL on GPU), started
asynchronously: the engine starts round k+1 before it assembles round k, so readers pack the next
round while owners write this one, and owners copy their local fragments while the bytes travel.
Sender and receiver derive the same fragment order from the plan, so no sizes or names travel with
the bytes. Each fragment sits in an 8-byte aligned slot, so the receiver can view it as any dtype in
place. Two sets of buffers alternate between rounds (one in flight, one being assembled) and are kept:
their pages are faulted in once.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch

from distmerge.comm import Comm
from distmerge.formats.base import Fragment
from distmerge.plan import Plan
from distmerge.reader import Reader


def slot(nbytes: int) -> int:
    return (nbytes + 7) & ~7


def lanes(plan: Plan, units: tuple[int, ...]) -> dict[tuple[int, int], list[Fragment]]:
    """(reader, owner) -> fragments that cross ranks this round, in plan order."""
    out: dict[tuple[int, int], list[Fragment]] = defaultdict(list)
    for i in units:
        owner = plan.owner_of_unit[i]
        for name in plan.units[i].sources:
            for frag in plan.sources[name].fragments:
                reader = plan.readers[frag.file_index]
                if reader != owner:
                    out[(reader, owner)].append(frag)
    return out


def held_back(plan: Plan, units: tuple[int, ...], me: int, reader: Reader) -> list[Fragment]:
    """The fragments this rank reads for its own units this round that come from an object store: read with the
    round's packing, in the same GETs (reads.py: a round's fragments of one object lie mostly side by side, the
    owners' interleaved), and held until the round is assembled, as if received from this rank. A local file's
    are read when the round is assembled (assemble.py), straight into their place."""
    return [frag for i in units if plan.owner_of_unit[i] == me for name in plan.units[i].sources
            for frag in plan.sources[name].fragments if plan.readers[frag.file_index] == me and reader.remote(frag)]


@dataclass
class Pending:
    """An exchange in flight; `wait` returns what other ranks read for this one (uint8 views), and what this rank
    read for itself with the packing (`held`)."""

    work: object
    recv: torch.Tensor | None
    incoming: list[list[Fragment]]
    failed: BaseException | None = None  # this rank's packing error, raised once the collective is done
    held: dict[Fragment, torch.Tensor] = field(default_factory=dict)

    def drain(self) -> None:
        """Let the collective finish (every rank started it), whatever this rank's packing did."""
        if self.work is not None:
            self.work.wait()
            self.work = None

    def wait(self) -> dict[Fragment, torch.Tensor]:
        self.drain()
        if self.failed is not None:
            raise self.failed
        received, at = dict(self.held), 0
        for frags in self.incoming:
            for f in frags:
                received[f] = self.recv[at : at + f.nbytes]
                at += slot(f.nbytes)
        return received


class Exchanger:
    def __init__(self, plan: Plan, comm: Comm, reader: Reader) -> None:
        self.plan, self.comm, self.reader = plan, comm, reader
        self._send = [torch.empty(0, dtype=torch.uint8)] * 2
        self._recv = [torch.empty(0, dtype=torch.uint8, device=comm.device)] * 2
        self._held = [torch.empty(0, dtype=torch.uint8)] * 2

    def start(self, units: tuple[int, ...], slot_set: int = 0) -> Pending:
        """Pack what this rank read for others and start sending, in buffer set `slot_set` (0 or 1: the
        other set may still be in use by the previous round). Collective: every rank calls it."""
        crossing = lanes(self.plan, units)
        me, world = self.comm.rank, self.comm.world
        own = held_back(self.plan, units, me, self.reader)
        if not crossing and not own:
            return Pending(None, None, [])
        outgoing = [crossing.get((me, d), []) for d in range(world)]
        incoming = [crossing.get((s, me), []) for s in range(world)]
        send_splits = [sum(slot(f.nbytes) for f in frags) for frags in outgoing]
        recv_splits = [sum(slot(f.nbytes) for f in frags) for frags in incoming]
        # No collective before sending: a rank whose read fails still sends (garbage of the planned size)
        # and raises at wait(), inside the round's gather, where every rank learns of it. So owners start
        # writing round k while readers are still packing round k+1.
        failed, held = None, {}
        try:
            send, held = self._pack(outgoing, sum(send_splits), own, slot_set)
        except Exception as err:
            failed = err
            send = torch.zeros(sum(send_splits), dtype=torch.uint8)
        if not crossing:  # the same on every rank (the plan's): no collective this round
            return Pending(None, None, [], failed, held)
        recv = self._recv_buffer(sum(recv_splits), slot_set)
        work = self.comm.all_to_all_async(recv, send.to(self.comm.device), send_splits, recv_splits)
        return Pending(work, recv, incoming, failed, held)

    def _pack(self, outgoing: list[list[Fragment]], total: int, own: list[Fragment],
              slot_set: int) -> tuple[torch.Tensor, dict[Fragment, torch.Tensor]]:
        buf = self._buffer(self._send, total, slot_set)
        hold = self._buffer(self._held, sum(slot(f.nbytes) for f in own), slot_set)
        reads, at = self.reader.batch(), 0  # an object-store input: neighbouring fragments in one GET (reads.py)
        for frags in outgoing:
            for f in frags:
                reads.read_into(f, buf[at : at + f.nbytes])
                at += slot(f.nbytes)
        held, at = {}, 0
        for f in own:
            held[f] = hold[at : at + f.nbytes]
            reads.read_into(f, held[f])
            at += slot(f.nbytes)
        reads.run()
        return buf, held

    @staticmethod
    def _buffer(kept: list[torch.Tensor], total: int, slot_set: int) -> torch.Tensor:
        if kept[slot_set].numel() < total:
            kept[slot_set] = torch.empty(total, dtype=torch.uint8)
        return kept[slot_set][:total]

    def _recv_buffer(self, total: int, slot_set: int) -> torch.Tensor:
        if self._recv[slot_set].numel() < total:
            self._recv[slot_set] = torch.empty(total, dtype=torch.uint8, device=self.comm.device)
        return self._recv[slot_set][:total]

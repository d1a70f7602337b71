"""Exchange: move fragment bytes from the rank that read them to the rank that owns their unit.

One round = one all_to_all_single of packed uint8 buffers (gloo on CPU, NCCL on GPU), started
asynchronously: the engine starts round k+1 before it assembles round k, so readers pack the next
round while owners write this one, and owners copy their local fragments while the bytes travel.
Sender and receiver derive the same fragment order from the plan, so no sizes or names travel with
the bytes. Each fragment sits in an 8-byte aligned slot, so the receiver can view it as any dtype in
place. Two sets of buffers alternate between rounds (one in flight, one being assembled) and are kept:
their pages are faulted in once.

An exchanger made with `send_sets=1` (verify) keeps one send buffer: before packing round k+1 it waits for round
k's collective to finish (drain; it has had the whole of round k-1's assembly to travel), so round k+1 reuses the
buffer round k went out from. That saves a round's outgoing bytes per rank, at the cost of round k's transfer no
longer overlapping the packing of round k+1 and the local part of round k: worth it where assembling a round takes
longer than its transfer (verify computes figures over every block), not for merge, whose rounds are copies.
Measured on the 0.78 GB bench checkpoint, 2 processes: verify's peak 446 MB per rank instead of 511 (merge: 508),
its own timer the same within noise (docs/benchmarks.md, "verify of a checkpoint").
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch

from distmerge.distributed.comm import Comm
from distmerge.engine.plan import Plan
from distmerge.engine.reader import Reader
from distmerge.formats.base import Fragment

Brought = tuple[tuple[int, tuple[str, ...]], ...]  # a round's units, each with the sources it brings (Plan.brings)


def slot(nbytes: int) -> int:
    return (nbytes + 7) & ~7


def lanes(plan: Plan, brought: Brought) -> dict[tuple[int, int], list[Fragment]]:
    """(reader, owner) -> fragments that cross ranks this round (`brought`: plan.brings(k)), in plan order."""
    out: dict[tuple[int, int], list[Fragment]] = defaultdict(list)
    for i, names in brought:
        owner = plan.owner_of_unit[i]
        for name in names:
            for frag in plan.sources[name].fragments:
                reader = plan.readers[frag.file_index]
                if reader != owner:
                    out[(reader, owner)].append(frag)
    return out


def held_back(plan: Plan, brought: Brought, me: int, reader: Reader) -> list[Fragment]:
    """The fragments this rank reads for its own units this round that come from an object store: read with the
    round's packing, in the same GETs (reads.py: a round's fragments of one object lie mostly side by side, the
    owners' interleaved), and held until the round is assembled, as if received from this rank. A local file's
    are read when the round is assembled (assemble.py), straight into their place."""
    return reader.with_packing(frag for i, names in brought if plan.owner_of_unit[i] == me for name in names
                               for frag in plan.sources[name].fragments if plan.readers[frag.file_index] == me)


@dataclass
class Pending:
    """An exchange in flight; `wait` returns what other ranks read for this one (uint8 views); `held`: what this
    rank read for its own units with the packing (an object-store input: exchange.held_back), by fragment."""

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

    def wait(self) -> Received:
        self.drain()
        if self.failed is not None:
            raise self.failed
        return Received(self.recv, self.incoming)


class Received:
    """What other ranks read for this one. `take(reader, frag)` gives the next fragment from that reader: the owner
    asks for its fragments in the order lanes() packed them (its units in plan order, their sources, their
    fragments), so each reader's part is walked with a cursor; no fragment is hashed to find its bytes (a
    1024-rank save sends half a million a rank). On the CPU the bytes come as memoryviews (cheaper to slice)."""

    def __init__(self, recv: torch.Tensor | None, incoming: list[list[Fragment]]) -> None:
        sizes = [sum(slot(f.nbytes) for f in frags) for frags in incoming]
        self.at = [sum(sizes[:r]) for r in range(len(sizes))]
        self.ends = [a + n for a, n in zip(self.at, sizes, strict=True)]
        cpu = recv is not None and recv.device.type == "cpu" and recv.numel() > 0
        self.buf: memoryview | torch.Tensor | None = memoryview(recv.numpy()).cast("B") if cpu else recv

    def take(self, reader: int, frag: Fragment) -> memoryview | torch.Tensor:
        at = self.at[reader]
        if self.buf is None or at + frag.nbytes > self.ends[reader]:
            raise AssertionError(f"rank {reader} sent fewer bytes than the plan says (at {frag.key})")
        self.at[reader] = at + slot(frag.nbytes)
        return self.buf[at : at + frag.nbytes]


class Exchanger:
    def __init__(self, plan: Plan, comm: Comm, reader: Reader, send_sets: int = 2) -> None:
        assert send_sets in (1, 2)
        self.plan, self.comm, self.reader, self.send_sets = plan, comm, reader, send_sets
        self._send = [torch.empty(0, dtype=torch.uint8)] * 2
        self._recv = [torch.empty(0, dtype=torch.uint8, device=comm.device)] * 2
        self._last: Pending | None = None  # the round started last: still in flight when the next one is packed
        self._held = [torch.empty(0, dtype=torch.uint8)] * 2

    def start(self, brought: Brought, slot_set: int = 0) -> Pending:
        """Pack what this rank read for others of a round (`brought`: plan.brings(k)) and start sending, in buffer
        set `slot_set` (0 or 1: the other set may still be in use by the previous round). Collective: every rank
        calls it."""
        if self.send_sets == 1 and self._last is not None and self.comm.device.type == "cpu":
            self._last.drain()  # its bytes have left the one send buffer (on a GPU they left it for a device copy)
        self._last = self._start(brought, slot_set)
        return self._last

    def _start(self, brought: Brought, slot_set: int) -> Pending:
        crossing = lanes(self.plan, brought)
        me, world = self.comm.rank, self.comm.world
        own = held_back(self.plan, brought, me, self.reader)
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
            send, held = self._pack(outgoing, sum(send_splits), own, slot_set if self.send_sets == 2 else 0,
                                    slot_set)
        except Exception as err:
            failed = err
            send = torch.zeros(sum(send_splits), dtype=torch.uint8)
        if not crossing:  # the same on every rank (the plan's): no collective this round
            return Pending(None, None, [], failed, held)
        recv = self._recv_buffer(sum(recv_splits), slot_set)
        work = self.comm.all_to_all_async(recv, send.to(self.comm.device), send_splits, recv_splits)
        return Pending(work, recv, incoming, failed, held)

    def _pack(self, outgoing: list[list[Fragment]], total: int, own: list[Fragment], slot_set: int,
              held_set: int) -> tuple[torch.Tensor, dict[Fragment, torch.Tensor]]:
        buf = self._buffer(self._send, total, slot_set)
        # one batch of the source's read policy (input/reads.py): a folder's small fragments that touch in one
        # read each (Reader.fill), an object's neighbouring fragments in one GET, the owner's own among them
        reads, at = self.reader.batch(), 0
        view = memoryview(buf.numpy()).cast("B") if total else memoryview(b"")
        for frags in outgoing:
            for f in frags:
                reads.fill(f, view[at : at + f.nbytes])
                at += slot(f.nbytes)
        held: dict[Fragment, torch.Tensor] = {}
        if own:
            hold, at = self._buffer(self._held, sum(slot(f.nbytes) for f in own), held_set), 0
            for f in own:
                held[f] = hold[at : at + f.nbytes]
                reads.fill(f, held[f])
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

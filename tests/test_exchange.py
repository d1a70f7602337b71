"""exchange.Exchanger's send buffers: with `send_sets=1` (verify) every round goes out from one buffer, and round
k+1 is packed into it only once round k's collective is done; with two sets (merge) round k+1 goes out from the
other buffer while round k still travels.

A collective's bytes are taken when it completes (the fake work below copies the send buffer at `wait`, as gloo
may read it any time until then): packing round k+1 over a buffer still in flight would deliver round k+1's bytes
as round k's. The plan, reader and group are stand-ins (two ranks in one process): what is tested is the order of
packing and waiting, which no real input controls."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from distmerge.engine.exchange import Exchanger
from distmerge.formats.base import Fragment

ROUNDS = 4
NUMEL = 1000  # F32: 4,000 bytes a round


class Work:
    def __init__(self, send: torch.Tensor, delivered: list[bytes]) -> None:
        self.send, self.delivered, self.done = send, delivered, False

    def wait(self) -> None:
        assert not self.done
        self.delivered.append(bytes(self.send.numpy()))  # what the other rank receives
        self.done = True


class Group:
    """Rank 0 of 2, on the CPU; records each collective's work and send buffer."""

    rank, world, device = 0, 2, torch.device("cpu")

    def __init__(self) -> None:
        self.works: list[Work] = []
        self.delivered: list[bytes] = []
        self.buffers: list[int] = []

    def all_to_all_async(self, recv, send, send_splits, recv_splits) -> Work:
        self.buffers.append(send.data_ptr())
        self.works.append(Work(send, self.delivered))
        return self.works[-1]


class Reader:
    """Fills fragment k (file k) with the byte k + 1: each round's bytes tell which round they are."""

    def with_packing(self, frags) -> list:  # a folder's read policy (input/local.py): none read with the packing
        return []

    def batch(self):  # ... and its batch (input/reads.FileBatch): the exchange packs with fill
        from distmerge.input.reads import FileBatch

        return FileBatch(self)

    def read_into(self, frag: Fragment, out: torch.Tensor) -> None:
        out.fill_(frag.file_index + 1)

    def fill(self, pairs) -> None:  # the exchange's call (reader.Reader.fill): each fragment into its destination
        for frag, dest in pairs:
            out = dest if isinstance(dest, torch.Tensor) else torch.frombuffer(dest, dtype=torch.uint8)
            self.read_into(frag, out)


def plan() -> SimpleNamespace:
    """Round k: unit k, owned by rank 1, one fragment in file k, read by rank 0: rank 0 sends it all."""
    frags = [Fragment(name=f"t{k}", dtype="F32", global_shape=(NUMEL,), offsets=(0,), lengths=(NUMEL,), file_index=k,
                      byte_offset=0, key=f"t{k}") for k in range(ROUNDS)]
    return SimpleNamespace(owner_of_unit=[1] * ROUNDS, readers=[0] * ROUNDS,
                           units=[SimpleNamespace(sources=(f"t{k}",)) for k in range(ROUNDS)],
                           sources={f"t{k}": SimpleNamespace(fragments=[f]) for k, f in enumerate(frags)})


def brings(k: int) -> tuple:
    """Round k of plan() as the engine hands it to the exchange (Plan.brings): unit k, bringing its one source."""
    return ((k, (f"t{k}",)),)


def run(send_sets: int) -> Group:
    """The engine's order (engine.run_in_lockstep): round k+1 started before round k is waited for."""
    group = Group()
    ex = Exchanger(plan(), group, Reader(), send_sets=send_sets)
    pending = ex.start(brings(0), 0)
    for k in range(ROUNDS):
        ahead = ex.start(brings(k + 1), (k + 1) % 2) if k + 1 < ROUNDS else None
        pending.wait()
        pending = ahead
    return group


@pytest.mark.parametrize("send_sets", [1, 2])
def test_every_round_delivers_its_own_bytes(send_sets):
    group = run(send_sets)
    assert group.delivered == [bytes([k + 1]) * NUMEL * 4 for k in range(ROUNDS)]


def test_one_send_set_sends_every_round_from_one_buffer_once_the_last_is_done():
    group = run(send_sets=1)
    assert len(set(group.buffers)) == 1
    group = Group()
    ex = Exchanger(plan(), group, Reader(), send_sets=1)
    ex.start(brings(0), 0)
    assert not group.works[0].done
    ex.start(brings(1), 1)  # packs into round 0's buffer: round 0 has to be done first
    assert group.works[0].done and not group.works[1].done


def test_two_send_sets_alternate_and_do_not_wait():
    group = run(send_sets=2)
    assert len(set(group.buffers)) == 2 and group.buffers[0] == group.buffers[2] != group.buffers[1]
    group = Group()
    ex = Exchanger(plan(), group, Reader(), send_sets=2)
    ex.start(brings(0), 0)
    ex.start(brings(1), 1)
    assert not group.works[0].done  # merge: round 0 still travels while round 1 is packed

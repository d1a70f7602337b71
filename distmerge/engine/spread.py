"""Spreading the writing of output files over several ranks of a host, when whole files cannot balance it.

Files are cut by size alone (the output must be byte-identical whatever the number of processes), so whole
files often balance badly: one 0.8 GB model.safetensors at N=2 leaves one rank idle; 275 files of 5 GB over 64
ranks put 17% more than the mean on the busiest rank. Then the plan (pure, the same on every rank):

    1. gives each file to a host: largest first, onto the host with the fewest bytes per rank;
    2. within a host, gives each unit to a rank: largest first, onto the rank that reads most of the unit's
       bytes among those still under the host's mean, else onto the least loaded (so a unit is mostly
       written where it was read, and what crosses ranks is what locality cannot avoid);
    3. makes the writer with the most bytes of a file its owner.

A file whose units land on several ranks is *shared*: its owner creates it (header, full size) before the
first round, each writer writes its own units, and the owner commits it once every part is durable (sink.py).
Which ranks may share a file is the output store's to say (output/store.Sharing), and the engine hands it over as
`hosts`: a local folder lets the ranks of one host share (processes writing disjoint ranges of one file through
one page cache is what every local filesystem supports, while across nodes it would hang on the coherence of the
shared filesystem: NFS clients cache and flush pages on their own); an object store lets any ranks share, but
each writer's run of consecutive bytes becomes one or more parts of one multipart upload, and every part but the
last must be at least 5 MiB: `min_run`. Then

    4. a run shorter than `min_run` (but the file's last) takes the units that follow it, one at a time, until
       it is long enough; a file that does not settle goes whole to its owner.
"""

from __future__ import annotations

import heapq
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

from distmerge.families.base import Unit

TOLERANCE = 0.05  # whole files are kept when the busiest rank writes at most this much above the mean


def balanced(loads: Sequence[int], tolerance: float = TOLERANCE) -> bool:
    mean = sum(loads) / len(loads)
    return max(loads) <= mean * (1 + tolerance)


def spread(units: Sequence[Unit], groups: Sequence[Sequence[int]], unit_bytes: Sequence[int],
           local: Sequence[dict[int, int]], hosts: Sequence[int], min_run: int = 0,
           key: Callable[[str], Any] = str, host_of_file: Sequence[int] | None = None) -> tuple[list[int], list[int]]:
    """(owner of each unit, owner of each file). `groups[f]` = the units of file f, `local[u]` = {rank: bytes of
    unit u's sources that rank reads}, `hosts[r]` = the host of rank r (any hashable numbering); `min_run`: the
    shortest run of bytes a writer may have (but a file's last), `key`: the order of target names in a file;
    `host_of_file`: step 1 made already (an input on the nodes' own disks: each file on the node of its reads)."""
    ranks_of: dict[int, list[int]] = defaultdict(list)
    for rank, host in enumerate(hosts):
        ranks_of[host].append(rank)
    file_bytes = [sum(unit_bytes[u] for u in g) for g in groups]
    host_of_file = list(host_of_file) if host_of_file is not None else _files_to_hosts(file_bytes, ranks_of)
    owner_of_unit = [0] * len(units)
    for host, ranks in ranks_of.items():
        mine = [u for f, g in enumerate(groups) if host_of_file[f] == host for u in g]
        for u, rank in _units_to_ranks(mine, unit_bytes, local, ranks).items():
            owner_of_unit[u] = rank
    if min_run:
        for g in groups:
            _long_runs(units, g, owner_of_unit, min_run, key)
    return owner_of_unit, [_file_owner(g, unit_bytes, owner_of_unit) for g in groups]


def writer_runs(pieces: Sequence[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(start, end, writer) of the longest runs of consecutive pieces (nbytes, writer) that one writer writes, in
    data bytes; pieces of no bytes belong to no run."""
    runs: list[tuple[int, int, int]] = []
    at = 0
    for nbytes, writer in pieces:
        if nbytes and runs and runs[-1][2] == writer:
            runs[-1] = (runs[-1][0], at + nbytes, writer)
        elif nbytes:
            runs.append((at, at + nbytes, writer))
        at += nbytes
    return runs


def _long_runs(units: Sequence[Unit], group: Sequence[int], owner_of_unit: list[int], min_run: int,
               key: Callable[[str], Any]) -> None:
    """Step 4: a run shorter than min_run (but the file's last) goes to the writer of the run before it when its
    own writer has at least as many of the file's bytes, else takes the unit that follows it (or goes to the next
    run's writer if that one has fewer bytes): runs of about min_run alternate where units were small, and the
    writers stay close to even. A unit's targets need not be neighbours in the file (QKV's q, k, v around
    o_proj), so a move may cut another run: past two moves per unit, the file goes whole to one writer."""
    order = sorted(((t.name, t.nbytes, i) for i in group for t in units[i].targets if t.nbytes),
                   key=lambda p: key(p[0]))
    for _ in range(2 * len(group) + 1):
        found = _short_run(order, owner_of_unit, min_run)
        if found is None:
            return
        start, end = found
        writer, after = owner_of_unit[order[start][2]], owner_of_unit[order[end][2]]
        load: dict[int, int] = defaultdict(int)
        for _, nbytes, i in order:
            load[owner_of_unit[i]] += nbytes
        before = owner_of_unit[order[start - 1][2]] if start else None
        if before is not None and load[writer] >= load[before]:
            _give(order[start:end], owner_of_unit, before)
        elif load[writer] > load[after]:
            _give(order[start:end], owner_of_unit, after)
        else:
            owner_of_unit[order[end][2]] = writer
    whole = _file_owner(group, [sum(t.nbytes for t in u.targets) for u in units], owner_of_unit)
    for i in group:
        owner_of_unit[i] = whole


def _give(pieces: list[tuple[str, int, int]], owner_of_unit: list[int], writer: int) -> None:
    for _, _, unit in pieces:
        owner_of_unit[unit] = writer


def _short_run(order: list[tuple[str, int, int]], owner_of_unit: list[int], min_run: int) -> tuple[int, int] | None:
    """(first, end) positions in `order` of the first run shorter than min_run that is not the file's last."""
    length, begin = 0, 0
    for at, (_, nbytes, unit) in enumerate(order):
        if at and owner_of_unit[unit] != owner_of_unit[order[at - 1][2]]:
            if length < min_run:
                return begin, at
            length, begin = 0, at
        length += nbytes
    return None


def _files_to_hosts(file_bytes: list[int], ranks_of: dict[int, list[int]]) -> list[int]:
    """Largest file first onto the host with the fewest bytes per rank (ties: the host of the lowest rank)."""
    heap = [(0.0, ranks[0], host) for host, ranks in ranks_of.items()]
    heapq.heapify(heap)
    loads = dict.fromkeys(ranks_of, 0)
    host_of = [0] * len(file_bytes)
    for f in sorted(range(len(file_bytes)), key=lambda f: (-file_bytes[f], f)):
        _, first, host = heapq.heappop(heap)
        host_of[f] = host
        loads[host] += file_bytes[f]
        heapq.heappush(heap, (loads[host] / len(ranks_of[host]), first, host))
    return host_of


def _units_to_ranks(mine: list[int], unit_bytes: Sequence[int], local: Sequence[dict[int, int]],
                    ranks: list[int]) -> dict[int, int]:
    """Largest unit first: onto the rank reading most of it while that rank stays under the mean, else onto
    the least loaded rank (the usual largest-first bound: no rank ends more than one unit above the mean)."""
    mean = sum(unit_bytes[u] for u in mine) / len(ranks)
    load = dict.fromkeys(ranks, 0)
    heap = [(0, r) for r in ranks]  # (load, rank), entries go stale when a rank is chosen for locality
    chosen: dict[int, int] = {}
    for u in sorted(mine, key=lambda u: (-unit_bytes[u], u)):
        size = unit_bytes[u]
        near = [(-nbytes, load[r], r) for r, nbytes in local[u].items() if r in load and load[r] + size <= mean]
        if near:
            rank = min(near)[2]
        else:
            while heap[0][0] != load[heap[0][1]]:  # drop stale entries
                heapq.heappop(heap)
            rank = heap[0][1]
        chosen[u] = rank
        load[rank] += size
        heapq.heappush(heap, (load[rank], rank))
    return chosen


def _file_owner(group: Sequence[int], unit_bytes: Sequence[int], owner_of_unit: list[int]) -> int:
    """The writer with the most bytes of the file (ties: the lowest rank) creates, renames and records it."""
    share: dict[int, int] = defaultdict(int)
    for u in group:
        share[owner_of_unit[u]] += unit_bytes[u]
    return min(share, key=lambda r: (-share[r], r))

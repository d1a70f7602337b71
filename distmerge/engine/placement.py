"""Where the ranks are when a checkpoint lies on the nodes' own disks (engine/nodes.py): which ranks may read each
input file (those of a node that holds it), and which may own each output file (near its reads, so that as few bytes
cross nodes as the layout allows). Pure, as the rest of the plan."""

from __future__ import annotations

from dataclasses import dataclass

from distmerge.formats.base import InputFile


@dataclass(frozen=True, kw_only=True)
class Placement:
    """Where the ranks are, for a checkpoint on the nodes' own disks (input/nodes.py): each rank's node, and per
    input file the ranks of the nodes that hold it (() where any rank may read it)."""

    node_of_rank: tuple[int, ...]
    may_read: tuple[tuple[int, ...], ...]
    # the nodes whose ranks may own the output files (() any): verify compares each target where its reference lies
    may_own: tuple[int, ...] = ()


def readers_on_holders(files: tuple[InputFile, ...], world: int, placement: Placement) -> tuple[int, ...]:
    """plan.assign_readers among the ranks that may read each file: the least-loaded of them under the count, else the
    least-loaded of them (a node holding more files than its share reads them all)."""
    readers, loads, count = [0] * len(files), [0] * world, [0] * world
    most = -(-len(files) // world) + 1
    for f in sorted(files, key=lambda f: (-f.read_weight, f.index)):
        allowed = placement.may_read[f.index] or range(world)
        under = [r for r in allowed if count[r] < most]
        rank = min(under or allowed, key=lambda r: (loads[r], r))
        readers[f.index] = rank
        loads[rank] += f.read_weight
        count[rank] += 1
    return tuple(readers)


NEAR = 0.9  # a node reading this share of what the node reading most of a file reads is as near (ties: balance)


def owners_near_reads(sizes: list[int], node_bytes: list[dict[int, int]], node_of_rank: tuple[int, ...],
                      may_own: tuple[int, ...] = ()) -> list[int]:
    """Largest file first onto the least-loaded rank of the nodes that read (about) most of its sources, so that as
    few bytes cross nodes as the layout allows: a file whose sources lie on one node is written there, one whose
    sources every node holds alike (FSDP's Shard(0): each tensor's rows over all ranks) goes where the load is least.
    `may_own`: only those nodes' ranks own files (of them, the nodes that read most of the file's sources)."""
    owners, loads = [0] * len(sizes), [0] * len(node_of_rank)
    allowed = set(may_own) or set(node_of_rank)
    for f in sorted(range(len(sizes)), key=lambda f: (-sizes[f], f)):
        reads = {n: b for n, b in node_bytes[f].items() if n in allowed}
        most = max(reads.values(), default=0)
        near = {n for n, b in reads.items() if b >= NEAR * most} if most else allowed
        ranks = [r for r, n in enumerate(node_of_rank) if n in near]
        owners[f] = min(ranks, key=lambda r: (loads[r], r))
        loads[owners[f]] += sizes[f]
    return owners

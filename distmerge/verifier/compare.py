"""Comparing two finished models (each rank, the merged files it owns): figures per tensor, both sides read a
block at a time (verifier/blocks.py), on the process group's device. An encoded weight (merge --quantize) is read a
block at a time too, with its scales, and compared decoded (bounded.py; a block of the reference's elements against
the stored values that hold them: half as many bytes for a 4-bit weight)."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from distmerge.distributed.comm import Comm
from distmerge.engine.nodes import Nodes
from distmerge.engine.plan import assign_owners
from distmerge.verifier.blocks import Running, Scratch, block_size
from distmerge.verifier.bounded import Bounded, bounded_running
from distmerge.verifier.listing import Listing, Pair
from distmerge.verifier.report import Check, Criteria
from distmerge.verifier.sides import Side, TensorFiles
from distmerge.verifier.stream import make_check


def assign_comparers(listing: Listing, nodes: Nodes | None, world: int) -> list[int | None]:
    """The rank that compares the pairs of each merged file, the largest files first onto the rank with the fewest
    bytes. On several nodes (sides on the nodes' own disks: Side.held), a rank of a node that holds the file and
    every reference file its pairs read; None where no node holds them all (rank 0 compares those, reading through
    the other nodes: run.py)."""
    if nodes is None or not (listing.merged.held or listing.reference.held):
        return list(assign_owners(list(listing.merged.sizes), world))
    everywhere = tuple(range(len(nodes.keys)))
    needs: list[set[int]] = [set() for _ in listing.merged.files]
    for p in listing.pairs:
        needs[listing.merged.tensors[p.merged_name].file].add(listing.reference.tensors[p.reference_name].file)
    comparers: list[int | None] = [None] * len(listing.merged.files)
    loads = [0] * world
    for i in sorted(range(len(listing.merged.files)), key=lambda i: (-listing.merged.sizes[i], i)):
        holding = set(_held(listing.merged, i, everywhere)).intersection(
            *(_held(listing.reference, r, everywhere) for r in needs[i]))
        ranks = [r for r in range(world) if nodes.of_rank[r] in holding]
        if ranks:
            comparers[i] = min(ranks, key=lambda r: (loads[r], r))
            loads[comparers[i]] += listing.merged.sizes[i]
    return comparers


def _held(side: Side, file: int, everywhere: tuple[int, ...]) -> tuple[int, ...]:
    return side.held[file] if side.held else everywhere


def check_mine(listing: Listing, crit: Criteria, comm: Comm, comparers: list[int | None], *,
               crossing: bool = False) -> list[Check]:
    """This rank's pairs (`crossing`: those no node holds all the files of, rank 0's while the nodes answer)."""
    me = None if crossing else comm.rank
    mine = [p for p in listing.pairs if comparers[listing.merged.tensors[p.merged_name].file] == me]
    merged, reference = TensorFiles(listing.merged), TensorFiles(listing.reference)
    try:
        scratch = Scratch()
        return [compare(p, merged, reference, crit, comm.device, scratch, listing) for p in mine]
    finally:
        merged.close()
        reference.close()


def compare(pair: Pair, merged: TensorFiles, reference: TensorFiles, crit: Criteria, device: torch.device,
            scratch: Scratch, listing: Listing) -> Check:
    """One pair, a block of each side at a time: neither tensor is ever whole in memory (an encoded weight's scales
    are, read with it: one per row or per 128 x 128 block, say)."""
    m, r = merged.side.tensors[pair.merged_name], reference.side.tensors[pair.reference_name]
    numel, step, per = math.prod(r.shape), block_size(device), pair.per
    run: Running | Bounded = Running(numel, device, *crit.band(), scratch)
    if pair.parts:
        run = bounded_running(pair, listing, [merged.get(n) for n in pair.parts], device, crit, scratch)
    for k, start in enumerate(range(0, numel, step)):
        count = min(step, numel - start)
        run.add(k, merged.read(pair.merged_name, start // per, count // per),
                reference.read(pair.reference_name, start, count))
    return make_check(pair, run, file=Path(merged.side.files[m.file]).name, crit=crit, shapes=(m.shape, r.shape),
                      dtypes_=(m.dtype, r.dtype))

"""Comparing two finished models (each rank, the merged files it owns): figures per tensor, both sides read a
block at a time (verifier/blocks.py), on the process group's device. An encoded weight (merge --quantize) is read a
block at a time too, with its scales, and compared decoded (bounded.py; a block of the reference's elements against
the stored values that hold them: half as many bytes for a 4-bit weight)."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from distmerge.distributed.comm import Comm
from distmerge.engine.plan import assign_owners
from distmerge.verifier.blocks import Running, Scratch, block_size
from distmerge.verifier.bounded import Bounded, bounded_running
from distmerge.verifier.listing import Listing, Pair
from distmerge.verifier.report import Check, Criteria
from distmerge.verifier.sides import TensorFiles
from distmerge.verifier.stream import make_check


def check_mine(listing: Listing, crit: Criteria, comm: Comm) -> list[Check]:
    owners = assign_owners(list(listing.merged.sizes), comm.world)
    mine = [p for p in listing.pairs if owners[listing.merged.tensors[p.merged_name].file] == comm.rank]
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

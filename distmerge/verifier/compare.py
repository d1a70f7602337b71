"""Comparing two finished models (each rank, the merged files it owns): figures per tensor, both sides read a
block at a time (verifier/blocks.py), on the process group's device. A quantized weight (merge --quantize) is read a
block at a time too, with its scales, and compared dequantized (fp8_compare.py; 4-bit: fp4_compare.py, a block of
the reference's elements against the bytes that hold them, half as many)."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from distmerge.distributed.comm import Comm
from distmerge.engine.plan import assign_owners
from distmerge.verifier.blocks import Running, Scratch, block_size
from distmerge.verifier.fp4_compare import fp4_running
from distmerge.verifier.fp8_compare import Fp8Running, fp8_running
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
    """One pair, a block of each side at a time: neither tensor is ever whole in memory (an FP8 weight's scales
    are, read with it: one per row or per 128 x 128 block)."""
    m, r = merged.side.tensors[pair.merged_name], reference.side.tensors[pair.reference_name]
    numel, step, per = math.prod(r.shape), block_size(device), pair.per
    run: Running | Fp8Running = Running(numel, device, *crit.band(), scratch)
    if pair.shared or per > 1:
        shared = merged.get(pair.shared) if pair.shared else None
        run = fp4_running(pair, listing, merged.get(pair.scale), shared, device, crit, scratch)
    elif pair.scale:
        run = fp8_running(pair, listing, merged.get(pair.scale), device, crit, scratch)
    for k, start in enumerate(range(0, numel, step)):
        count = min(step, numel - start)
        run.add(k, merged.read(pair.merged_name, start // per, count // per),
                reference.read(pair.reference_name, start, count))
    return make_check(pair, run, file=Path(merged.side.files[m.file]).name, crit=crit, shapes=(m.shape, r.shape),
                      dtypes_=(m.dtype, r.dtype))

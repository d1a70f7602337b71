"""Comparing (each rank, the merged files it owns): figures per tensor, on the process group's device."""

from __future__ import annotations

from pathlib import Path

import torch

from distmerge import dtypes
from distmerge.comm import Comm
from distmerge.plan import assign_owners
from distmerge.verify.listing import Listing, Pair
from distmerge.verify.report import Check, Criteria, Figures, judge
from distmerge.verify.sides import TensorFiles

# Elements per step of the figures: bounds the float64 temporaries (about 6 x 8 bytes per element). On the CPU
# 1 Mi (~50 MB of temporaries): with 4 Mi (~200 MB) a verify of the 0.05 GB bench checkpoint in memory peaked at
# 0.73 GB per process against merge's 0.30 GB; with 1 Mi at 0.44-0.49 GB (verify of the checkpoint, N=1).
CHUNK = {"cpu": 2**20, "cuda": 2**26}


def check_mine(listing: Listing, crit: Criteria, comm: Comm) -> list[Check]:
    owners = assign_owners(list(listing.merged.sizes), comm.world)
    mine = [p for p in listing.pairs if owners[listing.merged.tensors[p.merged_name].file] == comm.rank]
    merged, reference = TensorFiles(listing.merged), TensorFiles(listing.reference)
    try:
        return [compare(p, merged, reference, crit, comm.device) for p in mine]
    finally:
        merged.close()
        reference.close()


def compare(pair: Pair, merged: TensorFiles, reference: TensorFiles, crit: Criteria, device: torch.device) -> Check:
    file = Path(merged.side.files[merged.side.tensors[pair.merged_name].file]).name
    return compare_tensors(pair, merged.get(pair.merged_name), reference.get(pair.reference_name), file, crit, device)


def compare_tensors(pair: Pair, m: torch.Tensor, r: torch.Tensor, file: str, crit: Criteria,
                    device: torch.device) -> Check:
    """One pair's record: `m` the merged tensor (read from a merged file, or assembled in memory by verify of a
    checkpoint), `r` the reference's; `file` the merged file that holds (or would hold) `m`."""
    m, r = m.to(device), r.to(device)
    dtype, ref_dtype = dtypes.code_of(m.dtype), dtypes.code_of(r.dtype)
    cast = None
    if m.dtype != r.dtype:  # explicit, and said in the report: compare what the merged dtype can hold
        r, cast = r.to(m.dtype), f"{ref_dtype}->{dtype}"
    exact = torch.equal(m, r)
    figs = figures(m, r, *crit.band())
    passed, outcome, reason = judge(dtype=dtype, ref_dtype=ref_dtype, exact=exact, figs=figs, crit=crit)
    if pair.note and not passed:
        reason += f" (the merged model's head is {pair.merged_name}, tied)"
    return Check(
        name=pair.name, passed=passed, outcome=outcome, reason=reason, file=file,
        shape=tuple(m.shape), reference_shape=tuple(r.shape), dtype=dtype, reference_dtype=ref_dtype,
        cast=cast, bit_exact=exact, note=pair.note, figures=figs,
    )


def figures(m: torch.Tensor, r: torch.Tensor, atol: float, rtol: float) -> Figures:
    """All figures in one pass over fixed-size chunks. Accumulates in float64 on the CPU; float32 on a
    GPU, where float64 is slow and the sums are tree reductions anyway."""
    on_cpu = m.device.type == "cpu"
    acc = torch.float64 if on_cpu else torch.float32
    step = CHUNK["cpu" if on_cpu else "cuda"]
    a_all, b_all = m.reshape(-1), r.reshape(-1)
    n = a_all.numel()
    # max abs diff, max rel diff, max |ref|  |  sum |diff|, sum a*b, sum a*a, sum b*b
    peaks = torch.zeros(3, dtype=acc, device=m.device)
    sums = torch.zeros(4, dtype=acc, device=m.device)
    outside = torch.zeros((), dtype=torch.int64, device=m.device)
    for start in range(0, n, step):
        a, b = a_all[start : start + step].to(acc), b_all[start : start + step].to(acc)
        diff, ref_abs = (a - b).abs(), b.abs()
        rel = torch.where(ref_abs > 0, diff / ref_abs, 0)  # where, not indexing: no device sync
        peaks = torch.maximum(peaks, torch.stack([diff.max(), rel.max(), ref_abs.max()]))  # NaN propagates
        sums += torch.stack([diff.sum(), (a * b).sum(), (a * a).sum(), (b * b).sum()])
        outside += (~torch.isclose(a, b, rtol=rtol, atol=atol, equal_nan=True)).sum()
    (max_abs, max_rel, max_ref), (sum_abs, dot, aa, bb) = peaks.tolist(), sums.tolist()
    return Figures(max_abs=max_abs, max_rel=max_rel, mean_abs=sum_abs / max(n, 1), cosine=_cosine(dot, aa, bb),
                   max_ref=max_ref, outside=int(outside.item()))


def _cosine(dot: float, aa: float, bb: float) -> float:
    if aa == 0 or bb == 0:
        return 1.0 if aa == bb else 0.0  # both all-zero (fresh biases): the same as far as a model cares
    return max(-1.0, min(1.0, dot / (aa**0.5 * bb**0.5)))  # rounding can step just past 1


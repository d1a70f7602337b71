"""Comparing (each rank, the merged files it owns): figures per tensor, on the process group's device.

An FP8 weight (merge --quantize) is dequantized on the fly (q * scale, in float32, fp8.py) and judged against the
bound the recipe guarantees per element, not against --atol/--rtol:

    |q * scale - reference| <= 2^-4 |reference| + 2^-10 scale      (+ the cast to the model's dtype, when the
                                                                     reference is wider: bf16 adds 2^-9 |reference|)

It passes when every element is within it (and its cosine meets --min-cosine, when given); the record says how close
the worst element came: `fp8_bound`, the largest error / bound (<= 1 passes).
"""

from __future__ import annotations

from pathlib import Path

import torch

from distmerge import dtypes, fp8
from distmerge.comm import Comm
from distmerge.plan import assign_owners
from distmerge.verify.listing import Listing, Pair
from distmerge.verify.report import Check, Criteria, Figures, fmt, judge
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
        return [compare_quantized_pair(p, merged, reference, crit, comm.device, listing) if p.scale
                else compare(p, merged, reference, crit, comm.device) for p in mine]
    finally:
        merged.close()
        reference.close()


def compare(pair: Pair, merged: TensorFiles, reference: TensorFiles, crit: Criteria, device: torch.device) -> Check:
    file = Path(merged.side.files[merged.side.tensors[pair.merged_name].file]).name
    return compare_tensors(pair, merged.get(pair.merged_name), reference.get(pair.reference_name), file, crit, device)


def compare_quantized_pair(pair: Pair, merged: TensorFiles, reference: TensorFiles, crit: Criteria,
                           device: torch.device, listing: Listing) -> Check:
    """An FP8 weight and its scales (merge --quantize), dequantized and judged against the FP8 bound."""
    file = Path(merged.side.files[merged.side.tensors[pair.merged_name].file]).name
    return compare_quantized(pair, merged.get(pair.merged_name), merged.get(pair.scale), reference.get(
        pair.reference_name), file, crit, device, listing.quantized or "", listing.model_dtype)


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


OUTCOME = "within FP8 bound"
ELEMENTS = 2**22  # per step of the bound: a few float32 temporaries of this many elements


def compare_quantized(pair: Pair, q: torch.Tensor, scale: torch.Tensor, r: torch.Tensor, file: str, crit: Criteria,
                      device: torch.device, scheme: str, model_dtype: str | None) -> Check:
    """`q` the merged FP8 weight, `scale` its scales, `r` the reference; `model_dtype` the merged config's dtype."""
    grid = fp8.SCHEMES[scheme]
    q, scale, r = q.to(device), scale.to(device, torch.float32), r.to(device)
    ref_dtype = dtypes.code_of(r.dtype)
    narrower = model_dtype is not None and dtypes.itemsize(model_dtype) < dtypes.itemsize(ref_dtype)
    got = grid.dequantize(q, scale)
    figs = figures(got, r.to(torch.float32), *crit.band())
    worst, beyond = _against_bound(got, r, grid, scale, fp8.unit_roundoff(model_dtype) if narrower else 0.0)
    reasons = []
    if beyond:
        reasons.append(f"{beyond} element(s) beyond the FP8 bound (max abs {fmt(figs.max_abs)}, {fmt(worst)} x the "
                       "bound): not this reference's quantization")
    if crit.min_cosine is not None and not figs.cosine >= crit.min_cosine:
        reasons.append(f"cosine {figs.cosine:.6f} < {crit.min_cosine:g}")
    passed = not reasons
    return Check(name=pair.name, passed=passed, outcome=OUTCOME if passed else "values",
                 reason="" if passed else "values differ: " + "; ".join(reasons), file=file, shape=tuple(q.shape),
                 reference_shape=tuple(r.shape), dtype=fp8.FP8, reference_dtype=ref_dtype, note=pair.note,
                 figures=figs, fp8_bound=worst)


def _against_bound(got: torch.Tensor, r: torch.Tensor, grid: fp8.Scheme, scale: torch.Tensor,
                   cast_unit: float) -> tuple[float, int]:
    """(largest error / bound, elements beyond it), a slab of rows at a time (whole blocks of rows)."""
    rows, cols = got.shape
    step = max(1, ELEMENTS // max(cols, 1))
    if grid.block is not None:
        step = max(grid.block[0], step // grid.block[0] * grid.block[0])
    worst, beyond = torch.zeros((), device=got.device), torch.zeros((), dtype=torch.int64, device=got.device)
    for start in range(0, rows, step):
        ref = r[start : start + step].to(torch.float32)
        grid_rows = scale[start // grid.block[0] : -(-(start + step) // grid.block[0])] if grid.block else \
            scale[start : start + step]
        each = grid.expand(grid_rows, tuple(ref.shape))
        err, limit = (got[start : start + step] - ref).abs(), fp8.bound(ref, each, cast_unit)
        worst = torch.maximum(worst, (err / limit).max())  # limit > 0: the scale term never is 0
        beyond += (~(err <= limit)).sum()  # NaN counts as beyond
    return float(worst), int(beyond)

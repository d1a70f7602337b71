"""FP8 weights (merge --quantize) compared block by block. An FP8 weight is dequantized a block at a time (q * its
element's scale, in float32, fp8.py) and judged against the bound the recipe guarantees per element, not against
--atol/--rtol:

    |q * scale - reference| <= 2^-4 |reference| + 2^-10 scale      (+ the cast to the model's dtype, when the
                                                                     reference is wider: bf16 adds 2^-9 |reference|)

It passes when every element is within it (and its cosine meets --min-cosine, when given); the record says how close
the worst element came: `fp8_bound`, the largest error / bound (<= 1 passes). The figures are those of the
dequantized weight against the reference (blocks.Running over the same blocks), so the records are the same whether
the weight is read from a merged folder a block at a time, or built in memory (verify --merged CHECKPOINT
--quantize: the quantizing unit is built whole, as merge builds it, weight and scales together).

The scales are small (one per row, or per 128 x 128 block: 1/16384 of the weight) and are held whole, copied; each
element of a block finds its own scale by its row and column.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from distmerge import dtypes
from distmerge.quantize import fp8
from distmerge.verifier.blocks import Running, Scratch, block_size
from distmerge.verifier.listing import Listing, Pair
from distmerge.verifier.report import Check, Criteria, Figures, fmt


class Fp8Running:
    """blocks.Running for an FP8 weight (the merged side) and its reference: `add(k, q, r)` with block k of the FP8
    weight `q` as stored, then `figures()`, `worst` (largest error / bound) and `beyond` (elements past it)."""

    kind, dtype = "FP8", fp8.FP8  # what the record says the weight is (fp4_compare.Fp4Running: 4-bit)

    def __init__(self, shape: tuple[int, ...], scheme: fp8.Scheme, scale: torch.Tensor, cast_unit: float,
                 device: torch.device, crit: Criteria, scratch: Scratch) -> None:
        rows, self.cols = shape
        self.run = Running(rows * self.cols, device, *crit.band(), scratch)
        self.scheme, self.cast_unit, self.device, self.scratch = scheme, cast_unit, device, scratch
        self.scale_cols = 1 if scheme.block is None else scale.shape[1]
        # a copy: a scale read from a file comes in a buffer the next read reuses (sides.TensorFiles.read)
        self.scale = scale.to(device, torch.float32, copy=True).reshape(-1)
        self.step = block_size(device)
        self.worst, self.beyond = 0.0, 0

    @property
    def equal(self) -> bool:
        return False  # an FP8 weight is never its reference's bits

    def _take(self, slot: str, n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.scratch.take("fp8_" + slot, n, dtype, self.device)

    def add(self, k: int, q: torch.Tensor, r: torch.Tensor) -> None:
        n = r.numel()
        got, scale = self._dequantized(k, q, n)
        ref = self._take("ref", n).copy_(r)  # exact from bf16/fp16/fp32
        self.run.add(k, got, ref)
        err = torch.sub(got, ref, out=self._take("err", n)).abs_()
        limit = self._limit(ref, scale, n)
        within = torch.le(err, limit, out=self._take("within", n, torch.bool))
        self.beyond += n - int(within.sum().item())  # NaN is never within
        worst = torch.div(err, limit, out=err).max().item()  # limit > 0: the scale term never is 0
        self.worst = math.nan if math.isnan(worst) or math.isnan(self.worst) else max(self.worst, worst)

    def _dequantized(self, k: int, q: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Block k's dequantized values and each element's scale (float32, scratch buffers)."""
        scale = self._scales(k * self.step, n)
        return self._take("got", n).copy_(q).mul_(scale), scale  # fp8.Scheme.dequantize, one block

    def _limit(self, ref: torch.Tensor, scale: torch.Tensor, n: int) -> torch.Tensor:
        return fp8.bound(ref, scale, self.cast_unit, out=self._take("limit", n))

    def _scales(self, start: int, n: int) -> torch.Tensor:
        """The scale of each element [start, start + n) of the flattened weight: its row's, or its block's."""
        at = torch.arange(start, start + n, out=self._take("at", n, torch.int64))
        row = torch.div(at, self.cols, rounding_mode="floor", out=self._take("row", n, torch.int64))
        if self.scheme.block is not None:
            col = at.sub_(torch.mul(row, self.cols, out=self._take("t", n, torch.int64)))
            col.div_(self.scheme.block[1], rounding_mode="floor")
            row.div_(self.scheme.block[0], rounding_mode="floor").mul_(self.scale_cols).add_(col)
        return torch.index_select(self.scale, 0, row, out=self._take("scale", n))

    def figures(self) -> Figures:
        return self.run.figures()


def fp8_running(pair: Pair, listing: Listing, scale: torch.Tensor, device: torch.device, crit: Criteria,
                scratch: Scratch) -> Fp8Running:
    """The running figures of `pair`, an FP8 weight of the merged side with its scales `scale`."""
    shape = listing.merged.tensors[pair.merged_name].shape
    model, ref = listing.model_dtype, listing.reference.tensors[pair.reference_name].dtype
    narrower = model is not None and dtypes.itemsize(model) < dtypes.itemsize(ref)
    return Fp8Running(shape, fp8.SCHEMES[listing.quantized or ""], scale,
                      fp8.unit_roundoff(model) if narrower else 0.0, device, crit, scratch)


def fp8_check(pair: Pair, run: Fp8Running, *, file: str, crit: Criteria, shapes: tuple[tuple[int, ...], ...],
              ref_dtype: str) -> Check:
    """One FP8 weight's record once every block is compared; `shapes`: (merged's, reference's)."""
    figs = run.figures()
    reasons = []
    if run.beyond:
        reasons.append(f"{run.beyond} element(s) beyond the {run.kind} bound (max abs {fmt(figs.max_abs)}, "
                       f"{fmt(run.worst)} x the bound): not this reference's quantization")
    if crit.min_cosine is not None and not figs.cosine >= crit.min_cosine:
        reasons.append(f"cosine {figs.cosine:.6f} < {crit.min_cosine:g}")
    passed = not reasons
    return Check(name=pair.name, passed=passed, outcome=f"within {run.kind} bound" if passed else "values",
                 reason="" if passed else "values differ: " + "; ".join(reasons), file=Path(file).name,
                 shape=tuple(shapes[1]), reference_shape=tuple(shapes[1]), dtype=run.dtype, reference_dtype=ref_dtype,
                 note=pair.note, figures=figs, fp8_bound=run.worst)

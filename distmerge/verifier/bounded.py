"""A weight stored encoded (merge --quantize) compared block by block: each block of the stored values decoded (the
encoding's decoder, Listing.encoding: its values in float32, each element with its scale) and judged against the
bound the encoding guarantees per element, not against --atol/--rtol.

It passes when every element is within it (and its cosine meets --min-cosine, when given); the record says how close
the worst element came: `fp8_bound`, the largest error / bound (<= 1 passes). The figures are those of the decoded
weight against the reference (blocks.Running over the same blocks), so the records are the same whether the weight
is read from a merged folder a block at a time, or built in memory (verify --merged CHECKPOINT --quantize: the unit
that encodes it is built whole, as merge builds it, weight and scales together). A stored element may hold several
of the reference's (`per`: two e2m1 values a byte): a block is the reference's elements, with the bytes that hold
them.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Protocol

import torch

from distmerge.verifier.blocks import Running, Scratch, block_size
from distmerge.verifier.listing import Listing, Pair
from distmerge.verifier.report import Check, Criteria, Figures, fmt


class Decoder(Protocol):
    """One weight's decoding (the quantize part's, per scheme): `take(slot, n, dtype=float32)` gives scratch."""

    kind: str  # what the record says the weight is ("FP8": its outcome "within FP8 bound")
    dtype: str  # its stored safetensors code

    def decode(self, start: int, q: torch.Tensor, n: int, take) -> tuple[torch.Tensor, torch.Tensor]: ...

    def limit(self, ref: torch.Tensor, scale: torch.Tensor, cast_unit: float, take) -> torch.Tensor: ...


class Bounded:
    """blocks.Running for an encoded weight (the merged side) and its reference: `add(k, q, r)` with block k of the
    reference `r` and the stored values `q` that hold it, then `figures()`, `worst` (largest error / bound) and
    `beyond` (elements past it)."""

    def __init__(self, shape: tuple[int, ...], decoder: Decoder, cast_unit: float, device: torch.device,
                 crit: Criteria, scratch: Scratch) -> None:
        self.run = Running(math.prod(shape), device, *crit.band(), scratch)
        self.decoder, self.cast_unit, self.device, self.scratch = decoder, cast_unit, device, scratch
        self.kind, self.dtype = decoder.kind, decoder.dtype
        self.step = block_size(device)
        self.worst, self.beyond = 0.0, 0

    @property
    def equal(self) -> bool:
        return False  # an encoded weight is never its reference's bits

    def _take(self, slot: str, n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.scratch.take("bounded_" + slot, n, dtype, self.device)

    def add(self, k: int, q: torch.Tensor, r: torch.Tensor) -> None:
        n = r.numel()
        got, scale = self.decoder.decode(k * self.step, q, n, self._take)
        ref = self._take("ref", n).copy_(r)  # exact from bf16/fp16/fp32
        self.run.add(k, got, ref)
        err = torch.sub(got, ref, out=self._take("err", n)).abs_()
        limit = self.decoder.limit(ref, scale, self.cast_unit, self._take)
        within = torch.le(err, limit, out=self._take("within", n, torch.bool))
        self.beyond += n - int(within.sum().item())  # NaN is never within
        worst = torch.div(err, limit, out=err).max().item()  # limit > 0: the scale term never is 0
        self.worst = math.nan if math.isnan(worst) or math.isnan(self.worst) else max(self.worst, worst)

    def figures(self) -> Figures:
        return self.run.figures()


def bounded_running(pair: Pair, listing: Listing, parts: list[torch.Tensor], device: torch.device, crit: Criteria,
                    scratch: Scratch) -> Bounded:
    """The running figures of `pair`, an encoded weight of the merged side, with the tensors it is decoded with
    (`parts`: Pair.parts, read)."""
    encoding, ref = listing.encoding, listing.reference.tensors[pair.reference_name]
    assert encoding is not None, pair.name
    return Bounded(ref.shape, encoding.decoder(ref.shape, parts, device),
                   encoding.cast_unit(listing.model_dtype, ref.dtype), device, crit, scratch)


def bounded_check(pair: Pair, run: Bounded, *, file: str, crit: Criteria, shapes: tuple[tuple[int, ...], ...],
                  ref_dtype: str) -> Check:
    """One encoded weight's record once every block is compared; `shapes`: (merged's, reference's)."""
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

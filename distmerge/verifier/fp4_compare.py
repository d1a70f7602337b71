"""4-bit weights (merge --quantize nvfp4 | mxfp4) compared block by block, as FP8 ones are (fp8_compare.py): a block
of the reference's elements against the stored bytes that hold them (two e2m1 values a byte: `per` = 2), unpacked and
multiplied by their group's scale (over the global scale, nvfp4: fp4.Scheme.scales), in float32, and judged against
the bound the recipe guarantees per element instead of --atol/--rtol:

    |value x scale - reference| <= max(|reference|, scale) / 4     (+ the cast to the model's dtype, when the
                                                                     reference is wider: bf16 adds 2^-9 |reference|)

e2m1 keeps one mantissa bit, so half its spacing is a quarter of a value's magnitude (and of the scale, below 1). The
scales are small (one per 16 or 32 inputs) and are held whole, as float32 per group.
"""

from __future__ import annotations

import torch

from distmerge import dtypes
from distmerge.quantize import fp4, fp8
from distmerge.verifier.blocks import Running, Scratch, block_size
from distmerge.verifier.fp8_compare import Fp8Running
from distmerge.verifier.listing import Listing, Pair
from distmerge.verifier.report import Criteria


class Fp4Running(Fp8Running):
    """Fp8Running for a 4-bit weight: `add(k, packed, r)` with block k of the reference `r` and the bytes of the
    stored weight that hold it (half as many)."""

    kind, dtype, per = "FP4", fp4.PACKED, 2

    def __init__(self, shape: tuple[int, ...], scheme: fp4.Scheme, scale: torch.Tensor, shared: torch.Tensor | None,
                 cast_unit: float, device: torch.device, crit: Criteria, scratch: Scratch) -> None:
        rows, self.cols = shape
        self.run = Running(rows * self.cols, device, *crit.band(), scratch)
        self.group, self.cast_unit, self.device, self.scratch = scheme.group, cast_unit, device, scratch
        # copies: a scale read from a file comes in a buffer the next read reuses (sides.TensorFiles.read)
        self.scale = scheme.scales(scale.to(device, copy=True), None if shared is None else shared.to(device))
        self.scale = self.scale.reshape(-1).contiguous()
        self.step = block_size(device)
        self.worst, self.beyond = 0.0, 0

    def _dequantized(self, k: int, q: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The groups tile each row (its columns are a whole number of groups): element e's group is e // group."""
        at = torch.arange(k * self.step, k * self.step + n, out=self._take("at", n, torch.int64))
        group = at.div_(self.group, rounding_mode="floor")
        scale = torch.index_select(self.scale, 0, group, out=self._take("scale", n))
        values = fp4.unpack(q.to(self.device).reshape(1, -1)).reshape(-1)
        return values.mul_(scale), scale

    def _limit(self, ref: torch.Tensor, scale: torch.Tensor, n: int) -> torch.Tensor:
        return fp4.bound(ref, scale, self.cast_unit)


def fp4_running(pair: Pair, listing: Listing, scale: torch.Tensor, shared: torch.Tensor | None,
                device: torch.device, crit: Criteria, scratch: Scratch) -> Fp4Running:
    """The running figures of `pair`, a 4-bit weight of the merged side with its scales `scale` (and `shared`)."""
    shape = listing.reference.tensors[pair.reference_name].shape
    model, ref = listing.model_dtype, listing.reference.tensors[pair.reference_name].dtype
    narrower = model is not None and dtypes.itemsize(model) < dtypes.itemsize(ref)
    return Fp4Running(shape, fp4.SCHEMES[listing.quantized or ""], scale, shared,
                      fp8.unit_roundoff(model) if narrower else 0.0, device, crit, scratch)

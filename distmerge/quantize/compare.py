"""verify's side of the quantize part: a quantized model's weights as verify compares them, one Encoding per scheme.

    Encoding.stored(dtypes)    which stored weights are quantized, with the tensors they are decoded with (their
                               scales, and the global scale of nvfp4) and the reference elements per stored element
    Encoding.decoder(...)      one weight's decoder: a block of stored values, dequantized in float32, each element
                               with its scale (`decode`), and the bound the recipe guarantees per element (`limit`)
    Encoding.load(...)         verify --logits: the model loaded by transformers, which dequantizes it

verifier/listing.py asks `encoding_of` and puts the answer in its Listing; verifier/bounded.py compares a weight with
its decoder and never names a scheme. The bounds, per element (fp8.bound, fp4.bound):

    FP8   |q * scale - reference| <= 2^-4 |reference| + 2^-10 scale
    FP4   |value x scale - reference| <= max(|reference|, scale) / 4   (e2m1 keeps one mantissa bit)

each plus the cast to the model's dtype when the reference is wider (bf16 adds 2^-9 |reference|: `cast_unit`). The
scales are small (one per row, per 128 x 128 block, or per 16 or 32 inputs) and are held whole, copied, as float32:
each element of a block finds its own scale by its row and column (FP8), or its group (4-bit: the groups tile each
row, whose columns are a whole number of groups).
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from distmerge import dtypes
from distmerge.quantize import fp4, fp8, schemes

Take = Callable[..., torch.Tensor]  # take(slot, n, dtype=float32): a scratch buffer of n elements (blocks.Scratch)
LOGITS_COSINE = 0.99  # verify --logits without a tolerance given: the logits' cosine with the full-precision model's
# must reach this (docs/quantize.md: 0.9972 at worst on the test fixtures, tiny random models)


class Fp8Decoder:
    """An FP8 weight of `shape` with its scales (one per row, or per 128 x 128 block)."""

    kind, dtype, per = "FP8", fp8.FP8, 1  # what the record says the weight is; reference elements per stored one

    def __init__(self, scheme: fp8.Scheme, shape: tuple[int, ...], parts: list[torch.Tensor],
                 device: torch.device) -> None:
        (scale,) = parts
        self.cols, self.block = shape[1], scheme.block
        self.scale_cols = 1 if scheme.block is None else scale.shape[1]
        # a copy: a scale read from a file comes in a buffer the next read reuses (sides.TensorFiles.read)
        self.scale = scale.to(device, torch.float32, copy=True).reshape(-1)

    def decode(self, start: int, q: torch.Tensor, n: int, take: Take) -> tuple[torch.Tensor, torch.Tensor]:
        """Elements [start, start + n) dequantized, and each one's scale (float32, scratch buffers)."""
        scale = self._scales(start, n, take)
        return take("got", n).copy_(q).mul_(scale), scale  # fp8.Scheme.dequantize, one block

    def limit(self, ref: torch.Tensor, scale: torch.Tensor, cast_unit: float, take: Take) -> torch.Tensor:
        return fp8.bound(ref, scale, cast_unit, out=take("limit", ref.numel()))

    def _scales(self, start: int, n: int, take: Take) -> torch.Tensor:
        """The scale of each element [start, start + n) of the flattened weight: its row's, or its block's."""
        at = torch.arange(start, start + n, out=take("at", n, torch.int64))
        row = torch.div(at, self.cols, rounding_mode="floor", out=take("row", n, torch.int64))
        if self.block is not None:
            col = at.sub_(torch.mul(row, self.cols, out=take("t", n, torch.int64)))
            col.div_(self.block[1], rounding_mode="floor")
            row.div_(self.block[0], rounding_mode="floor").mul_(self.scale_cols).add_(col)
        return torch.index_select(self.scale, 0, row, out=take("scale", n))


class Fp4Decoder:
    """A 4-bit weight with its scales (and global scale, nvfp4): its stored bytes hold two e2m1 values each."""

    kind, dtype, per = "FP4", fp4.PACKED, 2

    def __init__(self, scheme: fp4.Scheme, shape: tuple[int, ...], parts: list[torch.Tensor],
                 device: torch.device) -> None:
        scale, *shared = parts
        self.group, self.device = scheme.group, device
        # a copy: a scale read from a file comes in a buffer the next read reuses (sides.TensorFiles.read)
        self.scale = scheme.scales(scale.to(device, copy=True), shared[0].to(device) if shared else None)
        self.scale = self.scale.reshape(-1).contiguous()

    def decode(self, start: int, q: torch.Tensor, n: int, take: Take) -> tuple[torch.Tensor, torch.Tensor]:
        """The groups tile each row (its columns are a whole number of groups): element e's group is e // group."""
        at = torch.arange(start, start + n, out=take("at", n, torch.int64))
        group = at.div_(self.group, rounding_mode="floor")
        scale = torch.index_select(self.scale, 0, group, out=take("scale", n))
        values = fp4.unpack(q.to(self.device).reshape(1, -1)).reshape(-1)
        return values.mul_(scale), scale

    def limit(self, ref: torch.Tensor, scale: torch.Tensor, cast_unit: float, take: Take) -> torch.Tensor:
        return fp4.bound(ref, scale, cast_unit)


@dataclass(frozen=True)
class Encoding:
    """A scheme's weights as verify finds, decodes and loads them."""

    scheme: schemes.Scheme
    logits_cosine: float = LOGITS_COSINE

    @property
    def name(self) -> str:
        return self.scheme.name

    @property
    def loaded(self) -> str:
        """verify --logits' note: how the merged model's weights became the ones it ran."""
        bits = "FP8" if isinstance(self.scheme, fp8.Scheme) else "4-bit"
        return f"{bits} weights ({self.name}) dequantized by transformers as it loads them"

    def stored(self, codes: Mapping[str, str]) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
        """`codes`: a side's tensors, name -> safetensors code. The quantized weights with their scale tensors beside
        them: stored name -> the Pair's fields (`parts`, `per`), and stored name -> the weight's own name (4-bit)."""
        scheme = self.scheme
        if isinstance(scheme, fp8.Scheme):
            return {w: {"parts": (s,)} for s in codes if s.endswith(scheme.scale_suffix)
                    and (w := s.removesuffix(scheme.scale_suffix)) in codes and codes[w] == fp8.FP8}, {}
        found, stored = {}, {}
        for packed in codes:
            module = packed.removesuffix(".weight_packed")
            if module == packed or f"{module}.weight_scale" not in codes:
                continue
            shared = f"{module}.weight_global_scale" if scheme.global_scale else ""
            if shared and shared not in codes:
                continue
            found[packed] = {"parts": (f"{module}.weight_scale", shared) if shared else (f"{module}.weight_scale",),
                             "per": 2}
            stored[packed] = f"{module}.weight"
        return found, stored

    def decoder(self, shape: tuple[int, ...], parts: list[torch.Tensor], device: torch.device) -> Fp8Decoder | \
            Fp4Decoder:
        """One weight's decoder; `shape`: the reference's, `parts`: the tensors `stored` named, in its order."""
        if isinstance(self.scheme, fp8.Scheme):
            return Fp8Decoder(self.scheme, shape, parts, device)
        return Fp4Decoder(self.scheme, shape, parts, device)

    def cast_unit(self, model: str | None, reference: str) -> float:
        """The cast of the weight to the model's dtype `model` before it was quantized, when narrower than the
        reference's: its unit roundoff (bf16 2^-9), else 0."""
        narrower = model is not None and dtypes.itemsize(model) < dtypes.itemsize(reference)
        return fp8.unit_roundoff(model) if narrower else 0.0

    def load(self, auto_class: Any, folder: Path, transformers: Any) -> Any:
        """The model dequantized by transformers as it loads it, on any device: without a GPU it does so by itself;
        with one it would keep FP8 modules, whose weights a reference could not load into. The folder's own
        quantization_config, with transformers' `dequantize` set."""
        quant = {**json.loads((folder / "config.json").read_text())["quantization_config"], "dequantize": True}
        block = self.name == "fp8-block"
        cls = transformers.FineGrainedFP8Config if block else transformers.CompressedTensorsConfig
        with warnings.catch_warnings():  # "the model's own quantization_config will be used": what is wanted
            warnings.filterwarnings("ignore", message="You passed `quantization_config`")
            return auto_class.from_pretrained(folder, quantization_config=cls.from_dict(quant))


ENCODINGS = {name: Encoding(scheme) for name, scheme in schemes.SCHEMES.items()}


def encoding_of(config: dict[str, Any], later: Mapping[str, object] | None = None) -> Encoding | None:
    """The encoding of a model's weights: what its config.json's quantization_config says, or, for a model not yet
    written (verify of a checkpoint merged in memory), the record finalize would make it from (`later`:
    Plan.config_later)."""
    made = (later or {}).get("quantization_config")
    scheme = schemes.SCHEMES[made.scheme] if isinstance(made, schemes.Quantized) else schemes.scheme_of(config)
    return ENCODINGS[scheme.name] if scheme else None

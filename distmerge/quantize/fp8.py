"""FP8 weights, the two layouts `--quantize` writes: each a pure function of the merged tensor. The schemes
FP8_BLOCK and FP8_CHANNEL (registered in schemes.py) carry their math, their config.json and verify's decoder.

    fp8-block    DeepSeek-V3 / Qwen3-FP8: float8_e4m3fn weight, float32 `<name>_scale_inv` per 128 x 128 block
                 (ceil division: edge blocks are partial), config `quant_method: fp8`; transformers, vLLM and
                 SGLang read it
    fp8-channel  compressed-tensors' float-quantized layout (llm-compressor's FP8_DYNAMIC): float8_e4m3fn weight,
                 float32 `<name>_scale` of shape [rows, 1], config `quant_method: compressed-tensors`

Both follow the published recipe (DeepSeek-V3's fp8 weight_dequant, compressed-tensors' calculate_qparams):

    w32   = weight in float32 (exact from bf16/fp16/fp32)
    scale = amax(|w32| over the block or row) / 448      (448: float8_e4m3fn's largest value; an all-zero block
                                                           takes float32's eps, as compressed-tensors does)
    q     = clamp(w32 / scale, -448, 448) cast to float8_e4m3fn   (torch's cast: round to nearest even)
    w    ~= q * scale

amax, one IEEE division and the cast give the same bits on any CPU and GPU, so the output is byte-identical for
every N and device. A dequantized element is within 2^-4 |w| (3 mantissa bits, round to nearest) or, below the
normal range, 2^-10 * scale of w: `bound` is that, per element, what `verify` checks.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from distmerge.quantize import compressed_config, scheme

FP8 = "F8_E4M3"  # the safetensors code of the quantized weights
SCALE = "F32"
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448
ZERO_SCALE = torch.finfo(torch.float32).eps  # the scale of an all-zero block or row (no division by zero)
REL_BOUND, SUBNORMAL_BOUND = 2.0**-4, 2.0**-10  # half a unit in the last place: normal values, subnormals
BLOCK = (128, 128)


@dataclass(frozen=True, kw_only=True)
class Scheme(scheme.Scheme):
    """An FP8 layout: a weight in float8_e4m3fn beside its float32 scales, one per row or per block."""

    name: str  # the --quantize choice
    description: str  # what it is, for --help and the docs
    scale_suffix: str  # the scale tensor is `<weight name><scale_suffix>`
    block: tuple[int, int] | None  # rows x columns per scale; None: one scale per row (per output channel)
    library: str | None = None  # fp8-channel: compressed-tensors makes its config and loads it
    bits = "FP8"

    def scale_shape(self, shape: tuple[int, ...]) -> tuple[int, int]:
        rows, cols = shape
        if self.block is None:
            return (rows, 1)
        return (-(-rows // self.block[0]), -(-cols // self.block[1]))

    def scale_name(self, name: str) -> str:
        return name + self.scale_suffix

    def takes(self, shape: tuple[int, ...]) -> bool:
        return len(shape) == 2

    def parts(self, name: str, shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...], str]]:
        """What weight `name` of `shape` is written as: (name, shape, safetensors code) each."""
        return [(name, shape, FP8), (self.scale_name(name), self.scale_shape(shape), SCALE)]

    def quantize(self, weight: torch.Tensor, shared: torch.Tensor | None = None) -> list[torch.Tensor]:
        """(float8_e4m3fn weight, float32 scales), on the weight's device."""
        w = weight.to(torch.float32)
        if self.block is None:
            scale = _scale(_amax(w, (1,)))
            return [_cast(w / scale), scale]
        blocks = _blocks(w, self.block)  # (R, b0, C, b1), zero-padded at the edges
        scale = _scale(_amax(blocks, (1, 3)))
        q = _cast(blocks / scale[:, None, :, None])
        rows, cols = w.shape
        return [q.reshape(blocks.shape[0] * blocks.shape[1], -1)[:rows, :cols].contiguous(), scale]

    def expand(self, scale: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        """Each element's scale: the scale grid repeated over its blocks (cut at the edges) or rows."""
        if self.block is None:
            return scale.expand(shape)
        rows, cols = shape
        return scale.repeat_interleave(self.block[0], 0)[:rows].repeat_interleave(self.block[1], 1)[:, :cols]

    def dequantize(self, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """float32 q * scale."""
        return q.to(torch.float32) * self.expand(scale.to(torch.float32), tuple(q.shape))

    def config(self, unconverted: list[str]) -> dict[str, Any]:
        """fp8-block: transformers' own `quant_method: fp8` dict; fp8-channel: compressed-tensors' FP8_DYNAMIC."""
        if self.block is None:
            return compressed_config.fp8_dynamic(unconverted, self.name)
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": list(self.block), "modules_to_not_convert": unconverted}

    def recognises(self, quant: Mapping[str, Any]) -> bool:
        if self.block is not None:
            return quant.get("quant_method") == "fp8" and list(quant.get("weight_block_size") or ()) == list(self.block)
        if quant.get("quant_method") != "compressed-tensors" or quant.get("format") != "float-quantized":
            return False
        groups = quant.get("config_groups") or {}
        weights = [g.get("weights") or {} for g in groups.values() if isinstance(g, dict)]
        return bool(weights) and all(w.get("strategy") == "channel" and w.get("num_bits") == 8 for w in weights)

    def stored(self, codes: Mapping[str, str]) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
        """Each float8 weight with its scale beside it; a weight keeps its own name."""
        return {w: {"parts": (s,)} for s in codes if s.endswith(self.scale_suffix)
                and (w := s.removesuffix(self.scale_suffix)) in codes and codes[w] == FP8}, {}

    def decoder(self, shape: tuple[int, ...], parts: list[torch.Tensor], device: torch.device) -> Decoder:
        return Decoder(self, shape, parts, device)

    def loader(self, transformers: Any) -> Any:
        return transformers.CompressedTensorsConfig if self.block is None else transformers.FineGrainedFP8Config


class Decoder:
    """An FP8 weight of `shape` with its scales (one per row, or per 128 x 128 block), decoded block by block."""

    kind, dtype, per = "FP8", FP8, 1  # what the record says the weight is; reference elements per stored one

    def __init__(self, scheme: Scheme, shape: tuple[int, ...], parts: list[torch.Tensor],
                 device: torch.device) -> None:
        (scale,) = parts
        self.cols, self.block = shape[1], scheme.block
        self.scale_cols = 1 if scheme.block is None else scale.shape[1]
        # a copy: a scale read from a file comes in a buffer the next read reuses (sides.TensorFiles.read)
        self.scale = scale.to(device, torch.float32, copy=True).reshape(-1)

    def decode(self, start: int, q: torch.Tensor, n: int, take: scheme.Take) -> tuple[torch.Tensor, torch.Tensor]:
        """Elements [start, start + n) dequantized, and each one's scale (float32, scratch buffers)."""
        scale = self._scales(start, n, take)
        return take("got", n).copy_(q).mul_(scale), scale  # Scheme.dequantize, one block

    def limit(self, ref: torch.Tensor, scale: torch.Tensor, cast_unit: float, take: scheme.Take) -> torch.Tensor:
        return bound(ref, scale, cast_unit, out=take("limit", ref.numel()))

    def _scales(self, start: int, n: int, take: scheme.Take) -> torch.Tensor:
        """The scale of each element [start, start + n) of the flattened weight: its row's, or its block's."""
        at = torch.arange(start, start + n, out=take("at", n, torch.int64))
        row = torch.div(at, self.cols, rounding_mode="floor", out=take("row", n, torch.int64))
        if self.block is not None:
            col = at.sub_(torch.mul(row, self.cols, out=take("t", n, torch.int64)))
            col.div_(self.block[1], rounding_mode="floor")
            row.div_(self.block[0], rounding_mode="floor").mul_(self.scale_cols).add_(col)
        return torch.index_select(self.scale, 0, row, out=take("scale", n))


def _amax(w: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    """max |w| over dims, as max(max w, -min w): the same value without an |w| temporary (keepdim for rows)."""
    keep = len(dims) == 1
    return torch.maximum(w.amax(dim=dims, keepdim=keep), w.amin(dim=dims, keepdim=keep).neg_())


def _scale(amax: torch.Tensor) -> torch.Tensor:
    scale = amax / FP8_MAX
    return torch.where(scale == 0, torch.full_like(scale, ZERO_SCALE), scale)


def _cast(scaled: torch.Tensor) -> torch.Tensor:
    """`scaled` is a temporary of the caller's: clamped in place."""
    return scaled.clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def _blocks(w: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    rows, cols = w.shape
    r, c = -(-rows // block[0]), -(-cols // block[1])
    if (r * block[0], c * block[1]) != (rows, cols):  # zeros change no block's amax
        w = torch.nn.functional.pad(w, (0, c * block[1] - cols, 0, r * block[0] - rows))
    return w.reshape(r, block[0], c, block[1])


def bound(reference: torch.Tensor, scale: torch.Tensor, cast_unit: float = 0.0,
          out: torch.Tensor | None = None) -> torch.Tensor:
    """The largest |dequantized - reference| the recipe allows per element (float32): the FP8 rounding of the
    weight, plus `cast_unit` |reference| when the weight was first cast to a narrower dtype (bf16: 2^-9), with
    a little room for the float32 division and product. `out`: a float32 buffer of the reference's size to make it
    in (verify reuses one per block: blocks.Scratch)."""
    r = reference.abs().to(torch.float32) if out is None else torch.abs(reference, out=out)
    # SUBNORMAL_BOUND is a power of two: its product with a scale is exact, so add_'s alpha changes no bit
    return r.mul_(REL_BOUND * (1 + cast_unit) + cast_unit).add_(scale, alpha=SUBNORMAL_BOUND).mul_(1 + 2.0**-20)


FP8_BLOCK = Scheme(name="fp8-block", scale_suffix="_scale_inv", block=BLOCK,
                   description="DeepSeek-V3 / Qwen3-FP8: 128x128 blocks, float32 weight_scale_inv")
FP8_CHANNEL = Scheme(name="fp8-channel", scale_suffix="_scale", block=None, library="compressed_tensors",
                     description="compressed-tensors float-quantized: one float32 weight_scale per output row")

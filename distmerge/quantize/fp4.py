"""4-bit weights, the two compressed-tensors layouts `--quantize` writes: a pure function of the merged tensor (and,
for NVFP4, of the tensors vLLM fuses with it, which share its global scale: fused.py). The schemes NVFP4 and MXFP4
(registered in schemes.py) carry their math, their config.json (which names bfloat16: `Scheme.announced`) and
verify's decoder.

    nvfp4  `nvfp4-pack-quantized` (llm-compressor's NVFP4A16): `weight_packed` uint8 [rows, cols/2], two e2m1 values a
           byte; `weight_scale` float8_e4m3fn [rows, cols/16], one per 16 input elements; `weight_global_scale`
           float32 [1]
    mxfp4  `mxfp4-pack-quantized` (MXFP4A16): `weight_packed` as above; `weight_scale` uint8 [rows, cols/32], the e8m0
           exponent (bias 127) of one power-of-two scale per 32 input elements

The recipe is llm-compressor 0.14's `model_free_ptq` (compressed-tensors 0.19's calculate_qparams, generate_gparam,
generate_mx_scales and its NVFP4/MXFP4 compressors), followed step by step in the weight's own dtype D (the merge's
--dtype: bf16 arithmetic rounds where the peer's does), so the bytes are the peer's:

  nvfp4  a       = amax |w| over the fused set (D)
         global  = float32(2688 / max(a, tiny(D)))  as torch computes `float / tensor`: reciprocal, then product,
                   in D; inf or NaN -> 1                                   (2688 = 448 x 6: e4m3 max x e2m1 max)
         s       = e4m3(float32(global x D(amax |group| / 6))); 0 -> 0.125
         q       = e2m1(clamp(float32(w) / (float32(s) / global), -6, 6))
  mxfp4  p       = amax |group| rounded to a power of two (the mantissa's top two bits add a carry: 1.75 rounds up)
         e       = clamp(127 + log2(p) - 2, 0, 255) (uint8; a zero group: 0)
         q       = e2m1(clamp(w / 2^(e - 127) in D, -6, 6))

e2m1 rounds to nearest, ties to even (0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4); the
sign bit is set for a value below zero (torch.sign's: -0.0 has none), so a negative value that rounds to zero is
stored as -0 (nibble 8), and -0.0 as 0. Each byte holds two
neighbours of a row, the even column in the low nibble. Comparisons, IEEE division and these casts give the same bits
on every CPU and GPU.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from distmerge.quantize import compressed_config, scheme

PACKED, GLOBAL = "U8", "F32"  # safetensors codes: the packed weight, the global scale
FP4_MAX, FP8_MAX = 6.0, 448.0
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # a nibble's magnitude, by its low three bits
# The rounding edges between neighbouring e2m1 magnitudes; True: a value on the edge rounds up (ties to even)
EDGES = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))
NVFP4_EPS = 0.125  # the scale of a group whose e4m3 scale rounds to zero (compressed-tensors' e4m3 eps)


@dataclass(frozen=True, kw_only=True)
class Scheme(scheme.Scheme):
    """A 4-bit layout in compressed-tensors' pack-quantized formats. `quantize` and `dequantize` are its math."""

    name: str  # the --quantize choice
    description: str  # what it is, for --help and the docs
    preset: str  # compressed-tensors' preset scheme (llm-compressor's name for it)
    format: str  # compressed-tensors' format
    group: int  # input elements per scale
    scale: str  # the scale tensor's safetensors code
    global_scale: bool  # NVFP4: a float32 per-tensor scale, shared across a fused set
    library: str | None = "compressed_tensors"  # makes its config, and decompresses it in transformers
    bits = "4-bit"
    # What compressed-tensors decompresses the weights into whatever the model's dtype (its unpack_fp4_from_uint8's
    # default): config.json names it, so that a plain from_pretrained runs the whole model in it
    DECODED: ClassVar[str] = "BF16"

    @property
    def fused(self) -> bool:
        """The weights vLLM fuses (fused.py) share one scale: NVFP4's global scale."""
        return self.global_scale

    def takes(self, shape: tuple[int, ...]) -> bool:
        """A 2-D weight whose rows split into whole groups (compressed-tensors refuses any other)."""
        return len(shape) == 2 and shape[1] % self.group == 0

    def parts(self, name: str, shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...], str]]:
        """What weight `<module>.weight` of `shape` is written as: (name, shape, safetensors code) each."""
        module, (rows, cols) = name.removesuffix(".weight"), shape
        out = [(f"{module}.weight_packed", (rows, cols // 2), PACKED),
               (f"{module}.weight_scale", (rows, cols // self.group), self.scale)]
        return out + ([(f"{module}.weight_global_scale", (1,), GLOBAL)] if self.global_scale else [])

    def shared(self, weights: list[torch.Tensor]) -> torch.Tensor | None:
        """The scale shared by the weights of a fused set (NVFP4's global scale), None when the layout has none."""
        if not self.global_scale:
            return None
        amax = torch.stack([torch.maximum(w.amax(), w.amin().neg()) for w in weights]).amax().reshape(1)
        tiny = torch.finfo(amax.dtype).tiny
        # `float / tensor` in torch is reciprocal(tensor) * float: written so, the rounding in D is the peer's
        scale = FP8_MAX * FP4_MAX / amax.clamp(min=tiny)
        return torch.nan_to_num(scale, nan=1.0, posinf=1.0, neginf=1.0).to(torch.float32)

    def quantize(self, weight: torch.Tensor, shared: torch.Tensor | None = None) -> list[torch.Tensor]:
        """[packed, scale] (+ [global scale]) of `weight` (in its output dtype), on its device."""
        groups = weight.unflatten(-1, (-1, self.group))  # (rows, groups, group)
        zero = torch.zeros((), dtype=weight.dtype, device=weight.device)
        amax = torch.maximum(torch.minimum(groups.amin(-1), zero).abs_(), torch.maximum(groups.amax(-1), zero))
        if self.global_scale:
            assert shared is not None, "an NVFP4 weight needs its fused set's global scale"
            scale = amax / torch.tensor(FP4_MAX, dtype=amax.dtype, device=amax.device)  # rounded in D
            scale = (shared * scale).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).to(torch.float32)
            scale = torch.where(scale == 0, torch.full_like(scale, NVFP4_EPS), scale)
            scaled = groups.to(torch.float32) / (scale / shared).unsqueeze(-1)
            return [pack(codes(scaled)), scale.to(torch.float8_e4m3fn), shared]
        power = torch.pow(2.0, mx_exponent(amax).to(torch.int32).sub_(127).to(torch.float32)).to(weight.dtype)
        power = torch.where(power == 0, torch.ones_like(power), power)  # below float16's range: 1, as the peer
        stored = torch.floor(torch.log2(power)).to(torch.int32).add_(127).to(torch.uint8)  # e, but from D's scale
        return [pack(codes(groups / power.unsqueeze(-1))), stored]

    def dequantize(self, packed: torch.Tensor, scale: torch.Tensor, shared: torch.Tensor | None = None
                   ) -> torch.Tensor:
        """float32 weight: each value times its group's scale (over the global scale, NVFP4)."""
        values = unpack(packed)
        return (values.unflatten(-1, (-1, self.group)) * self.scales(scale, shared).unsqueeze(-1)).flatten(-2)

    def scales(self, scale: torch.Tensor, shared: torch.Tensor | None = None) -> torch.Tensor:
        """Each group's float32 scale, as the compressed tensors give it (what multiplies an e2m1 value)."""
        if self.global_scale:
            assert shared is not None
            return scale.to(torch.float32) / shared.to(torch.float32)
        return torch.pow(2.0, scale.to(torch.int32).sub(127).to(torch.float32))

    def config(self, unconverted: list[str]) -> dict[str, Any]:
        """compressed-tensors' preset, in one config group named after it, as llm-compressor writes it."""
        return compressed_config.preset(self.preset, self.format, unconverted, self.name)

    def announced(self, dtype: str | None) -> str | None:
        """bfloat16 whatever the merge's dtype: transformers decompresses the weights into it, and a model whose
        other tensors it loaded in another dtype fails at its first matmul. Those tensors stay as merged (a float32
        merge's bytes are the peer's); transformers casts them as it loads them."""
        return self.DECODED

    def recognises(self, quant: Mapping[str, Any]) -> bool:
        return quant.get("quant_method") == "compressed-tensors" and quant.get("format") == self.format

    def stored(self, codes: Mapping[str, str]) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
        """Each `<module>.weight_packed` with its scale (and global scale, nvfp4), as `<module>.weight`."""
        found, names = {}, {}
        for packed in codes:
            module = packed.removesuffix(".weight_packed")
            if module == packed or f"{module}.weight_scale" not in codes:
                continue
            shared = f"{module}.weight_global_scale" if self.global_scale else ""
            if shared and shared not in codes:
                continue
            found[packed] = {"parts": (f"{module}.weight_scale", shared) if shared else (f"{module}.weight_scale",),
                             "per": 2}
            names[packed] = f"{module}.weight"
        return found, names

    def decoder(self, shape: tuple[int, ...], parts: list[torch.Tensor], device: torch.device) -> Decoder:
        return Decoder(self, parts, device)

    def loader(self, transformers: Any) -> Any:
        return transformers.CompressedTensorsConfig


class Decoder:
    """A 4-bit weight with its scales (and global scale, nvfp4): its stored bytes hold two e2m1 values each."""

    kind, dtype, per = "FP4", PACKED, 2

    def __init__(self, scheme: Scheme, parts: list[torch.Tensor], device: torch.device) -> None:
        scale, *shared = parts
        self.group, self.device = scheme.group, device
        # a copy: a scale read from a file comes in a buffer the next read reuses (sides.TensorFiles.read)
        self.scale = scheme.scales(scale.to(device, copy=True), shared[0].to(device) if shared else None)
        self.scale = self.scale.reshape(-1).contiguous()

    def decode(self, start: int, q: torch.Tensor, n: int, take: scheme.Take) -> tuple[torch.Tensor, torch.Tensor]:
        """The groups tile each row (its columns are a whole number of groups): element e's group is e // group."""
        at = torch.arange(start, start + n, out=take("at", n, torch.int64))
        group = at.div_(self.group, rounding_mode="floor")
        scale = torch.index_select(self.scale, 0, group, out=take("scale", n))
        values = unpack(q.to(self.device).reshape(1, -1)).reshape(-1)
        return values.mul_(scale), scale

    def limit(self, ref: torch.Tensor, scale: torch.Tensor, cast_unit: float, take: scheme.Take) -> torch.Tensor:
        return bound(ref, scale, cast_unit)


def mx_exponent(amax: torch.Tensor) -> torch.Tensor:
    """The e8m0 exponent (uint8, bias 127) of each group's power-of-two scale, from its amax in D: the amax rounded
    to a power of two by adding a quarter of its exponent's unit to its bits and keeping sign and exponent, two
    below that power (e2m1's largest value, 6, is below 2^3), clamped into 0..255 (an all-zero group: 0)."""
    bits = {torch.bfloat16: (torch.int16, 7, 8), torch.float16: (torch.int16, 10, 5),
            torch.float32: (torch.int32, 23, 8)}
    view, mantissa, exponent = bits[amax.dtype]
    as_int = amax.view(view).to(torch.int64)  # amax >= +0: the sign bit is clear, and stays so (inf at most)
    mask = ((1 << (exponent + 1)) - 1) << mantissa
    rounded = torch.bitwise_and(as_int + (1 << (mantissa - 2)), mask)
    power = rounded.to(view).view(amax.dtype)
    biased = 127 + torch.floor(torch.log2(power)) - 2  # in D, as the peer: exact integers
    return torch.round(biased.clamp(0, 255)).to(torch.uint8)


def codes(scaled: torch.Tensor) -> torch.Tensor:
    """The e2m1 nibble (sign bit 8 below zero, magnitude index 0..7) of each value, clamped to +-6 and rounded
    (EDGES)."""
    magnitude = scaled.abs().clamp_(max=FP4_MAX)
    index = torch.zeros(scaled.shape, dtype=torch.uint8, device=scaled.device)
    for edge, up in EDGES:
        index += (magnitude >= edge) if up else (magnitude > edge)
    return index.bitwise_or_(scaled.lt(0).to(torch.uint8).bitwise_left_shift_(3))


def pack(nibbles: torch.Tensor) -> torch.Tensor:
    """(rows, ...) nibbles -> (rows, n/2) bytes: element 2j in the low nibble, 2j + 1 in the high one."""
    pairs = nibbles.reshape(nibbles.shape[0], -1, 2)
    return pairs[..., 0].bitwise_or(pairs[..., 1].bitwise_left_shift(4))


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """(rows, n/2) bytes -> (rows, n) float32 e2m1 values."""
    nibbles = torch.stack((packed.bitwise_and(15), packed.bitwise_right_shift(4)), dim=-1).flatten(-2)
    table = torch.tensor(E2M1, dtype=torch.float32, device=packed.device)
    values = table[nibbles.bitwise_and(7).long()]
    return torch.where(nibbles >= 8, -values, values)


def bound(reference: torch.Tensor, scale: torch.Tensor, cast_unit: float = 0.0) -> torch.Tensor:
    """The largest |dequantized - reference| the recipe allows per element (float32): e2m1 rounds a value v (the
    weight over its scale) within half its spacing (1/4 below 2, 1/2 below 4, 1 up to 6, and 6 is clipped at most
    1 below any value), so within max(|v|, 1) / 4 scales: max(|w|, scale) / 4; plus `cast_unit` |reference| when the
    weight was first cast to a narrower dtype (bf16: 2^-9), with a little room for the float32 arithmetic."""
    r = reference.abs().to(torch.float32)
    return torch.maximum(r * (1 + cast_unit), scale).mul_(0.25).add_(r, alpha=cast_unit).mul_(1 + 2.0**-20)


NVFP4 = Scheme(name="nvfp4", preset="NVFP4A16", format="nvfp4-pack-quantized", group=16, scale="F8_E4M3",
               global_scale=True,
               description="compressed-tensors nvfp4-pack-quantized: e2m1 pairs in uint8, a float8_e4m3fn scale per "
                           "16 inputs, a float32 global scale shared by q/k/v and gate/up")
MXFP4 = Scheme(name="mxfp4", preset="MXFP4A16", format="mxfp4-pack-quantized", group=32, scale="U8",
               global_scale=False,
               description="compressed-tensors mxfp4-pack-quantized: e2m1 pairs in uint8, a uint8 e8m0 exponent per "
                           "32 inputs")

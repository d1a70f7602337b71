"""NVFP4 and MXFP4 as compressed-tensors specifies them (llm-compressor's NVFP4A16 / MXFP4A16, the
`nvfp4-pack-quantized` and `mxfp4-pack-quantized` formats), written here from the format, never from
distmerge/quantize/fp4.py: the expected bytes of the 4-bit tests.

    e2m1     a sign bit and the magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6 (codes 0..7); a value rounds to the nearest
             magnitude, a tie to the even code; the sign bit (8) is set for a value below zero
    packing  two values a byte, the even column in the low nibble
    NVFP4    groups of 16 inputs; global = 448 x 6 / amax(|w|) over the weights vLLM fuses into one matrix (q/k/v,
             gate/up, Mixtral's w1/w3), computed in the weight's dtype; a group's scale s = e4m3(global x amax(|group|)
             / 6), 0 -> 0.125 (e4m3's eps); each value w / (s / global)
    MXFP4    groups of 32 inputs; the scale is a power of two 2^(e - 127), e (uint8) = exponent of amax(|group|)
             rounded to a power of two (a mantissa whose top two bits are set rounds up) minus 2
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch

MAGNITUDES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
NVFP4_GROUP, MXFP4_GROUP = 16, 32
E4M3_MAX, E2M1_MAX = 448.0, 6.0
NVFP4_ZERO_SCALE = 0.125

# The weights vLLM loads as one matrix, by their Hugging Face names: (pattern, the set's key from the match)
FUSED = (
    (re.compile(r"(?P<at>.*\.self_attn\.)(?:q|k|v)_proj\.weight"), ("q_proj", "k_proj", "v_proj")),
    (re.compile(r"(?P<at>.*\.mlp\.)(?:gate|up)_proj\.weight"), ("gate_proj", "up_proj")),  # not mlp.experts.E.
    (re.compile(r"(?P<at>.*\.experts\.\d+\.)w[13]\.weight"), ("w1", "w3")),
)


def fused_sets(names: Iterable[str]) -> dict[str, tuple[str, ...]]:
    """Each weight -> the names of the weights that share its NVFP4 global scale (itself alone outside a set, or
    when a member of its set is not among `names`)."""
    present = set(names)
    out = {}
    for name in present:
        members = (name,)
        for pattern, modules in FUSED:
            m = pattern.fullmatch(name)
            if m and all(f"{m['at']}{x}.weight" in present for x in modules):
                members = tuple(f"{m['at']}{x}.weight" for x in modules)
        out[name] = members
    return out


def e2m1_codes(values: torch.Tensor) -> torch.Tensor:
    """The nibble of each float32 value: the nearest magnitude (ties to the even code), clamped at 6, sign bit 8."""
    distance = (values.abs().clamp(max=E2M1_MAX).unsqueeze(-1) - MAGNITUDES).abs()
    nearest = distance == distance.min(-1, keepdim=True).values
    even = torch.arange(8) % 2 == 0
    code = (nearest.float() * (1 + even.float())).argmax(-1)  # of two nearest (neighbours), the even one
    return (code + 8 * (values < 0)).to(torch.uint8)


def pack(codes: torch.Tensor) -> torch.Tensor:
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """float32 values of the packed nibbles, two a byte, the even column low."""
    codes = torch.stack([packed & 15, packed >> 4], dim=-1).reshape(packed.shape[0], -1).long()
    return torch.where(codes >= 8, -MAGNITUDES[codes % 8], MAGNITUDES[codes % 8])


def nvfp4_global(weights: list[torch.Tensor]) -> torch.Tensor:
    """float32 [1]: 448 x 6 / amax over the fused set, in the weights' dtype (torch's `float / tensor`)."""
    amax = max(w.abs().max() for w in weights).reshape(1)
    scale = (E4M3_MAX * E2M1_MAX / amax.clamp(min=torch.finfo(amax.dtype).tiny)).float()
    return torch.where(torch.isfinite(scale), scale, torch.ones_like(scale))


def nvfp4(weight: torch.Tensor, global_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed uint8 [rows, cols / 2], e4m3 scales [rows, cols / 16]) of a weight in its dtype."""
    rows, cols = weight.shape
    groups = weight.reshape(rows, cols // NVFP4_GROUP, NVFP4_GROUP)
    amax = groups.abs().amax(-1)  # in the weight's dtype
    scale = (global_scale * (amax / E2M1_MAX).float()).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float()
    scale = torch.where(scale == 0, torch.full_like(scale, NVFP4_ZERO_SCALE), scale)
    values = groups.float() / (scale / global_scale).unsqueeze(-1)
    return pack(e2m1_codes(values).reshape(rows, cols)), scale.to(torch.float8_e4m3fn)


def nvfp4_dequantized(packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    per_value = (scale.float() / global_scale.float()).repeat_interleave(NVFP4_GROUP, dim=1)
    return unpack(packed) * per_value


def mxfp4_dequantized(packed: torch.Tensor, exponent: torch.Tensor) -> torch.Tensor:
    per_value = torch.pow(2.0, exponent.int() - 127).float().repeat_interleave(MXFP4_GROUP, dim=1)
    return unpack(packed) * per_value


def within_e2m1(got: torch.Tensor, reference: torch.Tensor, per_value_scale: torch.Tensor) -> torch.Tensor:
    """Whether each dequantized value is where e2m1 rounding can put it: a value v = w / scale rounds within half
    the spacing around it (1/4 up to 2, 1/2 up to 4, 1 up to 6; beyond 6 it is clipped to 6), so
    |got - w| <= spacing(v) / 2 x scale, with a little room for float32."""
    v = (reference.float() / per_value_scale).abs()
    half = torch.where(v <= 2, 0.25, torch.where(v <= 4, 0.5, 1.0))
    allowed = torch.maximum(half, v - E2M1_MAX) * per_value_scale
    return (got - reference.float()).abs() <= allowed * (1 + 2.0**-20)

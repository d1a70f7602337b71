"""FP8 weights as their layouts are published (DeepSeek-V3's fp8 `weight_dequant`, compressed-tensors'
`calculate_qparams` per channel), written here block by block, never from distmerge/quantize/fp8.py: the expected
bytes of the FP8 tests.

    scale  = amax(|w| in float32 over a 128 x 128 block, the edge ones cut short; or over a row) / 448
             (448: float8_e4m3fn's largest value; an all-zero block or row takes float32's eps)
    q      = clamp(w / scale, -448, 448) cast to float8_e4m3fn (round to nearest even)
    w     ~= q x scale, within half a unit in the last place of e4m3 (3 mantissa bits: 2^-4 |w|), or 2^-10 x scale
             below e4m3's normal range
    names  fp8-block: `<weight>_scale_inv` [ceil(rows / 128), ceil(cols / 128)], config quant_method "fp8" with
           weight_block_size [128, 128]; fp8-channel: `<weight>_scale` [rows, 1], config quant_method
           "compressed-tensors", format "float-quantized", 8-bit channel weights
"""

from __future__ import annotations

import math

import torch

E4M3_MAX = 448.0
EPS = torch.finfo(torch.float32).eps
BLOCK = 128
SCALE_NAMES = {"fp8-block": "_scale_inv", "fp8-channel": "_scale"}


def recipe_block(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's layout: per 128 x 128 block (the last ones in each direction cut short) s = amax / 448 and
    q = cast(w / s) to float8_e4m3fn; an all-zero block gets float32's eps."""
    w = w.float()
    rows, cols = w.shape
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    s = torch.empty(math.ceil(rows / BLOCK), math.ceil(cols / BLOCK))
    for i in range(0, rows, BLOCK):
        for j in range(0, cols, BLOCK):
            block = w[i : i + BLOCK, j : j + BLOCK]
            scale = block.abs().max() / E4M3_MAX
            scale = torch.tensor(EPS) if scale == 0 else scale
            s[i // BLOCK, j // BLOCK] = scale
            q[i : i + BLOCK, j : j + BLOCK] = (block / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q, s


def recipe_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """compressed-tensors' FP8 per channel: one scale per output row, the same rule."""
    w = w.float()
    q = torch.empty(w.shape, dtype=torch.float8_e4m3fn)
    s = torch.empty(w.shape[0], 1)
    for r in range(w.shape[0]):
        scale = w[r].abs().max() / E4M3_MAX
        scale = torch.tensor(EPS) if scale == 0 else scale
        s[r, 0] = scale
        q[r] = (w[r] / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q, s


RECIPES = {"fp8-block": recipe_block, "fp8-channel": recipe_channel}


def each_scale(scheme: str, scale: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """Each element's float32 scale: its row's (fp8-channel), or its block's (fp8-block: 128 x 128, cut at the
    edges)."""
    rows, cols = shape
    if scheme == "fp8-channel":
        return scale.float().reshape(rows, 1).expand(rows, cols)
    return scale.float().repeat_interleave(BLOCK, 0)[:rows].repeat_interleave(BLOCK, 1)[:, :cols]


def dequantized(scheme: str, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 q x its scale."""
    return q.float() * each_scale(scheme, scale, tuple(q.shape))


def bound(reference: torch.Tensor, per_element_scale: torch.Tensor) -> torch.Tensor:
    """The largest |q x scale - w| the layout allows: 2^-4 |w| (e4m3 rounds to nearest with 3 mantissa bits) plus
    2^-10 x scale (e4m3's subnormal spacing is 2^-9), with a little room for float32."""
    return (reference.float().abs() * 2.0**-4 + per_element_scale * 2.0**-10) * (1 + 2.0**-20)


def scheme_in(config: dict) -> str | None:
    """The layout a config.json's quantization_config names, read as the loaders read it."""
    quant = config.get("quantization_config") or {}
    if quant.get("quant_method") == "fp8" and quant.get("weight_block_size") == [BLOCK, BLOCK]:
        return "fp8-block"
    weights = [g.get("weights") or {} for g in (quant.get("config_groups") or {}).values()]
    if quant.get("quant_method") == "compressed-tensors" and quant.get("format") == "float-quantized" and weights \
            and all(w.get("num_bits") == 8 and w.get("strategy") == "channel" and w.get("type") == "float"
                    for w in weights):
        return "fp8-channel"
    return None

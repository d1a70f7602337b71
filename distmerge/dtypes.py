"""The dtype table shared by readers, planner and writer: safetensors code <-> torch dtype <-> size."""

from __future__ import annotations

import torch

from distmerge.errors import DistmergeError

# safetensors dtype code -> torch dtype. Sizes come from torch so the table cannot drift.
_CODES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
for _code, _name in (("U16", "uint16"), ("U32", "uint32"), ("U64", "uint64")):
    if hasattr(torch, _name):
        _CODES[_code] = getattr(torch, _name)

_BY_DTYPE = {dtype: code for code, dtype in _CODES.items()}

# --dtype choices -> safetensors code; "keep" maps to None.
CAST_CHOICES: dict[str, str | None] = {"keep": None, "bf16": "BF16", "fp16": "F16", "fp32": "F32",
                                       "bfloat16": "BF16", "float16": "F16", "float32": "F32"}


def code_of(dtype: torch.dtype) -> str:
    try:
        return _BY_DTYPE[dtype]
    except KeyError:
        raise DistmergeError(f"tensors of dtype {dtype} cannot be stored in safetensors") from None


def torch_dtype(code: str) -> torch.dtype:
    return _CODES[code]


def itemsize(code: str) -> int:
    try:
        return _CODES[code].itemsize
    except KeyError:
        raise DistmergeError(f"unknown safetensors dtype {code!r}") from None


def is_float(code: str) -> bool:
    return _CODES[code].is_floating_point


def hf_dtype_name(code: str) -> str:
    """The name config.json uses for the dtype ("bfloat16", "float32", ...)."""
    return str(_CODES[code]).removeprefix("torch.")


def announced(code: str) -> bool:
    """Whether config.json's dtype may name it: a floating dtype, but float8_e4m3fn, which holds scaled weights that
    loaders dequantize into the dtype of the rest (DeepSeek-V3's FP8 config says bfloat16)."""
    return is_float(code) and code != "F8_E4M3"

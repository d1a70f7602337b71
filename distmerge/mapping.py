"""The contract between model families and the engine: units of work, declared as data."""

from __future__ import annotations

import math
from dataclasses import dataclass

from distmerge import dtypes


@dataclass(frozen=True, kw_only=True)
class SourceMeta:
    """A global source tensor as the plan sees it (all fragments merged)."""

    name: str
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True, kw_only=True)
class Target:
    """One output tensor: its Hugging Face name, shape and output dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * dtypes.itemsize(self.dtype)


@dataclass(frozen=True, kw_only=True)
class Unit:
    """Assemble `sources`, apply the named transform (see transforms.py), produce `targets`.

    A unit is never split across output files, so one owner holds everything it needs.
    """

    sources: tuple[str, ...]
    targets: tuple[Target, ...]
    transform: str = "identity"
    params: tuple[tuple[str, object], ...] = ()


def output_dtype(source_dtype: str, cast: str | None) -> str:
    """--dtype casts floating tensors only; integer and bool buffers keep their dtype."""
    return cast if cast and dtypes.is_float(source_dtype) else source_dtype

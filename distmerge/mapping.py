"""The contract between model families and the engine: units of work, declared as data."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from distmerge import dtypes


@dataclass(frozen=True, kw_only=True)
class SourceMeta:
    """A global source tensor as the plan sees it (all fragments merged)."""

    name: str
    dtype: str
    shape: tuple[int, ...]


# Output files of the non-model groups (the model group is split by size and named model-0000i-of-...).
GROUP_FILES = {"adapter": "lora_adapter/adapter_model.safetensors"}


@dataclass(frozen=True, kw_only=True)
class Target:
    """One output tensor: its Hugging Face name, shape and output dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    group: str = "model"  # "model": the sharded model files; "adapter": lora_adapter/adapter_model.safetensors

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


@dataclass(frozen=True, kw_only=True)
class LoraOptions:
    mode: str = "auto"  # auto (= adapter when LoRA keys exist), adapter, merge
    alpha: float | None = None  # overrides lora_train_meta.json
    base_model: str | None = None  # base_model_name_or_path for adapter_config.json


@dataclass(frozen=True, kw_only=True)
class FamilyContext:
    """What a family may consult besides the tensors: the HF config, the format's details, the options."""

    config: dict[str, Any]
    cast: str | None
    details: dict[str, Any] = field(default_factory=dict)
    lora: LoraOptions = field(default_factory=LoraOptions)
    output: str = ""


@dataclass(frozen=True, kw_only=True)
class FamilyResult:
    units: list[Unit]
    extra_files: dict[str, dict[str, Any]] = field(default_factory=dict)  # relative path -> JSON to write
    notes: list[str] = field(default_factory=list)

"""Rank 0: the Hugging Face folder an import reads: its config.json and where each tensor's bytes lie.

A folder holding config.json and safetensors weights (model.safetensors, or the files model.safetensors.index.json
names), on disk or in an object store: it is looked at through the input's Source (input/source.py, walked once,
as merge's input), never asked which. The headers are read without trusting them (formats/safetensors_header.py);
no tensor byte is read here. The Model carries the source's record of the weight files (`walked`), by which every
rank opens them (read.Files).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from distmerge.errors import InputError
from distmerge.formats.safetensors_header import read_header
from distmerge.input.local import LocalSource
from distmerge.input.source import Source

INDEX = "model.safetensors.index.json"
CONFIG_CAP = 4 << 20


@dataclass(frozen=True, kw_only=True)
class Tensor:
    """A Hugging Face tensor: its file (relative to the folder), the offset of its first byte, dtype, shape."""

    name: str
    file: str
    start: int
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True, kw_only=True)
class Model:
    root: str  # the input as checks and messages name it: the folder, resolved, or its URL
    config: dict[str, Any]
    tensors: dict[str, Tensor]
    walked: Any = None  # the source's record of the weight files (local.Walked), None when no file holds them


def discover(src: Source) -> Model:
    """The model in the walked source `src`, or InputError in one line when it is not a Hugging Face model
    folder."""
    root, location = Path(src.root), src.url
    config = _config(src, root, location, "is not a Hugging Face model folder")
    tensors: dict[str, Tensor] = {}
    files = _weight_files(src, root, location)
    for file in files:
        for name, e in read_header(src, root / file).entries.items():
            if name in tensors:
                raise InputError(f"{location}: {name} is in both {tensors[name].file} and {file}")
            tensors[name] = Tensor(name=name, file=file, start=e.start, dtype=e.dtype, shape=e.shape)
    return Model(root=src.shown(str(root)), config=config, tensors=tensors,
                 walked=src.record(root, [root / f for f in files]))


def discover_config(location: Path) -> dict[str, Any]:
    """config.json of the folder `location` (--hf-config), or InputError in one line."""
    src = LocalSource(location)
    src.walk()
    return _config(src, Path(src.root), location, "holds no model config")


def _config(src: Source, root: Path, location: Path | str, what: str) -> dict[str, Any]:
    if not src.is_file(root / "config.json"):
        raise InputError(f"{location} {what}: it has no config.json")
    config = src.read_json(root / "config.json", CONFIG_CAP, "config.json")
    if not isinstance(config, dict):
        raise InputError(f"{location}/config.json is not a JSON object")
    return config


def _weight_files(src: Source, root: Path, location: Path | str) -> list[str]:
    if src.is_file(root / INDEX):
        index = src.read_json(root / INDEX, CONFIG_CAP, INDEX)
        weights = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weights, dict):
            raise InputError(f"{location}/{INDEX} has no weight_map")
        files = sorted(set(weights.values()))
        missing = [f for f in files if not src.is_file(root / f)]
        if missing:
            raise InputError(f"{location}/{INDEX} names {missing[0]}, which is not in the folder")
        return files
    if src.is_file(root / "model.safetensors"):
        return ["model.safetensors"]
    raise InputError(f"{location} holds no safetensors weights (model.safetensors or {INDEX}): distmerge import "
                     "reads a Hugging Face model saved with safe_serialization")


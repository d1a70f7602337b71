"""What every input format hands the engine: the files of a checkpoint and the fragments inside them."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from distmerge.errors import InputError


@dataclass(frozen=True, kw_only=True)
class InputFile:
    """One file of the checkpoint; `rank` is the training rank that wrote it (-1 when not per-rank)."""

    index: int
    path: str  # relative to the input folder
    size: int
    rank: int = -1
    mtime_ns: int = 0  # with size, tells --resume whether the input changed since the interrupted run


def input_file(root: Path, index: int, path: str, rank: int = -1) -> InputFile:
    st = inside(root, path).stat()
    return InputFile(index=index, path=path, size=st.st_size, rank=rank, mtime_ns=st.st_mtime_ns)


def inside(root: Path, path: str) -> Path:
    """root/path, refusing names (from a listing or from metadata) and links that lead out of the input."""
    resolved = (root / path).resolve()
    if not resolved.is_relative_to(root.resolve()):
        raise InputError(f"{root}: {path} leads outside the input folder (to {resolved}); distmerge does not follow it")
    return resolved


@dataclass(frozen=True, kw_only=True)
class Scan:
    """What rank 0 found in the input folder, broadcast to every rank before any file is opened."""

    format: str
    root: str
    files: tuple[InputFile, ...]
    hf_dir: str | None  # folder with config.json / tokenizer to copy, or None
    world_size: int  # training world size the checkpoint was saved with
    notes: tuple[str, ...] = ()
    details: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class Fragment:
    """A block of one global tensor held in one input file (the unit of reading and of transfer)."""

    name: str
    dtype: str  # safetensors code
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    lengths: tuple[int, ...]
    file_index: int
    byte_offset: int  # first byte in the file; -1: only readable through the view its reader keeps
    key: str  # the entry's key in its file, for the view fallback and for messages

    @property
    def numel(self) -> int:
        return math.prod(self.lengths)


@dataclass
class OpenedFile:
    """A file opened by its reading rank: its fragments, plus views kept only for the fallback path."""

    fragments: list[Fragment]
    views: dict[tuple[str, tuple[int, ...]], torch.Tensor] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)
    layout: dict[str, int] = field(default_factory=dict)  # sharding description -> entry count


class InputFormat(Protocol):
    name: str

    def detect(self, root: Path) -> bool: ...

    def scan(self, root: Path) -> Scan: ...

    def open(self, scan: Scan, file: InputFile) -> OpenedFile: ...

"""Reading a safetensors header without trusting it: size bounded, JSON checked, every tensor's byte range
inside the file, no two ranges overlapping, each range exactly shape x dtype bytes."""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from distmerge import dtypes
from distmerge.errors import CorruptInputError
from distmerge.input.source import Source

MAX_HEADER = 100 * 2**20  # the safetensors library's own limit
# A header entry costs ~100-200 bytes of JSON per tensor; a 671B model in one file (~92k tensors) needs ~15 MB.
# Headers past HEADER_FLOOR may take at most a quarter of the file: JSON parses to ~10x its size in objects.
HEADER_FLOOR = 2**20


def header_limit(file_size: int) -> int:
    return min(MAX_HEADER, HEADER_FLOOR + max(file_size, 0) // 4)


@dataclass(frozen=True, kw_only=True)
class Entry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute file offset of the first byte
    nbytes: int


@dataclass(frozen=True, kw_only=True)
class Header:
    entries: dict[str, Entry]
    metadata: dict[str, str]


def read_header(src: Source, path: Path) -> Header:
    """The checked header of the safetensors file at `path`, opened through `src` (inside the input: the file the
    walk listed, no link or FIFO instead)."""
    with src.open(path) as f:
        size = f.size
        head = f.pread(8, 0)
        if len(head) < 8:
            raise CorruptInputError(f"{path} is too short to be a safetensors file")
        (length,) = struct.unpack("<Q", head)
        if length > size - 8:
            raise CorruptInputError(f"{path}: header length {length} does not fit the file: truncated or corrupt")
        if length > header_limit(size):
            raise CorruptInputError(f"{path}: header of {length} bytes, over the limit of {header_limit(size)} "
                                    f"(1 MiB + a quarter of the file, at most {MAX_HEADER})")
        raw = f.pread(length, 8)
    try:
        parsed = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise CorruptInputError(f"{path}: the safetensors header is not valid JSON") from None
    if not isinstance(parsed, dict):
        raise CorruptInputError(f"{path}: the safetensors header is not a JSON object")
    metadata = parsed.pop("__metadata__", None) or {}
    entries = {name: _entry(path, name, spec, 8 + length, size) for name, spec in parsed.items()}
    _check_overlaps(path, entries)
    return Header(entries=entries, metadata=metadata if isinstance(metadata, dict) else {})


def _entry(path: Path, name: str, spec: Any, data_start: int, size: int) -> Entry:
    try:
        code, shape, (begin, end) = spec["dtype"], tuple(int(n) for n in spec["shape"]), spec["data_offsets"]
        itemsize = dtypes.itemsize(code)
    except (KeyError, TypeError, ValueError):
        raise CorruptInputError(f"{path}: the header entry of {name} is malformed") from None
    if any(n < 0 for n in shape) or not (0 <= begin <= end) or data_start + end > size:
        raise CorruptInputError(f"{path}: the bytes of {name} lie outside the file: truncated or corrupt")
    if end - begin != math.prod(shape) * itemsize:
        raise CorruptInputError(f"{path}: {name} has {end - begin} bytes for shape {list(shape)} {code}")
    return Entry(name=name, dtype=code, shape=shape, start=data_start + begin, nbytes=end - begin)


def _check_overlaps(path: Path, entries: dict[str, Entry]) -> None:
    ordered = sorted((e for e in entries.values() if e.nbytes), key=lambda e: e.start)
    for a, b in zip(ordered, ordered[1:], strict=False):
        if b.start < a.start + a.nbytes:
            raise CorruptInputError(f"{path}: the bytes of {a.name} and {b.name} overlap")



"""The bytes of a DCP save made without torch.distributed.checkpoint.save: its chunk blobs and its `.metadata`.

What torch's FileSystemWriter (torch/distributed/checkpoint/filesystem.py, default TORCH_SAVE format) writes:

    __R_K.distcp   blobs one after another: a tensor chunk is torch.save of the chunk tensor (its own storage, no
                   more), a bytes entry the object's torch.save bytes as they are
    .metadata      pickle of Metadata(state_dict_metadata = {key: TensorStorageMetadata(properties, size, chunks)
                   | BytesStorageMetadata()}, storage_data = {MetadataIndex(key, offsets): _StorageInfo(file,
                   offset, length)}, version)

torch.save's bytes depend only on the tensor (its zip records carry no time; the serialization id is a hash of
the records), so a chunk's blob is the same whichever process makes it. The classes are torch's own, so the torch
that loads the save reads them as its own save's.
"""

from __future__ import annotations

import io
import pickle
import sys
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any

import torch

DCP_VERSION = "1.0.0"  # Metadata.version as torch 2.13's FileSystemWriter writes it (CURRENT_DCP_VERSION)


@dataclass(frozen=True, kw_only=True)
class Entry:
    """One blob written: a chunk of the tensor `key` (`offsets`, `lengths` in its `global_shape`), or, with
    `dtype` None, a bytes entry; where it lies (`file`, `offset`, `length`)."""

    key: str
    file: str
    offset: int
    length: int
    dtype: torch.dtype | None = None
    global_shape: tuple[int, ...] = ()
    offsets: tuple[int, ...] = ()
    lengths: tuple[int, ...] = ()


def tensor_blob(chunk: torch.Tensor) -> bytes:
    """torch.save of the chunk as it would save a tensor of its own (a view would carry its whole storage)."""
    own = chunk.detach().to("cpu").clone(memory_format=torch.contiguous_format)
    buf = io.BytesIO()
    torch.save(own, buf)
    return buf.getvalue()


@lru_cache(maxsize=256)
def tensor_blob_length(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    """The length of tensor_blob of any chunk of this shape and dtype, so that blobs are placed before they are
    made (several processes write one file). torch.save's length does not depend on the values: the CRC-32s and
    the serialization id it records are fixed-width. Measured once per shape, on an uninitialised tensor whose
    pages are only read (the kernel's zero page: no memory taken) and a writer that keeps nothing but the count."""
    counted = _Counted()
    torch.save(torch.empty(shape, dtype=dtype), counted)
    return counted.length


class _Counted:
    """A file torch.save writes to that keeps only how many bytes it was given."""

    def __init__(self) -> None:
        self.length = 0

    def write(self, data: Any) -> int:
        size = memoryview(data).nbytes
        self.length += size
        return size

    def flush(self) -> None:
        """Nothing is kept, so nothing to flush."""


def object_blob(value: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


def metadata_bytes(entries: list[Entry]) -> bytes:
    """The `.metadata` of a save holding `entries`, keys and chunks in sorted order (the same bytes for the same
    entries, whatever order they were written in, and whichever processes made them: pickle writes a string once
    per object and refers back to it after, so equal strings are made one object first, sys.intern)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    ordered = sorted(entries, key=lambda e: (e.key, e.offsets))
    state: dict[str, Any] = {}
    storage = {}
    for e in ordered:
        e = replace(e, key=sys.intern(e.key), file=sys.intern(e.file))
        if e.dtype is None:
            state[e.key] = BytesStorageMetadata()
            storage[MetadataIndex(fqn=e.key)] = _StorageInfo(relative_path=e.file, offset=e.offset, length=e.length)
            continue
        meta = state.setdefault(e.key, TensorStorageMetadata(properties=TensorProperties(dtype=e.dtype),
                                                             size=torch.Size(e.global_shape), chunks=[]))
        meta.chunks.append(ChunkStorageMetadata(offsets=torch.Size(e.offsets), sizes=torch.Size(e.lengths)))
        storage[MetadataIndex(fqn=e.key, offset=torch.Size(e.offsets))] = _StorageInfo(
            relative_path=e.file, offset=e.offset, length=e.length)
    made = Metadata(state_dict_metadata=state, planner_data=None, storage_data=storage, version=DCP_VERSION)
    return pickle.dumps(made, protocol=pickle.HIGHEST_PROTOCOL)

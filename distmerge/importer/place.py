"""Where each blob of the import's files lies, decided from the plan before any blob is made, so that several
processes write one file: each chunk's blob at its place, whichever process makes it.

A file is its objects' blobs (in key order), then its chunks' (in key and offset order), one after another, as
the owner of a whole file used to append them. A blob's length depends only on its chunk's shape and dtype
(dcp.tensor_blob_length), so the places, the file's size and `.metadata`'s entries are the plan's alone: the
same for every number of processes.
"""

from __future__ import annotations

from dataclasses import dataclass

from distmerge import dtypes
from distmerge.formats.megatron.dist_layout import EXTRA_STATE_OBJECT
from distmerge.formats.torch_private.dcp import write as dcp
from distmerge.importer.plan import DistFile


@dataclass(frozen=True, kw_only=True)
class Placed:
    """One file's blobs: `entries` (where each lies, as `.metadata` names them) and its size."""

    name: str
    entries: tuple[dcp.Entry, ...]
    size: int

    def chunk_at(self) -> dict[tuple[str, tuple[int, ...]], dcp.Entry]:
        return {(e.key, e.offsets): e for e in self.entries if e.dtype is not None}


def object_bytes() -> bytes:
    """The one object megatron-core saves per linear module and layer (an empty _extra_state)."""
    return dcp.object_blob(EXTRA_STATE_OBJECT)


def place(f: DistFile, dtype_of: dict[str, str]) -> Placed:
    """The blobs of `f` one after another; `dtype_of`: each chunk's tensor's safetensors dtype."""
    entries, at = [], 0
    size = len(object_bytes())
    for obj in f.objects:
        entries.append(dcp.Entry(key=obj.key, file=f.name, offset=at, length=size))
        at += size
    for chunk in f.chunks:
        dtype = dtypes.torch_dtype(dtype_of[chunk.tensor])
        length = dcp.tensor_blob_length(tuple(chunk.lengths), dtype)
        entries.append(dcp.Entry(key=chunk.key, file=f.name, offset=at, length=length, dtype=dtype,
                                 global_shape=chunk.global_shape, offsets=chunk.offsets, lengths=chunk.lengths))
        at += length
    return Placed(name=f.name, entries=tuple(entries), size=at)

"""torch.distributed.checkpoint internals: the `.metadata` pickle and the chunk blobs in `.distcp` files.

    .metadata      pickle (protocol 4) of Metadata: state_dict_metadata {fqn: TensorStorageMetadata(size,
                   chunks=[ChunkStorageMetadata(offsets, sizes)]) | BytesStorageMetadata}, storage_data
                   {MetadataIndex(fqn, offset): _StorageInfo(relative_path, offset, length)}
    __R_I.distcp   per chunk, at [offset, offset+length): a whole torch.save zip of the chunk tensor
                   (the default TORCH_SAVE format), or its raw bytes (SAFETENSORS format: length ==
                   numel * itemsize)

Both pickles are read by a restricted unpickler: every global maps to an inert record or a plain value.
"""

from __future__ import annotations

import io
import math
import os
import pickle
import struct
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from distmerge.errors import CorruptInputError
from distmerge.formats.torch_private.restricted import TENSOR_GLOBALS, Record, TensorRef, as_text, loads

_METADATA_GLOBALS: dict[tuple[str, str], Any] = {
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): as_text,
    ("pathlib", "PosixPath"): as_text,
    ("pathlib", "WindowsPath"): as_text,
    ("pathlib", "Path"): as_text,
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): Record,
    **{
        ("torch.distributed.checkpoint.metadata", name): Record
        for name in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                     "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
    },
    # Megatron-core's torch_dist saves keep every rank's save plan in the metadata (all_local_plans).
    **{
        ("torch.distributed.checkpoint.planner", name): Record
        for name in ("SavePlan", "WriteItem", "TensorWriteData", "WriteItemType")
    },
}


_BLOB_GLOBALS = TENSOR_GLOBALS


@dataclass(frozen=True, kw_only=True)
class Chunk:
    fqn: str
    dtype: torch.dtype
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    lengths: tuple[int, ...]
    file: str
    offset: int  # of the blob in the file
    length: int


@dataclass(frozen=True, kw_only=True)
class DcpMetadata:
    chunks: tuple[Chunk, ...]
    non_tensors: tuple[str, ...]  # bytes entries (RNG, dataloader, train state)


def read_metadata(path: Path) -> DcpMetadata:
    try:
        md = loads(path.read_bytes(), _METADATA_GLOBALS)
        tensors = {fqn: m for fqn, m in md.state_dict_metadata.items() if hasattr(m, "chunks")}
        where = {(i.fqn, tuple(getattr(i, "offset", None) or ())): s for i, s in md.storage_data.items()}
        chunks = []
        for fqn, meta in tensors.items():
            dtype = meta.properties._state[0] if hasattr(meta.properties, "_state") else meta.properties.dtype
            for c in meta.chunks:
                info = where[(fqn, tuple(c.offsets))]
                chunks.append(Chunk(fqn=fqn, dtype=dtype, global_shape=tuple(meta.size), offsets=tuple(c.offsets),
                                    lengths=tuple(c.sizes), file=info.relative_path, offset=info.offset,
                                    length=info.length))
    except (pickle.UnpicklingError, AttributeError, KeyError, TypeError, EOFError, ValueError) as err:
        raise CorruptInputError(f"{path} is not a DCP metadata file distmerge can read safely ({err})") from None
    non_tensors = tuple(sorted(set(md.state_dict_metadata) - set(tensors)))
    return DcpMetadata(chunks=tuple(chunks), non_tensors=non_tensors)


class _Window(io.RawIOBase):
    """A read-only view of bytes [start, start+length) of an open file, for zipfile."""

    def __init__(self, fd: int, start: int, length: int) -> None:
        self.fd, self.start, self.length, self.pos = fd, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, pos: int, whence: int = 0) -> int:
        self.pos = {0: pos, 1: self.pos + pos, 2: self.length + pos}[whence]
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readinto(self, buf) -> int:
        n = max(0, min(len(buf), self.length - self.pos))
        data = os.pread(self.fd, n, self.start + self.pos)
        buf[: len(data)] = data
        self.pos += len(data)
        return len(data)


LOCAL_HEADER = b"PK\x03\x04"
PREFIX = 1 << 16  # data.pkl and the small records before the storage fit here in practice


def chunk_data_offset(fd: int, chunk: Chunk, itemsize: int) -> int:
    """Absolute file offset of the chunk's first element. Raw chunks start at the blob. torch.save blobs
    write data.pkl first, then a few tiny records, then the storage: walking the zip's local headers in
    one read of the blob's start finds it; anything unusual goes through zipfile's central directory."""
    numel = math.prod(chunk.lengths)
    if chunk.length == numel * itemsize:
        return chunk.offset
    head = os.pread(fd, min(chunk.length, PREFIX), chunk.offset)
    ref, at = None, 0
    while head[at : at + 4] == LOCAL_HEADER and at + 30 <= len(head):
        flags, method = struct.unpack_from("<HH", head, at + 6)
        (size,) = struct.unpack_from("<I", head, at + 18)
        name_len, extra_len = struct.unpack_from("<HH", head, at + 26)
        name = head[at + 30 : at + 30 + name_len].decode(errors="replace")
        data = at + 30 + name_len + extra_len
        if flags & 0x08 or method != zipfile.ZIP_STORED or size == 0xFFFFFFFF:
            break
        if name.endswith("data.pkl") and data + size <= len(head):
            ref = _tensor_ref(head[data : data + size], chunk)
        elif ref is not None and name.endswith(f"/data/{ref.storage.key}"):
            return chunk.offset + data + ref.storage_offset * itemsize
        at = data + size
    return _offset_via_directory(fd, chunk, itemsize)


def _tensor_ref(pickled: bytes, chunk: Chunk) -> TensorRef:
    ref = loads(pickled, _BLOB_GLOBALS)
    if not isinstance(ref, TensorRef) or ref.size != chunk.lengths:
        raise CorruptInputError(f"{chunk.file}: the chunk of {chunk.fqn} does not hold a tensor of its shape")
    if not ref.contiguous:
        raise CorruptInputError(f"{chunk.file}: the chunk of {chunk.fqn} is saved non-contiguous")
    return ref


def _offset_via_directory(fd: int, chunk: Chunk, itemsize: int) -> int:
    window = _Window(fd, chunk.offset, chunk.length)
    with zipfile.ZipFile(window) as blob:
        names = blob.namelist()
        pkl = next(n for n in names if n.endswith("data.pkl"))
        ref = _tensor_ref(blob.read(pkl), chunk)
        info = blob.getinfo(f"{pkl.rsplit('/', 1)[0]}/data/{ref.storage.key}")
    if info.compress_type != zipfile.ZIP_STORED:
        raise CorruptInputError(f"{chunk.file}: the chunk of {chunk.fqn} is compressed")
    header = os.pread(fd, 30, chunk.offset + info.header_offset)
    name_len, extra_len = struct.unpack("<HH", header[26:30])
    return chunk.offset + info.header_offset + 30 + name_len + extra_len + ref.storage_offset * itemsize

"""torch.distributed.checkpoint internals: the `.metadata` pickle and the chunk blobs in `.distcp` files.

    .metadata      pickle (protocol 4) of Metadata: state_dict_metadata {fqn: TensorStorageMetadata(size,
                   chunks=[ChunkStorageMetadata(offsets, sizes)]) | BytesStorageMetadata}, storage_data
                   {MetadataIndex(fqn, offset): _StorageInfo(relative_path, offset, length)}
    __R_I.distcp   per chunk, at [offset, offset+length): a whole torch.save zip of the chunk tensor
                   (the default TORCH_SAVE format), or its raw bytes (SAFETENSORS format: length ==
                   numel * itemsize)

Both pickles are read by a restricted unpickler: every global maps to an inert record or a plain value.
`.metadata` may be at most METADATA_FLOOR plus the bytes of the folder's `.distcp` files (metadata_budget):
a legitimate save's metadata is a small fraction of its data, so only a hostile file reaches it. Chunk blobs
are zip archives checked like any torch.save file (zip_records), and a chunk's view must lie inside its record.
"""

from __future__ import annotations

import math
import os
import pickle
import struct
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from distmerge import input_tree
from distmerge.errors import CorruptInputError
from distmerge.formats.torch_private import pickle_scan, zip_records
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


# .metadata's byte budget: this much, plus the bytes of the .distcp files beside it. A chunk costs ~250 bytes of
# metadata (~500 with megatron's save plans) and at least ~1 KB in its .distcp (a torch.save blob), or its
# elements (raw); a 671B model's torch_dist save (~2M chunks, ~1 GB of metadata beside >1.3 TB) fits easily.
METADATA_FLOOR = 256 * pickle_scan.MiB
BLOB_PICKLE = pickle_scan.Budget(max_bytes=pickle_scan.MiB)  # a chunk blob's data.pkl describes one tensor


def metadata_budget(path: Path) -> pickle_scan.Budget:
    data = 0
    with os.scandir(path.parent) as entries:
        for entry in entries:
            if entry.name.endswith(".distcp") and entry.is_file(follow_symlinks=False):
                data += entry.stat(follow_symlinks=False).st_size
    return pickle_scan.Budget(max_bytes=METADATA_FLOOR + data)


def read_metadata(path: Path) -> DcpMetadata:
    budget = metadata_budget(path)
    with input_tree.open_input(path) as f:
        size = f.size
        if size > budget.max_bytes:
            raise CorruptInputError(f"{path} is {size} bytes, over the limit of {budget.max_bytes} (max_bytes: "
                                    f"{METADATA_FLOOR} + the .distcp files' bytes) for a DCP metadata file")
        raw = f.pread(size + 1, 0)  # what fstat saw (the budget may be far larger: sparse or huge .distcp files)
        if len(raw) > size:
            raise CorruptInputError(f"{path} grew while distmerge read it: is a job still writing this checkpoint?")
    try:
        md = loads(raw, _METADATA_GLOBALS, where=str(path), storages={}, budget=budget)
        tensors = {_text(fqn): m for fqn, m in md.state_dict_metadata.items() if hasattr(m, "chunks")}
        _check_counts(path, tensors, md.storage_data)
        where = {(_text(i.fqn), _ints(getattr(i, "offset", None) or ())): s for i, s in md.storage_data.items()}
        chunks = [_chunk(fqn, meta, c, where) for fqn, meta in tensors.items() for c in meta.chunks]
    except (pickle.UnpicklingError, AttributeError, KeyError, TypeError, EOFError, ValueError) as err:
        raise CorruptInputError(f"{path} is not a DCP metadata file distmerge can read safely ({err})") from None
    non_tensors = tuple(sorted(set(map(_text, md.state_dict_metadata)) - set(tensors)))
    return DcpMetadata(chunks=tuple(chunks), non_tensors=non_tensors)


def _check_counts(path: Path, tensors: dict[str, Any], storage_data: Any) -> None:
    """Each chunk has its own entry in storage_data (where its bytes are): more chunks declared than entries is
    a list that repeats one object, refused before a record is built per chunk (10^7 references to one chunk
    cost 20 MB of pickle and would cost gigabytes of records)."""
    if not isinstance(storage_data, dict):
        raise TypeError("storage_data is not a dict")
    declared = 0
    for fqn, meta in tensors.items():
        if not isinstance(meta.chunks, list):
            raise TypeError(f"the chunks of {fqn} are not a list")
        declared += len(meta.chunks)
    if declared > len(storage_data):
        raise CorruptInputError(f"{path} declares {declared:,} chunks but says where {len(storage_data):,} of them "
                                "are: a list repeating one chunk, not metadata torch writes (limit: one storage "
                                "entry per chunk)")


def _chunk(fqn: str, meta: Any, c: Any, where: dict) -> Chunk:
    dtype = meta.properties._state[0] if hasattr(meta.properties, "_state") else meta.properties.dtype
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"the dtype of {fqn} is not a torch dtype")
    info = where[(fqn, _ints(c.offsets))]
    return Chunk(fqn=fqn, dtype=dtype, global_shape=_ints(meta.size), offsets=_ints(c.offsets),
                 lengths=_ints(c.sizes), file=_text(info.relative_path), offset=_ints((info.offset,))[0],
                 length=_ints((info.length,))[0])


def _text(value: Any) -> str:
    """Names become dict keys and messages: only real strings (a shared tuple hashes exponentially)."""
    if not isinstance(value, str):
        raise TypeError(f"a name that is a {type(value).__name__}, not a string")
    return value


def _ints(values: Any) -> tuple[int, ...]:
    if not isinstance(values, (tuple, list)) or not all(type(v) is int for v in values):
        raise TypeError("sizes and offsets that are not integers")
    return tuple(values)


LOCAL_HEADER = b"PK\x03\x04"
PREFIX = 1 << 16  # data.pkl and the small records before the storage fit here in practice


def chunk_data_offset(fd: Any, chunk: Chunk, itemsize: int) -> int:
    """Absolute file offset of the chunk's first element. Raw chunks start at the blob. torch.save blobs
    write data.pkl first, then a few tiny records, then the storage: walking the zip's local headers in
    one read of the blob's start finds it; anything unusual goes through zipfile's central directory."""
    numel = math.prod(chunk.lengths)
    if chunk.length == numel * itemsize:
        return chunk.offset
    fd = input_tree.readable(fd)
    head = fd.pread(min(chunk.length, PREFIX), chunk.offset)
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
            _check_inside(ref, chunk, itemsize, size, data + size <= chunk.length)
            return chunk.offset + data + ref.storage_offset * itemsize
        at = data + size
    return _offset_via_directory(fd, chunk, itemsize)


_ACCEPTED: dict[bytes, TensorRef] = {}  # blob pickles already checked: a tensor's chunks of one shape pickle alike
_ACCEPTED_MAX, _ACCEPTED_BYTES = 4096, 4096


def _tensor_ref(pickled: bytes, chunk: Chunk) -> TensorRef:
    ref = _ACCEPTED.get(pickled)
    if ref is None:
        try:
            ref = loads(pickled, _BLOB_GLOBALS, where=f"{chunk.file} (chunk of {chunk.fqn})", budget=BLOB_PICKLE)
        except (pickle.UnpicklingError, TypeError, ValueError, AttributeError, EOFError, IndexError) as err:
            raise CorruptInputError(f"{chunk.file}: the chunk of {chunk.fqn} cannot be read safely ({err})") from None
        if isinstance(ref, TensorRef) and len(pickled) <= _ACCEPTED_BYTES and len(_ACCEPTED) < _ACCEPTED_MAX:
            _ACCEPTED[pickled] = ref
    if not isinstance(ref, TensorRef) or ref.size != chunk.lengths:
        raise CorruptInputError(f"{chunk.file}: the chunk of {chunk.fqn} does not hold a tensor of its shape")
    if not ref.contiguous:
        raise CorruptInputError(f"{chunk.file}: the chunk of {chunk.fqn} is saved non-contiguous")
    return ref


def _check_inside(ref: TensorRef, chunk: Chunk, itemsize: int, record_size: int, record_inside: bool) -> None:
    """The chunk's elements lie inside their storage record, and the record inside the chunk's blob."""
    if not ref.check_shape() or ref.bytes_needed(itemsize) > record_size or not record_inside:
        raise CorruptInputError(f"{chunk.file}: the chunk of {chunk.fqn} reaches past its storage record "
                                "(limit: views stay inside their record, records inside the blob)")


def _offset_via_directory(fd: Any, chunk: Chunk, itemsize: int) -> int:
    where = f"{chunk.file} (chunk of {chunk.fqn})"
    found = zip_records.records(fd, where, chunk.offset, chunk.length)
    pkl, prefix = zip_records.pickle_record(found, where)
    if pkl.size > BLOB_PICKLE.max_bytes:
        raise CorruptInputError(f"{where}: its data.pkl is {pkl.size} bytes, over the limit of "
                                f"{BLOB_PICKLE.max_bytes} (max_bytes)")
    ref = _tensor_ref(zip_records.read(fd, pkl, chunk.offset), chunk)
    record = found.get(prefix + ref.storage.key)
    if record is None:
        raise CorruptInputError(f"{where}: no storage record {ref.storage.key}")
    _check_inside(ref, chunk, itemsize, record.size, True)
    return chunk.offset + record.start + ref.storage_offset * itemsize

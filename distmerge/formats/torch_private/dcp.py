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

import os
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from distmerge import input_tree
from distmerge.errors import CorruptInputError
from distmerge.formats.torch_private import pickle_scan
from distmerge.formats.torch_private.dcp_blobs import Chunk, chunk_data_offset, locate  # noqa: F401 (readers' names)
from distmerge.formats.torch_private.restricted import Record, as_text, loads

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


@dataclass(frozen=True, kw_only=True)
class DcpMetadata:
    chunks: tuple[Chunk, ...]
    non_tensors: tuple[str, ...]  # bytes entries (RNG, dataloader, train state)


# .metadata's byte budget: this much, plus the bytes of the .distcp files beside it. A chunk costs ~250 bytes of
# metadata (~500 with megatron's save plans) and at least ~1 KB in its .distcp (a torch.save blob), or its
# elements (raw); a 671B model's torch_dist save (~2M chunks, ~1 GB of metadata beside >1.3 TB) fits easily.
METADATA_FLOOR = 256 * pickle_scan.MiB


def metadata_budget(path: Path) -> pickle_scan.Budget:
    data = 0
    with os.scandir(path.parent) as entries:
        for entry in entries:
            if entry.name.endswith(".distcp") and entry.is_file(follow_symlinks=False):
                data += entry.stat(follow_symlinks=False).st_size
    return pickle_scan.Budget(max_bytes=METADATA_FLOOR + data)


def read_metadata(path: Path) -> DcpMetadata:
    budget = metadata_budget(path)
    fd, _ = input_tree.open_input(path)
    with os.fdopen(fd, "rb") as f:
        size = os.fstat(fd).st_size
        if size > budget.max_bytes:
            raise CorruptInputError(f"{path} is {size} bytes, over the limit of {budget.max_bytes} (max_bytes: "
                                    f"{METADATA_FLOOR} + the .distcp files' bytes) for a DCP metadata file")
        raw = f.read(size + 1)  # what fstat saw (the budget may be far larger: sparse or huge .distcp files)
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

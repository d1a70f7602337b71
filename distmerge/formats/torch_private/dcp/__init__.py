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

One part, its files by idea (`read_metadata` here is the way in):

    decode.py   the `.metadata` pickle taken apart without an object per chunk: frames, then a stack machine
                over the skeleton's opcodes (falls back to the general restricted unpickler on anything else)
    runs.py     the bulk of it, the chunks' and storage_data's records, matched and decoded in runs
    table.py    the chunk table: every chunk a row of integer columns, joined to its storage entry
    blobs.py    where a chunk's elements start inside its `.distcp` blob (one blob, or a file's in one pass)
"""

from __future__ import annotations

import ctypes
import functools
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from distmerge.errors import CorruptInputError
from distmerge.formats.torch_private import pickle_scan
from distmerge.formats.torch_private.dcp import decode, table
from distmerge.formats.torch_private.dcp.blobs import Chunk, chunk_data_offset, locate  # noqa: F401 (readers' names)
from distmerge.formats.torch_private.dcp.table import DcpMetadata
from distmerge.formats.torch_private.restricted import Record, as_text, loads
from distmerge.input.source import Source

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


# .metadata's byte budget: this much, plus the bytes of the .distcp files beside it. A chunk costs ~250 bytes of
# metadata (~500 with megatron's save plans) and at least ~1 KB in its .distcp (a torch.save blob), or its
# elements (raw); a 671B model's torch_dist save (~2M chunks, ~1 GB of metadata beside >1.3 TB) fits easily.
METADATA_FLOOR = 256 * pickle_scan.MiB


def metadata_budget(src: Source, path: Path) -> pickle_scan.Budget:
    """The budget of the `.metadata` at `path`: the regular `.distcp` files beside it (not links) count."""
    data = 0
    for name in src.listdir(path.parent):
        if name.endswith(".distcp") and (st := src.stat(path.parent / name, follow=False)).kind == "file":
            data += st.size
    return pickle_scan.Budget(max_bytes=METADATA_FLOOR + data)


def read_metadata(src: Source, path: Path) -> DcpMetadata:
    """The chunk table of a DCP `.metadata` (table.py), read through the input's source. Read by decode.py when
    the file is what torch's writer writes (seconds for a million chunks), else by the general reader
    (pickle_scan + restricted.loads), which refuses what it must with its own one-line reasons."""
    budget = metadata_budget(src, path)
    try:
        skeleton, names = decode.decode(_read(src, path, budget), _METADATA_GLOBALS)
        return table.table(skeleton, path, names)
    except CorruptInputError:
        raise
    except Exception:  # noqa: BLE001 - anything the fast reader does not take, the general one judges
        pass
    raw = _read(src, path, budget)
    try:
        md = loads(raw, _METADATA_GLOBALS, where=str(path), storages={}, budget=budget)
        del raw
        return table.table(md, path, [])
    except (pickle.UnpicklingError, AttributeError, KeyError, TypeError, EOFError, ValueError) as err:
        raise CorruptInputError(f"{path} is not a DCP metadata file distmerge can read safely ({err})") from None


def _read(src: Source, path: Path, budget: pickle_scan.Budget) -> bytes:
    with src.open(path) as f:
        size = f.size
        if size > budget.max_bytes:
            raise CorruptInputError(f"{path} is {size} bytes, over the limit of {budget.max_bytes} (max_bytes: "
                                    f"{METADATA_FLOOR} + the .distcp files' bytes) for a DCP metadata file")
        raw = f.pread(size + 1, 0)  # what fstat saw (the budget may be far larger: sparse or huge .distcp files)
        if len(raw) > size:
            raise CorruptInputError(f"{path} grew while distmerge read it: is a job still writing this checkpoint?")
    return raw


def return_freed_memory() -> None:
    """The heap freed since, handed back to the system: for the reader of `.metadata` once its table is no longer
    needed. The decoding's columns and the table's are tensors of a few megabytes, which glibc's malloc places in
    its heap (not in mappings of their own) once torch has freed a larger tensor (its mmap threshold rises, up to 32
    MB), and keeps there once freed: at 1024 ranks about 0.3 GB that rank 0 would carry through the merge."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL(None).malloc_trim  # glibc's; another C library (musl, macOS) has none: nothing to do
    except (OSError, AttributeError):
        return None

"""torch.save files read without torch.load: the pickle through the restricted reader, and the byte
offset of every storage record from the zip directory.

    file.pt (zip, stored)   <name>/data.pkl       the pickled object; tensors name their storage record
                            <name>/data/<key>     each storage's raw bytes, 64-byte aligned
                            <name>/byteorder, .format_version, ...

Megatron-LM's legacy model_optim_rng.pt pickles `args` (an argparse.Namespace holding megatron enums),
numpy RNG state and the model's tensors: globals of the modules in `TRAINING_MODULES` become inert
records, tensors become references, and nothing from the file runs.
"""

from __future__ import annotations

import mmap
import pickle
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from distmerge.errors import CorruptInputError
from distmerge.formats.torch_private import zip_records
from distmerge.formats.torch_private.restricted import (
    TENSOR_GLOBALS,
    OrderedDictStandIn,
    Record,
    SubclassTensor,
    TensorRef,
    loads,
)
from distmerge.input.source import Source

# Training metadata a trainer pickles beside its tensors; read as inert records, never as live objects.
TRAINING_MODULES = ("argparse", "numpy", "megatron", "transformer_engine", "enum", "_io", "io", "types", "apex")


def _latin1_bytes(text: str, encoding: str = "latin1") -> bytes:
    """Protocol-2 pickles spell bytes as _codecs.encode(text, 'latin1'); nothing else is accepted."""
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise pickle.UnpicklingError("_codecs.encode is allowed only to rebuild bytes")
    return text.encode("latin1")


SAFE_GLOBALS = {("builtins", "set"): set, ("builtins", "frozenset"): frozenset, ("builtins", "slice"): slice,
                ("_codecs", "encode"): _latin1_bytes}


@dataclass(frozen=True, kw_only=True)
class SavedObject:
    value: Any  # the unpickled object, tensors as restricted.TensorRef
    storage_offsets: dict[str, int]  # storage key -> file offset of its first byte


def read(src: Source, path: Path, inert_modules: tuple[str, ...] = TRAINING_MODULES,
         allowed: Mapping[tuple[str, str], Any] | None = None,
         unknown: Callable[[str, str], str] | None = None) -> SavedObject:
    """`inert_modules`: the trainer's own modules whose pickled objects become inert records; `allowed`: the
    globals the pickle may name and their stand-ins (default: tensors and a few builtins), `unknown` what a
    refusal of any other global adds (pickle_scan.check). The zip is
    checked first (zip_records), the pickle is checked against its budget (pickle_scan), and every tensor
    must lie inside its storage record. The file is opened through `src`, the input's source (a regular file
    inside the input, never a FIFO or a link out; or an object)."""
    fd = src.open(path)
    try:
        found = zip_records.records(fd, str(path))
        pkl, prefix = zip_records.pickle_record(found, str(path))
        storages = {n[len(prefix) :]: r.size for n, r in found.items() if n.startswith(prefix)}
        names = dict(allowed) if allowed is not None else {**TENSOR_GLOBALS, **SAFE_GLOBALS}
        value = loads(zip_records.read(fd, pkl), names, inert_modules,
                      where=str(path), storages=storages, unknown=unknown)
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError) as err:
        raise CorruptInputError(f"{path} cannot be read safely ({err}); distmerge loads no code from "
                                "checkpoints") from None
    finally:
        fd.close()
    _check_views(path, value, storages)
    return SavedObject(value=value, storage_offsets={n[len(prefix) :]: r.start for n, r in found.items()
                                                      if n.startswith(prefix)})


def _check_views(path: Path, value: Any, storages: dict[str, int]) -> None:
    """Every TensorRef has a sane shape and stays inside its record. Each object is visited once (the
    pickle may share sub-values: a walk of the tree could be exponential, a walk of the objects is not)."""
    seen: set[int] = set()
    todo = [value]
    while todo:
        item = todo.pop()
        if id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, TensorRef):
            _check_view(path, item, storages)
        elif isinstance(item, dict):
            todo.extend(item.values())
            if isinstance(item, OrderedDictStandIn):
                todo.append(getattr(item, "attributes", None))
        elif isinstance(item, (list, tuple, set, frozenset)):
            todo.extend(item)
        elif isinstance(item, Record):
            todo.extend(vars(item).values())
        elif isinstance(item, SubclassTensor):
            todo.extend((item.wrapper, item.state))


def _check_view(path: Path, ref: TensorRef, storages: dict[str, int]) -> None:
    key = ref.storage.key
    if not ref.check_shape():
        raise CorruptInputError(f"{path}: a tensor of record {key} has a negative or malformed shape {ref.size}, "
                                f"stride {ref.stride} or offset {ref.storage_offset}")
    need, have = ref.bytes_needed(ref.storage.dtype.itemsize), storages.get(key, -1)
    if need > have:
        raise CorruptInputError(f"{path}: a tensor view reaches byte {need} of storage record {key}, which holds "
                                f"{max(have, 0)} bytes (limit: views stay inside their record)")


def mapped_views(src: Source, path: Path, storage_offsets: Mapping[str, int],
                 refs: Mapping[Any, TensorRef]) -> dict[Any, torch.Tensor]:
    """The tensors `refs` describe, as views of one private mapping of the file: pages are read when a view is
    used, nothing is copied whole. A file that cannot be mapped (InFile.map: an object) has each view's bytes
    read, and only those. Each ref was checked to lie inside its record (read)."""
    if not refs:
        return {}
    with src.open(path) as f:
        mapped = f.map()
        return {key: _view(f, mapped, storage_offsets[ref.storage.key], ref) for key, ref in refs.items()}


def _view(f: Any, mapped: mmap.mmap | None, start: int, ref: TensorRef) -> torch.Tensor:
    dtype = ref.storage.dtype
    count = ref.bytes_needed(dtype.itemsize) // dtype.itemsize
    buffer, at = (mapped, start) if mapped is not None else (bytearray(f.pread(count * dtype.itemsize, start)), 0)
    storage = torch.frombuffer(buffer, dtype=dtype, offset=at, count=count) if count else torch.empty(0, dtype)
    return storage.as_strided(ref.size, ref.stride, ref.storage_offset)

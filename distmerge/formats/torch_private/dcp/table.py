"""The chunk table of a DCP save: every tensor chunk as a row of integer columns, never an object per chunk.

    DcpMetadata     fqns, dtypes, shapes (per tensor); files (per .distcp); per chunk: tensor, file, blob offset
                    and length, offsets and lengths ([n, D]: D the most dimensions of any tensor, 0 past a
                    tensor's own); non_tensors (the bytes entries' names)

`table` builds it from the unpickled Metadata, whichever reader made it: the general one (a record per chunk
and per storage entry) or decode.py (runs of records as columns, ChunkRun and StorageSlice, beside records).
A chunk's bytes are found by its (tensor, offsets) in storage_data, joined in torch: both sides' keys are
numbered by torch.unique, each chunk takes the last storage entry of its number (storage_data is a dict: a
later equal key replaces an earlier one's value). The columns pickle small: the scan broadcasts them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from distmerge.errors import CorruptInputError
from distmerge.formats.torch_private.dcp.blobs import Chunk
from distmerge.formats.torch_private.dcp.decode import StorageSlice
from distmerge.formats.torch_private.dcp.runs import Run


@dataclass(frozen=True, kw_only=True)
class DcpMetadata:
    fqns: tuple[str, ...]
    dtypes: tuple[torch.dtype, ...]
    shapes: tuple[tuple[int, ...], ...]
    files: tuple[str, ...]
    tensor: torch.Tensor  # int64 [n]: index into fqns
    file: torch.Tensor  # int64 [n]: index into files
    offset: torch.Tensor  # int64 [n]: the blob's first byte in its file
    length: torch.Tensor  # int64 [n]: the blob's bytes
    offsets: torch.Tensor  # int64 [n, D]
    lengths: torch.Tensor  # int64 [n, D]
    non_tensors: tuple[str, ...] = ()  # bytes entries (RNG, dataloader, train state)

    def __len__(self) -> int:
        return len(self.tensor)

    def chunk(self, i: int) -> Chunk:
        t = int(self.tensor[i])
        ndim = len(self.shapes[t])
        return Chunk(fqn=self.fqns[t], dtype=self.dtypes[t], global_shape=self.shapes[t],
                     offsets=tuple(self.offsets[i, :ndim].tolist()), lengths=tuple(self.lengths[i, :ndim].tolist()),
                     file=self.files[int(self.file[i])], offset=int(self.offset[i]), length=int(self.length[i]))

    @property
    def chunks(self) -> tuple[Chunk, ...]:
        """Every chunk as a record: for tests and small saves (a 1024-rank save has a million)."""
        return tuple(self.chunk(i) for i in range(len(self)))

    @classmethod
    def of(cls, chunks: list[Chunk], non_tensors: tuple[str, ...] = ()) -> DcpMetadata:
        """The table of these chunks (tests build odd metadata this way)."""
        fqns = list(dict.fromkeys(c.fqn for c in chunks))
        first = {c.fqn: c for c in reversed(chunks)}
        files = sorted({c.file for c in chunks})
        width = max((len(c.global_shape) for c in chunks), default=0)
        pad = lambda v: list(v) + [0] * (width - len(v))  # noqa: E731
        return cls(fqns=tuple(fqns), dtypes=tuple(first[f].dtype for f in fqns),
                   shapes=tuple(first[f].global_shape for f in fqns), files=tuple(files),
                   tensor=_column([fqns.index(c.fqn) for c in chunks]),
                   file=_column([files.index(c.file) for c in chunks]),
                   offset=_column([c.offset for c in chunks]), length=_column([c.length for c in chunks]),
                   offsets=torch.tensor([pad(c.offsets) for c in chunks], dtype=torch.int64).view(-1, width),
                   lengths=torch.tensor([pad(c.lengths) for c in chunks], dtype=torch.int64).view(-1, width),
                   non_tensors=non_tensors)


def _column(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def table(md: Any, path: Path, names: list[str]) -> DcpMetadata:
    """The chunk table of an unpickled Metadata; `names[i]`: the string of id i in its storage runs' columns.
    Raises TypeError, KeyError, ... for a structure torch does not write (the caller words it)."""
    sdm, storage = md.state_dict_metadata, md.storage_data
    if not isinstance(sdm, dict) or not isinstance(storage, dict):
        raise TypeError("state_dict_metadata or storage_data is not a dict")
    tensors = {_text(fqn): meta for fqn, meta in sdm.items() if hasattr(meta, "chunks")}
    _check_counts(path, tensors, storage)
    index = {fqn: i for i, fqn in enumerate(tensors)}
    shapes = tuple(_ints(meta.size) for meta in tensors.values())
    width = max(map(len, shapes), default=0)
    boxes = [_boxes(fqn, meta.chunks, len(shape), width) for (fqn, meta), shape in zip(tensors.items(), shapes,
                                                                                       strict=True)]
    counts = torch.tensor([len(o) for o, _ in boxes], dtype=torch.int64)
    offsets = torch.cat([o for o, _ in boxes]) if boxes else torch.zeros(0, width, dtype=torch.int64)
    lengths = torch.cat([n for _, n in boxes]) if boxes else torch.zeros(0, width, dtype=torch.int64)
    tensor = torch.arange(len(tensors)).repeat_interleave(counts)
    where = _storage(storage, index, names, width)
    found = _join(tensor, counts.new_tensor([len(s) for s in shapes])[tensor], offsets, where)
    if bool((found < 0).any()):
        i = int((found < 0).nonzero()[0, 0])
        fqn = list(tensors)[int(tensor[i])]
        raise KeyError(f"no storage entry for the chunk of {fqn} at {offsets[i].tolist()}")
    paths = sorted(set(where["paths"][int(p)] for p in where["path"][found].unique().tolist()))
    relabel = torch.tensor([paths.index(p) if p in paths else -1 for p in where["paths"]], dtype=torch.int64)
    return DcpMetadata(fqns=tuple(tensors), dtypes=tuple(_dtype(fqn, m) for fqn, m in tensors.items()), shapes=shapes,
                       files=tuple(paths), tensor=tensor, file=relabel[where["path"][found]],
                       offset=where["offset"][found], length=where["length"][found], offsets=offsets, lengths=lengths,
                       non_tensors=tuple(sorted(set(map(_text, sdm)) - set(tensors))))


def _check_counts(path: Path, tensors: dict[str, Any], storage: dict) -> None:
    """Each chunk has its own entry in storage_data (where its bytes are): more chunks declared than entries is
    a list that repeats one object, refused before a row is made per chunk (10^7 references to one chunk
    cost 20 MB of pickle and would cost gigabytes of rows)."""
    declared = 0
    for fqn, meta in tensors.items():
        if not isinstance(meta.chunks, list):
            raise TypeError(f"the chunks of {fqn} are not a list")
        declared += sum(len(c) if isinstance(c, Run) else 1 for c in meta.chunks)
    entries = sum(len(k.run) if isinstance(k, StorageSlice) else 1 for k in storage)
    if declared > entries:
        raise CorruptInputError(f"{path} declares {declared:,} chunks but says where {entries:,} of them "
                                "are: a list repeating one chunk, not metadata torch writes (limit: one storage "
                                "entry per chunk)")


def _boxes(fqn: str, chunks: list, ndim: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A tensor's chunks' offsets and lengths, [k, width] each."""
    parts_o, parts_n = [], []
    for c in chunks:
        if isinstance(c, Run):
            o, n = c.offsets, c.sizes
            if o.shape[1] != ndim:
                raise TypeError(f"a chunk of {fqn} with {o.shape[1]} dimensions, not {ndim}")
        else:
            o = torch.tensor([_ints(c.offsets)], dtype=torch.int64)
            n = torch.tensor([_ints(c.sizes)], dtype=torch.int64)
            if o.shape[-1] != ndim or n.shape[-1] != ndim:
                raise TypeError(f"a chunk of {fqn} whose offsets or sizes are not {ndim} numbers")
            o, n = o.view(1, ndim), n.view(1, ndim)
        parts_o.append(o)
        parts_n.append(n)
    pad = (0, width - ndim)
    empty = torch.zeros(0, width, dtype=torch.int64)
    return (torch.nn.functional.pad(torch.cat(parts_o), pad) if parts_o else empty,
            torch.nn.functional.pad(torch.cat(parts_n), pad) if parts_n else empty)


def _storage(storage: dict, index: dict[str, int], names: list[str], width: int) -> dict[str, Any]:
    """storage_data as columns: tensor (-1: not a tensor's), ndim (-1: no offset), offsets [m, width], path
    (index into strings: `names`, then the records' paths), offset, length."""
    strings = list(names)
    known: dict[str, int] = {}
    cols: dict[str, list] = {k: [] for k in ("tensor", "ndim", "offsets", "path", "offset", "length")}
    tensor_of = torch.tensor([index.get(n, -1) for n in names] or [-1], dtype=torch.int64)
    for key, info in storage.items():
        if isinstance(key, StorageSlice):
            run = key.run
            c, rows = run.columns, slice(run.start, run.start + len(run))
            for name, column in (("tensor", tensor_of[c.fqn[rows]]), ("ndim", c.ndim[rows]),
                                 ("offsets", _fit(c.offsets[rows], width)), ("path", c.path[rows]),
                                 ("offset", c.offset[rows]), ("length", c.length[rows])):
                cols[name].append(column)
            continue
        offsets = getattr(key, "offset", None)
        ints = () if offsets is None else _ints(offsets)
        path = _text(info.relative_path)
        if path not in known:
            known[path] = len(strings)
            strings.append(path)
        for name, value in (("tensor", index.get(_text(key.fqn), -1)), ("ndim", -1 if offsets is None else len(ints)),
                            ("path", known[path]), ("offset", _ints((info.offset,))[0]),
                            ("length", _ints((info.length,))[0])):
            cols[name].append(torch.tensor([value], dtype=torch.int64))
        cols["offsets"].append(_fit(torch.tensor([list(ints)], dtype=torch.int64).view(1, len(ints)), width))
    out: dict[str, Any] = {k: torch.cat(v) if v else torch.zeros((0, width) if k == "offsets" else 0,
                                                                 dtype=torch.int64) for k, v in cols.items()}
    out["paths"] = strings
    return out


def _fit(offsets: torch.Tensor, width: int) -> torch.Tensor:
    """[m, k] offsets as [m, width]: cut (a row wider than any tensor matches none) or padded with 0."""
    if offsets.shape[1] >= width:
        return offsets[:, :width]
    return torch.nn.functional.pad(offsets, (0, width - offsets.shape[1]))


def _join(tensor: torch.Tensor, ndim: torch.Tensor, offsets: torch.Tensor, where: dict[str, Any]) -> torch.Tensor:
    """For each chunk, the row of the last storage entry with its tensor and offsets (-1: none)."""
    usable = (where["tensor"] >= 0) & (where["ndim"] >= 0)
    rows = usable.nonzero()[:, 0]
    keys = torch.cat([torch.cat([tensor[:, None], ndim[:, None], offsets], 1),
                      torch.cat([where["tensor"][rows, None], where["ndim"][rows, None], where["offsets"][rows]], 1)])
    ids = _row_ids(keys)
    chunk_ids, storage_ids = ids[: len(tensor)], ids[len(tensor) :]
    last = torch.full((int(ids.max()) + 1 if len(ids) else 1,), -1, dtype=torch.int64)
    last.scatter_reduce_(0, storage_ids, torch.arange(len(rows)), reduce="amax")
    at = last[chunk_ids]
    return torch.where(at >= 0, rows[at.clamp(min=0)] if len(rows) else at, at)


def _row_ids(keys: torch.Tensor) -> torch.Tensor:
    """A number per row, equal for equal rows: one int64 per row when the columns' ranges fit, else by rows."""
    if len(keys) == 0:
        return torch.zeros(0, dtype=torch.int64)
    low, high = keys.min(0).values, keys.max(0).values
    span = [int(h) - int(lo) + 1 for lo, h in zip(low.tolist(), high.tolist(), strict=True)]
    if math.prod(span) < 2**62:
        stride = torch.tensor([math.prod(span[i + 1 :]) for i in range(len(span))], dtype=torch.int64)
        return torch.unique(((keys - low) * stride).sum(1), return_inverse=True)[1]
    return torch.unique(keys, dim=0, return_inverse=True)[1]


def _dtype(fqn: str, meta: Any) -> torch.dtype:
    props = meta.properties
    dtype = props._state[0] if hasattr(props, "_state") else props.dtype
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"the dtype of {fqn} is not a torch dtype")
    return dtype


def _text(value: Any) -> str:
    """Names become dict keys and messages: only real strings (a shared tuple hashes exponentially)."""
    if not isinstance(value, str):
        raise TypeError(f"a name that is a {type(value).__name__}, not a string")
    return value


def _ints(values: Any) -> tuple[int, ...]:
    if not isinstance(values, (tuple, list)) or not all(type(v) is int for v in values):
        raise TypeError("sizes and offsets that are not integers")
    return tuple(values)

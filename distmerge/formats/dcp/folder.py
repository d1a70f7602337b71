"""torch.distributed.checkpoint folders: torchtitan, accelerate's SHARDED_STATE_DICT, `dcp.save` in user code.

    ckpt/
      .metadata            every tensor's global shape and chunks, and where each chunk's bytes are
      __0_0.distcp ...     the chunks, one file per saving rank (and writer thread)
      huggingface/         config.json, tokenizer (or beside the folder, or --hf-config DIR)

Only `.metadata` is read at discovery on rank 0; each rank then opens its `.distcp` files, locates the
bytes of every chunk inside them, and the engine reads exactly those byte ranges.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from distmerge import dtypes
from distmerge.errors import CorruptInputError, InputError
from distmerge.formats import base
from distmerge.formats.base import FormatDefaults, Fragment, InputFile, OpenedFile, Scan, input_file, inside
from distmerge.formats.dcp.keys import EMA_KEY, ema_copies, model_names, with_ema
from distmerge.formats.torch_private import dcp as private
from distmerge.input.source import Source

METADATA = ".metadata"
RANK_OF = re.compile(r"^__(\d+)_\d+\.distcp$")


class _Through:
    """The source a cached read goes through, left out of the cache's key: one file (path, time, size) is one
    metadata, whichever view of the input asks (detection and the scan ask through different ones: Source.at)."""

    def __init__(self, src: Source) -> None:
        self.src = src

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Through)

    def __hash__(self) -> int:
        return 0


@functools.lru_cache(maxsize=4)
def _metadata(path: str, mtime_ns: int, size: int, through: _Through) -> private.DcpMetadata:
    return private.read_metadata(through.src, Path(path))


def load_metadata(src: Source, root: Path) -> private.DcpMetadata:
    st = src.stat(root / METADATA)
    return _metadata(str(root / METADATA), st.mtime_ns, st.size, _Through(src))


@dataclass(frozen=True, kw_only=True, eq=False)  # eq=False: hashed by identity (the rows are megabytes)
class ModelChunks:
    """The model's chunks, as the scan hands them to every rank: per tensor its output name, key (fqn), dtype
    code and shape; per chunk one row of `rows()` (int64): tensor, file (index into Scan.files), blob offset,
    blob length, then `width` offsets and `width` lengths (0 past the tensor's own dimensions). The rows travel
    in the broadcast Scan as one bytes object per column, each column in the narrowest integer type that holds
    it (~20 bytes a chunk at 1024 ranks, no object per chunk); each rank takes its files' rows."""

    names: tuple[str, ...]
    keys: tuple[str, ...]
    codes: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    width: int
    columns: tuple[tuple[str, bytes], ...]  # (torch dtype name, bytes) per column of rows()

    @classmethod
    def pack(cls, table: torch.Tensor, **fields: Any) -> ModelChunks:
        return cls(columns=tuple(_narrow(table[:, i]) for i in range(table.shape[1])), **fields)

    def rows(self, which: torch.Tensor | None = None) -> torch.Tensor:
        """The rows (int64), all or those at `which`."""
        cols = _columns(self)
        return torch.stack([(c if which is None else c[which]).long() for c in cols], 1)

    def of_file(self, index: int) -> list[list[int]]:
        """The rows of one input file, in metadata order (grouped by file once per process; only the files a
        rank opens become int64 rows, and Python lists)."""
        order, spans = _by_file(self)
        start, stop = spans.get(index, (0, 0))
        return self.rows(order[start:stop]).tolist() if stop > start else []


def _narrow(column: torch.Tensor) -> tuple[str, bytes]:
    low, high = (int(column.min()), int(column.max())) if len(column) else (0, 0)
    dtype = next(d for d in (torch.int8, torch.int16, torch.int32, torch.int64)
                 if torch.iinfo(d).min <= low and high <= torch.iinfo(d).max)
    return str(dtype).removeprefix("torch."), column.to(dtype).numpy().tobytes()


@functools.lru_cache(maxsize=2)
def _columns(chunks: ModelChunks) -> list[torch.Tensor]:
    return [torch.frombuffer(bytearray(data), dtype=getattr(torch, dtype)) if data else
            torch.zeros(0, dtype=torch.int64) for dtype, data in chunks.columns]


@functools.lru_cache(maxsize=2)
def _by_file(chunks: ModelChunks) -> tuple[torch.Tensor, dict[int, tuple[int, int]]]:
    """The rows' indices grouped by file (stable: metadata order within a file), and each file's span of them."""
    order = torch.argsort(_columns(chunks)[1], stable=True)
    files, counts = torch.unique_consecutive(_columns(chunks)[1][order], return_counts=True)
    ends = counts.cumsum(0).tolist()
    return order, {f: (e - n, e) for f, n, e in zip(files.tolist(), counts.tolist(), ends, strict=True)}


def hf_dir_near(src: Source, root: Path) -> str | None:
    return base.config_dir(src, (root, root.parent))


class DcpFormat(FormatDefaults):
    name = "dcp"
    order = 40
    help = ".metadata + .distcp folders of dcp.save: torchtitan, accelerate"

    def detect(self, source: Source) -> bool:
        root = source.root
        return source.is_file(root / METADATA) and any(Path(n).suffix == ".distcp" for n in source.listdir(root))

    options = (EMA_KEY,)

    def scan(self, source: Source, options: Mapping[str, Any]) -> Scan:
        try:
            return self._scan(source, options)
        finally:  # the table and the decoding's columns are freed: their memory goes back (rank 0 carries on)
            private.return_freed_memory()

    def _scan(self, source: Source, options: Mapping[str, Any]) -> Scan:
        root = source.root
        md = load_metadata(source, root)
        names, ema_notes, ema = _names(md, str(root), options.get(EMA_KEY.dest))
        model = torch.tensor([fqn in names for fqn in md.fqns] or [False])
        rows = model[md.tensor].nonzero()[:, 0]
        used = md.file[rows].unique().tolist()
        paths = sorted(md.files[i] for i in used)
        missing = [p for p in paths if not source.is_file(inside(source, root, p))]
        if missing:
            raise InputError(f"{root}/.metadata points at {', '.join(missing[:4])}, which is missing: copy it back")
        files = tuple(input_file(source, root, i, p) for i, p in enumerate(paths))
        file_of = torch.full((max(len(md.files), 1),), -1, dtype=torch.int64)
        file_of[torch.tensor(used, dtype=torch.int64)] = torch.tensor([paths.index(md.files[i]) for i in used])
        table = torch.cat([md.tensor[rows, None], file_of[md.file[rows], None], md.offset[rows, None],
                           md.length[rows, None], md.offsets[rows], md.lengths[rows]], 1)
        _check_chunks(root, md, table, files)
        ranks = {int(m[1]) for p in source.listdir(root) if (m := RANK_OF.match(p))}
        skipped = len(md.fqns) - len(names) - ema + len(md.non_tensors)
        what = "optimizer, train state, extra state, ..."
        notes = [f"skipped {skipped} entries that are not model weights ({what})"] * bool(skipped) + ema_notes
        state = ModelChunks.pack(table, names=tuple(names.get(f, f) for f in md.fqns), keys=md.fqns,
                                 codes=tuple(dtypes.code_of(d) for d in md.dtypes), shapes=md.shapes,
                                 width=md.offsets.shape[1])
        _metadata.cache_clear()  # the table (~100 bytes a chunk) is not needed past the scan
        return Scan(format=self.name, root=str(root), files=files, hf_dir=hf_dir_near(source, root),
                    world_size=len(ranks) or len(files), notes=tuple(notes), state=state)

    def open(self, source: Source, scan: Scan, file: InputFile) -> OpenedFile:
        chunks: ModelChunks = scan.state
        rows, width = chunks.of_file(file.index), chunks.width
        opened = OpenedFile(fragments=[], layout={"DCP chunk": len(rows)})
        ndims = [len(chunks.shapes[r[0]]) for r in rows]
        boxes = [(tuple(r[4 : 4 + n]), tuple(r[4 + width : 4 + width + n])) for r, n in zip(rows, ndims, strict=True)]
        with source.open(Path(scan.root) / file.path) as f:  # the walk's file, no link or FIFO instead
            at = private.locate(f, file.size, [(r[2], r[3], math.prod(box[1])) for r, box in zip(rows, boxes,
                                                                                                 strict=True)],
                                lambda k: _chunk(chunks, rows[k], boxes[k], file.path),
                                [dtypes.itemsize(chunks.codes[r[0]]) for r in rows])
        names, codes, shapes, keys, index = chunks.names, chunks.codes, chunks.shapes, chunks.keys, file.index
        opened.fragments = [Fragment.make(names[r[0]], codes[r[0]], shapes[r[0]], o, n, index, b, keys[r[0]])
                            for r, (o, n), b in zip(rows, boxes, at, strict=True)]
        return opened


def _names(md: private.DcpMetadata, where: str, ema_key: str | None) -> tuple[dict[str, str], list[str], int]:
    """The model's entries and their output names (keys.py), the EMA copy `ema_key`'s where it has them; the notes,
    and how many entries that are not written the EMA explains (its copies, the live tensors one replaces)."""
    names = model_names(sorted(md.fqns), where)
    copies = ema_copies(md.fqns)
    entries = sum(map(len, copies.values()))
    if ema_key is None:
        return names, [f"holds EMA copies ({', '.join(sorted(copies))}), not merged: the live weights are; "
                       "--ema-key KEY merges a copy instead"] * bool(copies), entries
    names, replaced, untracked = with_ema(names, md.fqns, where, ema_key)
    at = {fqn: i for i, fqn in enumerate(md.fqns)}
    for entry, live in replaced.items():
        if (md.shapes[at[entry]], md.dtypes[at[entry]]) != (md.shapes[at[live]], md.dtypes[at[live]]):
            raise InputError(f"--ema-key {ema_key}: {where}: the EMA copy of {live} is "
                             f"{list(md.shapes[at[entry]])} {md.dtypes[at[entry]]}, the weight "
                             f"{list(md.shapes[at[live]])} {md.dtypes[at[live]]}: a corrupt save")
    shown = ", ".join(untracked[:4]) + (", ..." if len(untracked) > 4 else "")
    return names, [f"--ema-key {ema_key}: {len(replaced)} tensors from the EMA copy"
                   + (f"; {len(untracked)} it does not track from the live weights ({shown})" if untracked else "")
                   ], entries


def _chunk(chunks: ModelChunks, row: list[int], box: tuple, path: str) -> private.Chunk:
    return private.Chunk(fqn=chunks.keys[row[0]], dtype=dtypes.torch_dtype(chunks.codes[row[0]]),
                         global_shape=chunks.shapes[row[0]], offsets=box[0], lengths=box[1], file=path,
                         offset=row[2], length=row[3])


def _check_chunks(root: Path, md: private.DcpMetadata, table: torch.Tensor, files: tuple[InputFile, ...]) -> None:
    """What .metadata declares, against what is on disk, before anything is built from it: every chunk's block
    inside its tensor (no negative sizes), its bytes inside its file, and a file's chunks no more bytes than the
    file holds (DCP writes them one after another), so the chunk count is bounded by the files' sizes."""
    width = md.offsets.shape[1]
    tensor, file, offset, length = table[:, 0], table[:, 1], table[:, 2], table[:, 3]
    offsets, lengths = table[:, 4 : 4 + width], table[:, 4 + width :]
    ndim = torch.tensor([len(s) for s in md.shapes] or [0])[tensor]
    own = torch.arange(width)[None, :] < ndim[:, None]
    shape = torch.tensor([list(s) + [0] * (width - len(s)) for s in md.shapes] or [[0] * width],
                         dtype=torch.int64).view(-1, width)[tensor]
    # compared without adding two values a hostile file may set near 2**63 (int64 would wrap past the bound)
    outside = (own & ((offsets < 0) | (lengths < 0) | (shape < 0) | (offsets > shape) | (lengths > shape - offsets))
               ).any(1)
    sizes = torch.tensor([f.size for f in files] or [0], dtype=torch.int64)
    empty = (own & (lengths < 1)).any(1)
    past = (offset < 0) | (length < (~empty).long()) | (offset > sizes[file]) | (length > sizes[file] - offset)
    bad = (outside | past).nonzero()[:, 0]
    if len(bad):
        i = int(bad[0])
        t, n = int(tensor[i]), len(md.shapes[int(tensor[i])])
        fqn = md.fqns[t]
        if bool(outside[i]):
            raise CorruptInputError(f"{root}/.metadata: {fqn} has a chunk at {offsets[i, :n].tolist()} of "
                                    f"{lengths[i, :n].tolist()} outside its shape {list(md.shapes[t])}: corrupt "
                                    "metadata")
        f = files[int(file[i])]
        raise CorruptInputError(f"{root}/.metadata puts a chunk of {fqn} at bytes {int(offset[i])}+{int(length[i])} "
                                f"of {f.path}, which holds {f.size}: truncated file or corrupt metadata")
    used = torch.zeros(len(sizes), dtype=torch.int64).scatter_add_(0, file, length)
    over = (used > sizes).nonzero()[:, 0]
    if len(over):
        f = files[int(over[0])]
        raise CorruptInputError(f"{root}/.metadata declares {int(used[int(over[0])])} bytes of chunks in {f.path}, "
                                f"which holds {f.size}: corrupt metadata")

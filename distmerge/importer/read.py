"""A chunk's tensor, made of row ranges of the Hugging Face tensors: never a whole tensor unless the chunk needs it.

A chunk is rows [a, b) (and columns, for a row-parallel split) of one Megatron tensor, whose rows are segments of
Hugging Face tensors (families/transforms.Segment). The segments that cover [a, b) (transforms.narrow) are each
rows of one Hugging Face tensor: from a folder, one contiguous byte range of a safetensors file, read with one
read through the input's source (Files: a pread on disk, a ranged GET from an object store); from a checkpoint,
rows of the tensor the merge engine assembled (sink.py). The chunks of one tensor that share their rows (the TP
chunks of a column split) are cut from one read of those rows at full width (`chunk_tensors`), so each byte is read
once.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from distmerge import dtypes
from distmerge.families import transforms as tf
from distmerge.families.megatron.inverse import Imported
from distmerge.formats.megatron.dist_layout import Chunk
from distmerge.importer.discover import Model, Tensor
from distmerge.input.source import InFile

# rows(name, first, count): rows [first, first + count) of the Hugging Face tensor `name`
RowReader = Callable[[str, int, int], torch.Tensor]


class Files:
    """The Hugging Face files a process reads, each opened once through the input's source, made again on this
    rank from the record discovery made of them (Model.walked: a folder's files checked against its walk, an
    object store's objects by their listing, read by ranged GETs pinned to the ETag listed); `bytes_read` counts
    what was read."""

    def __init__(self, model: Model) -> None:
        self.model = model
        self.source = model.walked.source()
        self.source.adopt(model.walked)
        self.root = Path(model.walked.root)
        self.open: dict[str, InFile] = {}
        self.bytes_read = 0

    def rows(self, name: str, first_row: int, count: int) -> torch.Tensor:
        tensor = self.model.tensors[name]
        raw = self.pread(tensor, first_row, count)
        return torch.frombuffer(raw, dtype=dtypes.torch_dtype(tensor.dtype)).view(count, *tensor.shape[1:])

    def pread(self, tensor: Tensor, first_row: int, rows: int) -> bytearray:
        row_bytes = math.prod(tensor.shape[1:]) * dtypes.itemsize(tensor.dtype)
        if tensor.file not in self.open:
            self.open[tensor.file] = self.source.open(self.root / tensor.file)
        data = bytearray(rows * row_bytes)
        got = self.open[tensor.file].read_full(memoryview(data), tensor.start + first_row * row_bytes)
        if got != len(data):
            raise OSError(self.source.shown(f"{self.root / tensor.file}: {tensor.name} is cut short (truncated "
                                            "file?)"))
        self.bytes_read += got
        return data

    def close(self) -> None:
        for fh in self.open.values():
            fh.close()
        self.open.clear()


def chunk_tensors(made: Imported, chunks: list[Chunk], rows: RowReader) -> Iterator[tuple[Chunk, torch.Tensor]]:
    """Each chunk of `made` with its values, in the order given; the rows that several chunks share (a column
    split's) made once, kept only while their chunks are cut."""
    by_rows: dict[tuple[int, int], list[Chunk]] = {}
    for chunk in chunks:
        by_rows.setdefault(chunk.rows, []).append(chunk)
    for span, cut in by_rows.items():
        block = rows_of(made, span, rows)
        for chunk in cut:
            yield chunk, _columns(chunk, block)


def rows_of(made: Imported, span: tuple[int, int], rows: RowReader) -> torch.Tensor:
    """Rows [a, b) of the Megatron tensor: the rows of its Hugging Face tensors its segments name, in order."""
    pieces = []
    for seg in tf.narrow(made.segments, *span):
        block = rows(made.sources[seg.source], seg.start, seg.count)
        pieces.append(block.repeat(seg.repeat, *[1] * (block.dim() - 1)) if seg.repeat > 1 else block)
    return torch.cat(pieces) if len(pieces) > 1 else pieces[0]


def _columns(chunk: Chunk, block: torch.Tensor) -> torch.Tensor:
    if chunk.cols is not None:
        block = block[:, chunk.cols[0] : chunk.cols[1]]
    return block.reshape(chunk.lengths)

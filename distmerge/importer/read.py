"""A chunk's tensor, read as row ranges of the Hugging Face tensors: never a whole tensor unless the chunk is.

A chunk is rows [a, b) (and columns, for a row-parallel split) of one Megatron tensor, whose rows are segments of
Hugging Face tensors (families/transforms.Segment). The segments that cover [a, b) (transforms.narrow) are each
one contiguous byte range of a safetensors file, read with one pread. A column split reads its rows whole and
keeps the columns: at most the chunk's rows at full width in memory.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from distmerge import dtypes
from distmerge.families import transforms as tf
from distmerge.families.megatron.inverse import Imported
from distmerge.formats.megatron.dist_layout import Chunk
from distmerge.importer.discover import Model, Tensor


class Files:
    """The Hugging Face files a process reads, each opened once."""

    def __init__(self, root: str) -> None:
        self.root = Path(root)
        self.open: dict[str, object] = {}

    def pread(self, tensor: Tensor, first_row: int, rows: int) -> bytes:
        row_bytes = math.prod(tensor.shape[1:]) * dtypes.itemsize(tensor.dtype)
        if tensor.file not in self.open:
            self.open[tensor.file] = open(self.root / tensor.file, "rb")  # noqa: SIM115  (closed by close())
        fh = self.open[tensor.file]
        fh.seek(tensor.start + first_row * row_bytes)
        data = fh.read(rows * row_bytes)
        if len(data) != rows * row_bytes:
            raise OSError(f"{self.root / tensor.file}: {tensor.name} is cut short (truncated file?)")
        return data

    def close(self) -> None:
        for fh in self.open.values():
            fh.close()
        self.open.clear()


def chunk_tensor(chunk: Chunk, made: Imported, model: Model, files: Files) -> torch.Tensor:
    """The chunk's values: the rows of its Hugging Face tensors its segments name, in order, then its columns."""
    pieces = []
    for seg in tf.narrow(made.segments, *chunk.rows):
        source = model.tensors[made.sources[seg.source]]
        raw = bytearray(files.pread(source, seg.start, seg.count))
        rows = torch.frombuffer(raw, dtype=dtypes.torch_dtype(source.dtype)).view(seg.count, *source.shape[1:])
        if chunk.cols is not None:
            rows = rows[:, chunk.cols[0] : chunk.cols[1]]
        pieces.append(rows.repeat(seg.repeat, *[1] * (rows.dim() - 1)) if seg.repeat > 1 else rows)
    out = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
    return out.reshape(chunk.lengths)

"""Assemble: put every fragment of a unit where it belongs, then write the unit's targets.

Two ways, chosen per unit:
- direct: an identity unit without a cast whose fragments are each one contiguous run of the target
  (FSDP's Shard(0), plain tensors). Its output file is the preallocated target: local fragments are
  copied from the input file into it inside the kernel (copy_file_range), received ones written from
  the receive buffer. No tensor is built.
- tensor: the source tensors are preallocated (on the GPU when there is one), fragments are copied in
  by offset, then the unit's transform and the output dtype are applied and the targets written.
"""

from __future__ import annotations

import torch

from distmerge import dtypes, transforms
from distmerge.errors import LayoutError
from distmerge.exchange import frag_bytes
from distmerge.formats.base import Fragment
from distmerge.mapping import Unit
from distmerge.plan import Plan
from distmerge.reader import Reader
from distmerge.writer import ShardWriter


def contiguous_start(offsets: tuple[int, ...], lengths: tuple[int, ...], shape: tuple[int, ...]) -> int | None:
    """Flat element index where the block starts, if it is one contiguous run of the row-major tensor."""
    lead = 0
    while lead < len(shape) and lengths[lead] == 1:
        lead += 1
    if any(lengths[d] != shape[d] for d in range(lead + 1, len(shape))):
        return None
    start, stride = 0, 1
    for d in reversed(range(len(shape))):
        start += offsets[d] * stride
        stride *= shape[d]
    return start


class UnitBuild:
    """One unit on its owner: `place` each fragment (local or received), then `finish`."""

    def __init__(self, unit: Unit, plan: Plan, writer: ShardWriter, device: torch.device) -> None:
        self.unit, self.plan, self.writer, self.device = unit, plan, writer, device
        self.sources = [plan.sources[s] for s in unit.sources]
        self.direct = self._is_direct()
        self.tensors: dict[str, torch.Tensor] = {}
        if not self.direct:
            for src in self.sources:
                dtype = dtypes.torch_dtype(src.meta.dtype)
                self.tensors[src.meta.name] = torch.empty(src.meta.shape, dtype=dtype, device=device)

    def _is_direct(self) -> bool:
        if self.unit.transform != "identity" or len(self.sources) != 1:
            return False
        src, target = self.sources[0], self.unit.targets[0]
        if target.dtype != src.meta.dtype:
            return False
        return all(contiguous_start(f.offsets, f.lengths, src.meta.shape) is not None for f in src.fragments)

    def fragments(self) -> list[tuple[str, Fragment]]:
        return [(s.meta.name, f) for s in self.sources for f in s.fragments]

    def place_local(self, source: str, frag: Fragment, reader: Reader) -> None:
        if self.direct and reader.can_copy(frag):
            nbytes, offset = frag_bytes(frag), self._file_offset(source, frag)
            self.writer.copy_in(lambda fd: reader.copy_to(frag, fd, offset, nbytes), offset, nbytes)
            return
        data = torch.empty(frag_bytes(frag), dtype=torch.uint8)
        reader.read_into(frag, data)
        self.place_received(source, frag, data)

    def place_received(self, source: str, frag: Fragment, data: torch.Tensor) -> None:
        if self.direct:
            self.writer.write_bytes(memoryview(data.cpu().numpy()).cast("B"), self._file_offset(source, frag))
            return
        dtype = dtypes.torch_dtype(frag.dtype)
        block = tuple(slice(o, o + n) for o, n in zip(frag.offsets, frag.lengths, strict=True))
        self.tensors[source][block].copy_(data.view(dtype).view(frag.lengths), non_blocking=True)

    def finish(self) -> None:
        if self.direct:
            return
        produced = transforms.apply(self.unit.transform, list(self.tensors.values()), self.unit.params)
        for target, tensor in zip(self.unit.targets, produced, strict=True):
            if tuple(tensor.shape) != target.shape:
                raise LayoutError(f"{target.name}: built shape {list(tensor.shape)}, expected {list(target.shape)}")
            self.writer.write(target.name, tensor.to(dtypes.torch_dtype(target.dtype)))
        self.tensors.clear()

    def _file_offset(self, source: str, frag: Fragment) -> int:
        meta = self.plan.sources[source].meta
        start = contiguous_start(frag.offsets, frag.lengths, meta.shape)
        return self.writer.offset(self.unit.targets[0].name, start * dtypes.itemsize(meta.dtype))

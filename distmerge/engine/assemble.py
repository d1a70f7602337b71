"""Assemble: put every fragment of a unit where it belongs, then hand the unit's targets to its output.

Two ways, chosen per unit:
- direct: an identity (or row-trimming) unit without a cast whose fragments are each one contiguous run
  of the source (FSDP's Shard(0), plain tensors, Megatron's vocabulary-parallel embeddings), when its
  output takes bytes at their place (a file: `TargetOut.takes_bytes`). Its output file is the preallocated
  target: local fragments are copied from the input file into it through one reused 1 MiB buffer
  (reader.copy_to), received ones written from the receive buffer; rows beyond a trimmed target are never
  copied. No tensor is built.
- tensor: the source tensors are preallocated (on the GPU when there is one), fragments are copied in
  by offset (a local fragment that is one run of a CPU source is read straight into it), then the
  unit's transform and the output dtype are applied and the targets handed to the output (written into a
  file by merge, compared with a reference by verify).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from distmerge import dtypes
from distmerge.engine.plan import Plan
from distmerge.engine.reader import Reader
from distmerge.errors import LayoutError
from distmerge.families import transforms
from distmerge.families.base import Unit
from distmerge.formats.base import Fragment
from distmerge.input.reads import Batch

# Transforms that keep a prefix of the source's bytes, in order: a direct unit may apply them by clipping.
PREFIX_TRANSFORMS = ("identity", "trim_rows")
# A direct unit of at most this many bytes is assembled in memory and written in one call: made of many small
# fragments (a 1024-rank save: 1024 chunks of a few KB a tensor), one write per fragment cost more than the copy.
STAGE = 8 << 20


class TargetOut(Protocol):
    """Where a unit's targets go (sink.Sink.output): writer.ShardWriter, or verify's comparison.

    `write` takes each whole target as it will be written (its output dtype, on the process group's device).
    An output with `takes_bytes` also takes a direct unit's bytes at their place, without a tensor being built:
    `offset`, `copy_in` and `write_bytes` are called on it only then (writer.ShardWriter says what they do).
    """

    takes_bytes: bool

    def write(self, name: str, tensor: torch.Tensor) -> int: ...

    def offset(self, name: str, start: int = 0) -> int: ...

    def copy_in(self, copy: Callable[[Callable[[memoryview, int], None]], None], nbytes: int) -> None: ...

    def write_bytes(self, buf: memoryview, offset: int) -> int: ...


class UnitBuild:
    """One unit on its owner: `place` each fragment (local or received), then `finish`."""

    def __init__(self, unit: Unit, plan: Plan, writer: TargetOut, device: torch.device) -> None:
        self.unit, self.plan, self.writer, self.device = unit, plan, writer, device
        self.sources = [plan.sources[s] for s in unit.sources]
        self.direct = self._is_direct()
        self.stage = bytearray(unit.targets[0].nbytes) if self.direct and unit.targets[0].nbytes <= STAGE else None
        if self.stage is not None:  # what take_local asks per fragment, computed once
            self._view, self._size = memoryview(self.stage), len(self.stage)
            self._itemsize = dtypes.itemsize(self.sources[0].meta.dtype)
        self.tensors: dict[str, torch.Tensor] = {}
        if not self.direct:
            for src in self.sources:
                dtype = dtypes.torch_dtype(src.meta.dtype)
                self.tensors[src.meta.name] = torch.empty(src.meta.shape, dtype=dtype, device=device)

    def _is_direct(self) -> bool:
        if not self.writer.takes_bytes or self.unit.transform not in PREFIX_TRANSFORMS or len(self.sources) != 1:
            return False
        src, target = self.sources[0], self.unit.targets[0]
        if target.dtype != src.meta.dtype:
            return False
        return all(f.flat_start() is not None for f in src.fragments)

    def fragments(self) -> list[tuple[str, Fragment]]:
        return [(s.meta.name, f) for s in self.sources for f in s.fragments]

    def take_local(self, source: str, frag: Fragment) -> memoryview | torch.Tensor | None:
        """Where a local fragment's bytes go as they are, when they go to one place: its part of the staged unit,
        or its run of a CPU source tensor (the reader fills many at once: Reader.fill); else None (place_local)."""
        if self.stage is not None:
            start = frag.flat_start() * self._itemsize
            return self._view[start : start + frag.nbytes] if start + frag.nbytes <= self._size else None
        return None if self.direct else self._run_in_source(source, frag)

    def place_local(self, source: str, frag: Fragment, reader: Reader | Batch) -> None:
        """A fragment this rank reads, placed as it arrives: at once from a file, when the batch runs from an
        object store (reads.py); `finish` comes after either. A staged unit's fragment that take_local did not
        place (one the target keeps only part of: trim_rows; any of an object-store input's) is read, then
        clipped into the stage (place_received)."""
        if self.direct and self.stage is None and reader.can_copy(frag):
            offset, nbytes = self._kept(source, frag)
            if nbytes:
                self.writer.copy_in(lambda put: reader.copy_to(frag, put, offset, nbytes), nbytes)
            return
        run = self._run_in_source(source, frag) if reader.can_copy(frag) and not self.direct else None
        if run is not None:
            reader.read_into(frag, run)  # straight into the source tensor: no second copy
            return
        reader.read_into(frag, then=lambda data: self.place_received(source, frag, data))

    def place_received(self, source: str, frag: Fragment, data: torch.Tensor | memoryview) -> None:
        """Place a fragment's bytes (a received slot, or what place_local read): a uint8 tensor or a memoryview."""
        if self.direct:
            offset, nbytes = self._kept(source, frag)
            raw = data[:nbytes] if isinstance(data, memoryview) else memoryview(data[:nbytes].cpu().numpy()).cast("B")
            if nbytes and self.stage is not None:
                start = offset - self.writer.offset(self.unit.targets[0].name)
                self._view[start : start + nbytes] = raw
            elif nbytes:
                self.writer.write_bytes(raw, offset)
            return
        if isinstance(data, memoryview):
            data = torch.frombuffer(data, dtype=torch.uint8) if len(data) else torch.empty(0, dtype=torch.uint8)
        dtype = dtypes.torch_dtype(frag.dtype)
        frag.view_in(self.tensors[source]).copy_(data.view(dtype).view(frag.lengths), non_blocking=True)

    def finish(self) -> None:
        if self.stage is not None:
            self.writer.write_bytes(memoryview(self.stage), self.writer.offset(self.unit.targets[0].name))
            self.stage = None
        if self.direct:
            return
        produced = transforms.apply(self.unit.transform, list(self.tensors.values()), self.unit.params)
        for target, tensor in zip(self.unit.targets, produced, strict=True):
            if tuple(tensor.shape) != target.shape:
                raise LayoutError(f"{target.name}: built shape {list(tensor.shape)}, expected {list(target.shape)}")
            self.writer.write(target.name, tensor.to(dtypes.torch_dtype(target.dtype)))
        self.tensors.clear()

    def _kept(self, source: str, frag: Fragment) -> tuple[int, int]:
        """Where a direct fragment's bytes go in the output file, and how many of them the target keeps
        (all for identity; for trim_rows only those before the target's end)."""
        meta, target = self.plan.sources[source].meta, self.unit.targets[0]
        begin = frag.flat_start() * dtypes.itemsize(meta.dtype)
        kept = max(0, min(frag.nbytes, target.nbytes - begin))
        return self.writer.offset(target.name, min(begin, target.nbytes)), kept

    def _run_in_source(self, source: str, frag: Fragment) -> torch.Tensor | None:
        """The fragment's bytes inside the preallocated CPU source tensor, when they are one run of it."""
        tensor = self.tensors[source]
        start = frag.flat_start()
        if start is None or tensor.device.type != "cpu":
            return None
        return tensor.view(-1)[start : start + frag.numel].view(torch.uint8)

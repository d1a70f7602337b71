"""Assemble: copy fragments into preallocated source tensors by offset, then apply the unit's transform
and the output dtype. Local fragments that are one contiguous run of the target (the usual Shard(0)
case) are read from the file straight into the target's memory: no intermediate copy."""

from __future__ import annotations

import math

import torch

from distmerge import dtypes, transforms
from distmerge.errors import LayoutError
from distmerge.exchange import frag_bytes
from distmerge.formats.base import Fragment
from distmerge.mapping import Target, Unit
from distmerge.plan import Plan, SourceTensor
from distmerge.reader import Reader


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


def assemble_source(
    src: SourceTensor, me: int, plan: Plan, reader: Reader, received: dict[Fragment, torch.Tensor], device
) -> torch.Tensor:
    dtype = dtypes.torch_dtype(src.meta.dtype)
    out = torch.empty(src.meta.shape, dtype=dtype, device=device)
    flat = out.reshape(-1).view(torch.uint8) if out.numel() else None
    itemsize = dtypes.itemsize(src.meta.dtype)
    for frag in src.fragments:
        if plan.readers[frag.file_index] == me:
            start = contiguous_start(frag.offsets, frag.lengths, src.meta.shape)
            if start is not None and out.device.type == "cpu":
                reader.read_into(frag, flat[start * itemsize : start * itemsize + frag_bytes(frag)])
                continue
            data = torch.empty(frag_bytes(frag), dtype=torch.uint8, pin_memory=out.device.type == "cuda")
            reader.read_into(frag, data)
        else:
            data = received[frag]
        block = tuple(slice(o, o + n) for o, n in zip(frag.offsets, frag.lengths, strict=True))
        out[block].copy_(data.view(dtype).view(frag.lengths), non_blocking=True)
    return out


def assemble_unit(
    unit: Unit, me: int, plan: Plan, reader: Reader, received: dict[Fragment, torch.Tensor], device
) -> list[tuple[Target, torch.Tensor]]:
    sources = [assemble_source(plan.sources[s], me, plan, reader, received, device) for s in unit.sources]
    produced = transforms.apply(unit.transform, sources, unit.params)
    out = []
    for target, tensor in zip(unit.targets, produced, strict=True):
        if tuple(tensor.shape) != target.shape:
            raise LayoutError(f"{target.name}: built shape {list(tensor.shape)}, expected {list(target.shape)}")
        out.append((target, tensor.to(dtypes.torch_dtype(target.dtype))))
    return out


def unit_bytes(unit: Unit) -> int:
    return sum(math.prod(t.shape) * dtypes.itemsize(t.dtype) for t in unit.targets)

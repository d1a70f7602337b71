"""Sources a family writes into no unit are never silent: the engine reads them once and reports or checks them.

Families are pure (no I/O), so they only declare such sources (families/base.FamilyResult):

- left out: the output has no place for the tensor (a trainer-only buffer such as a routing bias the Hugging
  Face model lacks). The merge goes on; a note names every such tensor with its largest magnitude, so a user
  can tell a harmless zero from a value the trained model relied on.
- must equal: a copy not written because another source, which is written, holds the same values (the head
  of a tied model, saved beside its embedding). The two are compared by a position-sensitive checksum,
  sum over elements of bits(x[i]) * w(i) mod 2**64 with w(i) odd, computed per fragment on the rank that reads
  it and summed across ranks: copies chunked differently compare, one changed element always changes the sum
  (w(i) is invertible mod 2**64 and the bit difference is below 2**64), and moved elements change it with
  overwhelming probability. A mismatch is an error, not a note: writing the model the config describes
  would silently give a model other than the one trained (a run trained untied, a config that ties); the
  message says to fix the config.

Call order: every rank calls `check` after the plan, before any round; it makes one all_gather of small
per-fragment figures (plus one of the verdict when there are copies to compare) and nothing when there is
nothing to check. Checked bytes are not counted as bytes read: the output is not made of them.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import replace

import torch

from distmerge import dtypes
from distmerge.distributed.comm import Comm
from distmerge.engine.plan import Plan
from distmerge.engine.reader import Reader
from distmerge.errors import LayoutError
from distmerge.formats.base import Fragment
from distmerge.natural_order import natural_key

PIECE = 8 << 20  # bytes read and reduced at a time: bounds the memory of a check whatever the tensor's size
MIX = -7046029254386353131  # 0x9E3779B97F4A7C15 as int64: spreads consecutive indices over all bits
INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def check(plan: Plan, left_out: dict[str, str], must_equal: tuple[tuple[str, str], ...], comm: Comm,
          reader: Reader) -> list[str]:
    """Collective (see the module docstring); returns the notes, the same on every rank."""
    if not left_out and not must_equal:
        return []
    pairs = [p for p in must_equal if all(name in plan.sources for name in p)]
    summed = sorted({name for p in pairs for name in p})
    found = comm.gather(lambda: _figures(plan, sorted(left_out), summed, comm.rank, reader))
    peaks: dict[str, float] = defaultdict(float)
    sums: dict[str, int] = defaultdict(int)
    for figures in found:
        for name, (peak, total) in figures.items():
            peaks[name] = _larger(peaks[name], peak)
            sums[name] = (sums[name] + total) % 2**64
    if pairs:  # every rank holds the same sums: agree() makes a mismatch one error raised on all of them
        comm.agree(lambda: _compare(plan, pairs, sums))
    return left_out_notes(left_out, peaks) + [f"{a} not written: a copy of {b}, written in its place (equal: checked)"
                                               for a, b in pairs]


def left_out_notes(left_out: dict[str, str], peaks: dict[str, float] | None = None) -> list[str]:
    """One note per reason naming every tensor (with its largest magnitude when known: inspect reads none)."""
    by_reason: dict[str, list[str]] = defaultdict(list)
    for name in sorted(left_out, key=natural_key):
        shown = f"{name} (max |x| {peaks[name]:.3g})" if peaks is not None and name in peaks else name
        by_reason[left_out[name]].append(shown)
    return [f"not written: {', '.join(names)}: {reason}" for reason, names in by_reason.items()]


def _figures(plan: Plan, peaked: list[str], summed: list[str], rank: int, reader: Reader) -> dict:
    """{source: (largest |x|, checksum)} over the fragments this rank reads (0 for the figure not asked)."""
    out: dict[str, tuple[float, int]] = {}
    for name in dict.fromkeys(peaked + summed):
        peak, total = 0.0, 0
        for frag in plan.sources[name].fragments:
            if plan.readers[frag.file_index] != rank:
                continue
            for start, raw in _pieces(frag, reader):
                if name in peaked:
                    peak = _larger(peak, _peak(raw, frag.dtype))
                if name in summed:
                    total = (total + _checksum(frag, start, raw)) % 2**64
        out[name] = (peak, total)
    return out


def _pieces(frag: Fragment, reader: Reader) -> Iterator[tuple[int, torch.Tensor]]:
    """(first element within the fragment, its bytes) for consecutive pieces of at most PIECE bytes."""
    size = dtypes.itemsize(frag.dtype)
    step = frag.numel if frag.byte_offset < 0 else max(1, PIECE // size)  # a view's fragment: read whole
    for start in range(0, frag.numel, step):
        count = min(step, frag.numel - start)
        part = frag if start == 0 else replace(frag, byte_offset=frag.byte_offset + start * size)
        data = torch.empty(count * size, dtype=torch.uint8)
        reader.read_into(part, data, count=False)
        yield start, data


def _peak(raw: torch.Tensor, code: str) -> float:
    values = raw.view(dtypes.torch_dtype(code)) if code != "BOOL" else raw
    return values.double().abs().max().item() if values.numel() else 0.0


def _larger(a: float, b: float) -> float:
    return a if math.isnan(a) else b if math.isnan(b) else max(a, b)  # a NaN is worth reporting as such


def _checksum(frag: Fragment, start: int, raw: torch.Tensor) -> int:
    bits = raw.view(INTS[dtypes.itemsize(frag.dtype)]).long()
    weight = _global_index(frag, start, bits.numel())
    weight.bitwise_xor_(weight >> 31).mul_(MIX).bitwise_or_(1).mul_(bits)  # in place: ~1.5 GB/s per process
    return int(weight.sum().item()) % 2**64  # int64 arithmetic wraps: the sum is mod 2**64


def _global_index(frag: Fragment, start: int, count: int) -> torch.Tensor:
    """Flat index in the whole tensor of the fragment's elements start..start+count (row-major)."""
    first = frag.flat_start()
    if first is not None:  # one run of the tensor (flat ranges, Shard(0) chunks): no per-dimension arithmetic
        return torch.arange(first + start, first + start + count, dtype=torch.int64)
    local = torch.arange(start, start + count, dtype=torch.int64)
    index = torch.zeros_like(local)
    stride = 1
    for d in reversed(range(len(frag.global_shape))):
        index += (local % frag.lengths[d] + frag.offsets[d]) * stride
        local = local // frag.lengths[d]
        stride *= frag.global_shape[d]
    return index


def _compare(plan: Plan, pairs: list[tuple[str, str]], sums: dict[str, int]) -> None:
    for dropped, kept in pairs:
        a, b = plan.sources[dropped].meta, plan.sources[kept].meta
        if (a.shape, a.dtype) != (b.shape, b.dtype) or sums[dropped] != sums[kept]:
            raise LayoutError(f"{dropped} differs from {kept}, but config.json makes it a copy of {kept} (a tied "
                              "head), so it would not be written: was the run trained untied? fix config.json "
                              "(tie_word_embeddings) or pass --hf-config with the model's own")

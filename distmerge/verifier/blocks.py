"""Figures block by block: a pair of tensors is compared a block of elements at a time, so that neither side has
to be whole in memory (a target arriving as byte pieces, a reference read by byte range).

Block k of a tensor is its elements [k * B, (k + 1) * B) in row-major order, B = BLOCK[device type]. Blocks may
be added in any order; the figures are those of one pass over the blocks in order, the same whatever the order of
arrival (a piece of a fragment read by this rank, a fragment received from another), the process count, or
whether the tensor was whole: `figures` of whole tensors is this over all their blocks.

    target bytes  |--piece--|--piece--|-----received fragment-----|--piece--|
    blocks        |  0  |  1  |  2  |  3  |  4  |  5  |  6  |  7  |  8  | 9 |
                  a block inside one piece is compared from the piece's own buffer; the parts of one that
                  straddles pieces are kept (copied) until its last byte is in (Streamed)
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from distmerge.verifier.report import Figures

# Elements per block. On the CPU 16 Ki: the float64 temporaries of one block (~6 x 128 KB) and the parts of blocks
# kept across pieces (Streamed: at most a block at each edge of a fragment) stay within a few MB. With 1 Mi
# (~50 MB of temporaries) verify of the 0.78 GB bench checkpoint peaked at 0.70 GB per process against merge's
# 0.26 GB; 64 Ki kept 5 MB more of parts at N=2, for no speed (docs/benchmarks.md). On a GPU, 16 Mi.
BLOCK = {"cpu": 2**14, "cuda": 2**24}


def block_size(device: torch.device) -> int:
    return BLOCK["cpu" if device.type == "cpu" else "cuda"]


class Scratch:
    """Buffers of one block, reused by every block of every pair. Allocated anew for each block, the float64
    temporaries grew a process by 170 MB over the ~3,000 blocks of the bench model: glibc carved the freed
    buffers for the small objects made between blocks, so each new buffer came from fresh heap."""

    def __init__(self) -> None:
        self.bufs: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = {}

    def take(self, slot: str, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        buf = self.bufs.get((slot, dtype, device))
        if buf is None or buf.numel() < n:
            buf = self.bufs[slot, dtype, device] = torch.empty(max(n, block_size(device)), dtype=dtype, device=device)
        return buf[:n]


class Running:
    """One pair's figures over `numel` elements, block by block (`add`), then `figures()` and `equal`.
    Accumulates in float64 on the CPU; float32 on a GPU, where float64 is slow and the sums are tree reductions
    anyway; each block's figures come back as Python numbers (one sync per block of 16 Mi elements on a GPU).
    `m`: the merged side, `r` the reference, cast to m's dtype when they differ (compare.py says why)."""

    def __init__(self, numel: int, device: torch.device, atol: float, rtol: float, scratch: Scratch) -> None:
        self.numel, self.device, self.atol, self.rtol, self.scratch = numel, device, atol, rtol, scratch
        self.acc = torch.float64 if device.type == "cpu" else torch.float32
        self.peaks = (0.0, 0.0, 0.0)  # max abs diff, max rel diff, max |ref|
        self.outside = 0
        self.sums: dict[int, tuple[float, ...]] = {}  # block -> sum |diff|, sum a*b, sum a*a, sum b*b
        self.equal = True  # torch.equal over the whole: every block equal

    def _take(self, slot: str, n: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        return self.scratch.take(slot, n, dtype or self.acc, self.device)

    def add(self, k: int, m: torch.Tensor, r: torch.Tensor) -> None:
        m, r, n = m.to(self.device), r.to(self.device), m.numel()
        if r.dtype != m.dtype:
            r = self._take("cast", n, m.dtype).copy_(r)
        same = torch.equal(m, r)  # no NaN in either then: NaN equals nothing
        self.equal = self.equal and same
        b = self._take("b", n).copy_(r)
        if same:  # what the computation below gives, in a fraction of the work (and of the kernels)
            low, high = (x.item() for x in torch.aminmax(b))
            if math.isfinite(low) and math.isfinite(high):  # an inf's |a - b| is NaN: the long way
                b_b = torch.mul(b, b, out=self._take("t", n)).sum().item()
                self._keep(k, (0.0, 0.0, max(-low, high)), (0.0, b_b, b_b, b_b), 0)
                return
        a = self._take("a", n).copy_(m)
        diff = torch.sub(a, b, out=self._take("diff", n)).abs_()
        ref = torch.abs(b, out=self._take("ref", n))
        outside = n - self._close(a, b, diff, ref).sum().item()
        rel = torch.div(diff, ref, out=self._take("t", n))
        rel = torch.where(torch.gt(ref, 0, out=self._take("mask", n, torch.bool)), rel,
                          torch.zeros((), dtype=self.acc, device=self.device), out=rel)
        peaks = (diff.max().item(), rel.max().item(), ref.max().item())
        t = self._take("t", n)
        sums = (diff.sum().item(), *(torch.mul(x, y, out=t).sum().item() for x, y in ((a, b), (a, a), (b, b))))
        self._keep(k, peaks, sums, outside)

    def _close(self, a: torch.Tensor, b: torch.Tensor, diff: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
        """torch.isclose(a, b, rtol, atol, equal_nan=True), in the scratch buffers (isclose allocates its own):
        equal, or both NaN, or a finite |a - b| within atol + rtol * |b|."""
        n = a.numel()
        close = torch.eq(a, b, out=self._take("close", n, torch.bool))
        nan_a = torch.ne(a, a, out=self._take("mask", n, torch.bool))
        nan_b = torch.ne(b, b, out=self._take("mask2", n, torch.bool))
        close |= torch.logical_and(nan_a, nan_b, out=nan_a)
        if self.atol == 0 and self.rtol == 0:
            return close
        allowed = torch.mul(ref, self.rtol, out=self._take("t", n)).add_(self.atol)
        finite = torch.lt(diff, float("inf"), out=self._take("mask", n, torch.bool))  # NaN is not below inf
        within = torch.le(diff, allowed, out=self._take("mask2", n, torch.bool))
        return close.logical_or_(finite.logical_and_(within))

    def _keep(self, k: int, peaks: tuple[float, ...], sums: tuple[float, ...], outside: int) -> None:
        assert k not in self.sums, f"block {k} added twice"
        self.peaks = tuple(map(_peak, self.peaks, peaks))
        self.sums[k] = sums
        self.outside += outside

    def figures(self) -> Figures:
        """The figures once every block is in; the sums added in block order (the same in any arrival order)."""
        blocks = -(-self.numel // block_size(self.device))
        assert sorted(self.sums) == list(range(blocks)), f"{len(self.sums)} of {blocks} blocks compared"
        sum_abs = dot = aa = bb = 0.0
        for k in range(blocks):
            d, ab, a_a, b_b = self.sums[k]
            sum_abs, dot, aa, bb = sum_abs + d, dot + ab, aa + a_a, bb + b_b
        max_abs, max_rel, max_ref = self.peaks
        return Figures(max_abs=max_abs, max_rel=max_rel, mean_abs=sum_abs / max(self.numel, 1),
                       cosine=_cosine(dot, aa, bb), max_ref=max_ref, outside=self.outside)


def _peak(x: float, y: float) -> float:
    """max, NaN if either is (as torch.maximum: whatever the order blocks came in)."""
    return math.nan if math.isnan(x) or math.isnan(y) else max(x, y)


def _cosine(dot: float, aa: float, bb: float) -> float:
    if aa == 0 or bb == 0:
        return 1.0 if aa == bb else 0.0  # both all-zero (fresh biases): the same as far as a model cares
    return max(-1.0, min(1.0, dot / (aa**0.5 * bb**0.5)))  # rounding can step just past 1


def figures(m: torch.Tensor, r: torch.Tensor, atol: float, rtol: float) -> tuple[bool, Figures]:
    """(torch.equal, the figures) of two whole tensors of one shape, on m's device, block by block."""
    run = Running(m.numel(), m.device, atol, rtol, Scratch())
    whole(m, lambda start, count: r.reshape(-1)[start : start + count], run)
    return run.equal, run.figures()


def whole(m: torch.Tensor, other: Callable[[int, int], torch.Tensor], run: Running, merged_first: bool = True,
          per: int = 1) -> None:
    """A whole tensor `m` compared with `other(start, count)`, the other side's elements [start, start + count),
    into `run` (a Running on m's device, or bounded.Bounded): `m` is the merged side when `merged_first`,
    else the reference. `per`: the other side's elements per element of `m` (a 4-bit weight's bytes hold two);
    blocks are the other side's."""
    step, flat = block_size(m.device), m.reshape(-1)
    for k, start in enumerate(range(0, flat.numel() * per, step)):
        mine = flat[start // per : (start + step) // per]
        theirs = other(start, mine.numel() * per)
        run.add(k, *((mine, theirs) if merged_first else (theirs, mine)))


class Streamed:
    """One target arriving as byte pieces at their offsets (`put`: a direct unit's fragments, read by this rank
    one bounce buffer at a time or received whole), each block handed to `block(k, elements)` as soon as its
    last byte is in; `done` once every byte is. Pieces may come in any order, never twice."""

    def __init__(self, nbytes: int, dtype: torch.dtype, block: Callable[[int, torch.Tensor], None],
                 scratch: Scratch) -> None:
        self.nbytes, self.dtype, self.block, self.scratch = nbytes, dtype, block, scratch
        self.step = BLOCK["cpu"] * dtype.itemsize  # bytes per block: the pieces are on the CPU
        self.staged: dict[int, list[tuple[int, bytes]]] = {}  # block -> its parts so far (offset in it, bytes)
        self.got = 0

    @property
    def done(self) -> bool:
        return self.got == self.nbytes

    def put(self, buf: memoryview, offset: int) -> None:
        end = offset + len(buf)
        if not len(buf):
            return
        assert offset >= 0 and end <= self.nbytes, f"bytes [{offset}, {end}) of a {self.nbytes}-byte target"
        for k in range(offset // self.step, -(-end // self.step)):
            lo, hi = k * self.step, min((k + 1) * self.step, self.nbytes)
            a, b = max(lo, offset), min(hi, end)
            piece = buf[a - offset : b - offset]
            if a == lo and b == hi:  # the whole block in this piece: compared from the piece's own buffer
                self._hand(k, piece)
                continue
            # a part: kept (a copy: the piece's buffer is reused) until the rest of the block is in
            parts = self.staged.setdefault(k, [])
            parts.append((a - lo, bytes(piece)))
            if sum(len(p) for _, p in parts) == hi - lo:
                del self.staged[k]
                stage = memoryview(self.scratch.take("stage", hi - lo, torch.uint8, torch.device("cpu")).numpy())
                for at, part in parts:
                    stage[at : at + len(part)] = part
                self._hand(k, stage)
        self.got += len(buf)

    def _hand(self, k: int, data: memoryview) -> None:
        self.block(k, torch.frombuffer(data, dtype=self.dtype))

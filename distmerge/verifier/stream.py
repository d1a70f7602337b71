"""verify's sink (sink.Sink) for a side merged in memory: each target this rank builds is compared, block by block
(verifier/blocks.py), with the tensors paired with it on the other side, which are read a block at a time too.

On the CPU a target of a direct unit (assemble.py: one source, identity or row trim, no cast, each fragment one
run of bytes: FSDP's Shard(0), plain tensors) is never built: its bytes are compared as they arrive, from the
reader's 1 MiB bounce buffer or from the received fragment, as merge writes them into its file. So a rank holds
what merge holds plus a few blocks. Other units (a QKV split, a cast, a GPU) are built whole, as merge builds them,
and compared a block at a time.

A quantized weight (verify --merged CHECKPOINT --quantize) is made by its unit's transform (table.quantized), so its
unit is built whole, as merge builds it; the weight is held until its scales (and global scale), the next targets
of the same unit, are built too, then compared dequantized a block at a time (fp8_compare.py, fp4_compare.py). A
finished quantized model as --merged against a checkpoint: the weight is read a block at a time from its file, its
(small) scales whole. A 4-bit weight's stored bytes hold two of the reference's elements each (Pair.per).

The streamed side is `merged` (verify of a checkpoint against a Hugging Face folder) or `reference` (the second
checkpoint of two, compared with the first's targets held for the round; a checkpoint given as --reference of a
finished model): the figures are always the merged side's against the reference's.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import torch

from distmerge import dtypes
from distmerge.engine.plan import Plan
from distmerge.families.base import Target, Unit
from distmerge.verifier.blocks import Running, Scratch, Streamed, block_size, whole
from distmerge.verifier.fp4_compare import fp4_running
from distmerge.verifier.fp8_compare import Fp8Running, fp8_check, fp8_running
from distmerge.verifier.listing import Listing, Pair
from distmerge.verifier.report import Check, Criteria, judge


class Blocks(Protocol):
    """The other side: elements [start, start + count) of a tensor, flattened (sides.TensorFiles, or the held
    targets of two_checkpoints.HoldSink)."""

    def read(self, name: str, start: int, count: int) -> torch.Tensor: ...


class StreamSink:
    """Call order (sink.py): output(unit) per unit this rank owns in the round, then round_done(); the records
    of the round's pairs are in `checks` after it."""

    def __init__(self, plan: Plan, listing: Listing, other: Blocks, *, streamed: str, crit: Criteria,
                 device: torch.device) -> None:
        assert streamed in ("merged", "reference")
        self.plan, self.listing, self.other, self.crit, self.device = plan, listing, other, crit, device
        self.merged_streams = streamed == "merged"
        self.pairs: dict[str, list[Pair]] = defaultdict(list)  # streamed side's name -> its pairs
        for pair in listing.pairs:
            self.pairs[pair.merged_name if self.merged_streams else pair.reference_name].append(pair)
        self.streams: dict[str, tuple[Streamed, list[tuple[Pair, Running | Fp8Running]]]] = {}  # this round's
        # merge --quantize: a weight's scales (and global scale) -> its pair
        self.scale_of = {name: pair for pair in listing.pairs for name in (pair.scale, pair.shared) if name}
        self.fp8_parts: dict[str, torch.Tensor] = {}  # a built quantized weight or its scales, until all are
        self.scratch = Scratch()
        self.checks: list[Check] = []

    def output(self, unit: int) -> UnitOut:
        out = UnitOut(self, self.plan.units[unit])
        if out.takes_bytes:  # each target a stream, also one of no bytes (its record still comes at round_done)
            for target in out.unit.targets:
                self._stream(target)
        return out

    def round_done(self) -> None:
        """Every streamed target of the round is whole by now: its records."""
        for name, (stream, runs) in self.streams.items():
            assert stream.done, f"{name}: {stream.got} of {stream.nbytes} bytes compared"
            self.checks.extend(self._check(pair, run) for pair, run in runs)
        self.streams.clear()
        assert not self.fp8_parts, f"quantized weights or scales without the rest: {sorted(self.fp8_parts)}"

    def stream(self, name: str) -> Streamed:
        return self.streams[name][0]

    def _stream(self, target: Target) -> None:
        """The target's bytes as they will arrive (a direct unit), compared one block at a time on the CPU."""
        if self.merged_streams and any(p.scale for p in self.pairs.get(target.name, ())):
            return  # a quantized weight: its unit quantizes, so it is built (whole), never a stream of bytes
        runs = [(p, self._running(p, math.prod(target.shape), torch.device("cpu")))
                for p in self.pairs.get(target.name, ())]

        def block(k: int, mine: torch.Tensor) -> None:
            for pair, run in runs:
                run.add(k, *self._oriented(pair, k * block_size(run.device), mine))

        stream = Streamed(target.nbytes, dtypes.torch_dtype(target.dtype), block, self.scratch)
        self.streams[target.name] = (stream, runs)

    def whole(self, name: str, tensor: torch.Tensor) -> None:
        """A target built whole (a unit with a transform or a cast, or on a GPU): compared a block at a time."""
        self.streams.pop(name, None)  # its unit was not direct after all
        if self.merged_streams and self._fp8_part(name, tensor):
            return
        for pair in self.pairs.get(name, ()):
            self._whole(pair, tensor, self._running(pair, tensor.numel(), tensor.device))

    def _whole(self, pair: Pair, tensor: torch.Tensor, run: Running | Fp8Running) -> None:
        other, per = self._other_name(pair), pair.per
        if self.merged_streams:  # the 4-bit weight is `tensor`, its bytes two reference elements each
            read = self.other.read
            whole(tensor, lambda start, count: read(other, start, count), run, per=per)
        else:  # the 4-bit weight is the other side's
            whole(tensor, lambda start, count: self.other.read(other, start // per, count // per), run,
                  merged_first=False)
        self.checks.append(self._check(pair, run))

    def _fp8_part(self, name: str, tensor: torch.Tensor) -> bool:
        """A quantized weight or its scales, built by a quantizing unit: held until all are built (the scales follow
        their weight in the unit), then the weight compared dequantized. False: neither."""
        pair = self.scale_of.get(name) or next((p for p in self.pairs.get(name, ()) if p.scale), None)
        if pair is None:
            return False
        self.fp8_parts[name] = tensor
        parts = [n for n in (pair.merged_name, pair.scale, pair.shared) if n]
        if all(n in self.fp8_parts for n in parts):
            weight, scale, *shared = (self.fp8_parts.pop(n) for n in parts)
            self._whole(pair, weight, self._quantized_running(pair, scale, shared[0] if shared else None,
                                                              weight.device))
        return True

    def _running(self, pair: Pair, numel: int, device: torch.device) -> Running | Fp8Running:
        """A pair's running figures; a quantized weight's when the merged side is a finished quantized model (its
        scales read whole from its file: the other side)."""
        if not pair.scale:
            return Running(numel, device, *self.crit.band(), self.scratch)
        scale, *shared = (self._read_whole(n) for n in (pair.scale, pair.shared) if n)
        return self._quantized_running(pair, scale, shared[0] if shared else None, device)

    def _read_whole(self, name: str) -> torch.Tensor:
        """A copy: the next read reuses the buffer a file's tensor comes in (sides.TensorFiles.read)."""
        shape = self.listing.merged.tensors[name].shape
        return self.other.read(name, 0, math.prod(shape)).reshape(shape).clone()

    def _quantized_running(self, pair: Pair, scale: torch.Tensor, shared: torch.Tensor | None,
                           device: torch.device) -> Fp8Running:
        if pair.per > 1 or pair.shared:
            return fp4_running(pair, self.listing, scale, shared, device, self.crit, self.scratch)
        return fp8_running(pair, self.listing, scale, device, self.crit, self.scratch)

    def _oriented(self, pair: Pair, start: int, mine: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.merged_streams:
            return mine, self.other.read(pair.reference_name, start, mine.numel())
        return self.other.read(pair.merged_name, start // pair.per, mine.numel() // pair.per), mine

    def _other_name(self, pair: Pair) -> str:
        return pair.reference_name if self.merged_streams else pair.merged_name

    def _check(self, pair: Pair, run: Running | Fp8Running) -> Check:
        m = self.listing.merged.tensors[pair.merged_name]
        r = self.listing.reference.tensors[pair.reference_name]
        return make_check(pair, run, file=Path(self.listing.merged.files[m.file]).name, crit=self.crit,
                          shapes=(m.shape, r.shape), dtypes_=(m.dtype, r.dtype))


def make_check(pair: Pair, run: Running | Fp8Running, *, file: str, crit: Criteria,
               shapes: tuple[tuple[int, ...], ...], dtypes_: tuple[str, str]) -> Check:
    """One pair's record once every block is compared; `shapes`, `dtypes_`: (merged's, reference's)."""
    if isinstance(run, Fp8Running):
        return fp8_check(pair, run, file=file, crit=crit, shapes=shapes, ref_dtype=dtypes_[1])
    figs = run.figures()
    dtype, ref_dtype = dtypes_
    passed, outcome, reason = judge(dtype=dtype, ref_dtype=ref_dtype, exact=run.equal, figs=figs, crit=crit)
    if pair.note and not passed:
        reason += f" (the merged model's head is {pair.merged_name}, tied)"
    return Check(
        name=pair.name, passed=passed, outcome=outcome, reason=reason, file=file, shape=shapes[0],
        reference_shape=shapes[1], dtype=dtype, reference_dtype=ref_dtype,
        cast=f"{ref_dtype}->{dtype}" if dtype != ref_dtype else None, bit_exact=run.equal, note=pair.note,
        figures=figs,
    )


class UnitOut:
    """assemble.TargetOut for one unit: a direct unit's bytes into its target's stream (on the CPU), a built
    target compared whole. `offset` names the target whose bytes come next: a direct unit has one."""

    def __init__(self, sink: StreamSink, unit: Unit) -> None:
        self.sink, self.unit = sink, unit
        self.takes_bytes = sink.device.type == "cpu"  # on a GPU the targets are built and compared there
        self.current: Streamed | None = None

    def write(self, name: str, tensor: torch.Tensor) -> int:
        self.sink.whole(name, tensor)
        return tensor.numel() * tensor.element_size()

    def offset(self, name: str, start: int = 0) -> int:
        self.current = self.sink.stream(name)
        return start

    def copy_in(self, copy: Callable[[Callable[[memoryview, int], None]], None], nbytes: int) -> None:
        copy(self.current.put)

    def write_bytes(self, buf: memoryview, offset: int) -> int:
        self.current.put(buf, offset)
        return len(buf)

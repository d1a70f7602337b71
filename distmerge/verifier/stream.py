"""verify's sink (sink.Sink) for a side merged in memory: each target this rank builds is compared, block by block
(verifier/blocks.py), with the tensors paired with it on the other side, which are read a block at a time too.

On the CPU a target of a direct unit (assemble.py: one source, identity or row trim, no cast, each fragment one
run of bytes: FSDP's Shard(0), plain tensors) is never built: its bytes are compared as they arrive, from the
reader's 1 MiB bounce buffer or from the received fragment, as merge writes them into its file. So a rank holds
what merge holds plus a few blocks. Other units (a QKV split, a cast, a GPU) are built whole, as merge builds them,
and compared a block at a time.

An encoded weight (verify --merged CHECKPOINT --quantize) is made by its unit's transform, so its unit is built
whole, as merge builds it; the weight is held until the tensors it is decoded with (Pair.parts: its scales), the
next targets of the same unit, are built too, then compared decoded a block at a time (bounded.py). A finished
encoded model as --merged against a checkpoint: the weight is read a block at a time from its file, its (small)
parts whole. A 4-bit weight's stored bytes hold two of the reference's elements each (Pair.per).

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
from distmerge.verifier.bounded import Bounded, bounded_check, bounded_running
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
        self.streams: dict[str, tuple[Streamed, list[tuple[Pair, Running | Bounded]]]] = {}  # this round's
        # an encoded weight's parts (its scales) -> its pair
        self.part_of = {name: pair for pair in listing.pairs for name in pair.parts}
        self.encoded_parts: dict[str, torch.Tensor] = {}  # a built encoded weight or its parts, until all are
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
        assert not self.encoded_parts, f"encoded weights or their parts without the rest: {sorted(self.encoded_parts)}"

    def stream(self, name: str) -> Streamed:
        return self.streams[name][0]

    def _stream(self, target: Target) -> None:
        """The target's bytes as they will arrive (a direct unit), compared one block at a time on the CPU."""
        if self.merged_streams and any(p.parts for p in self.pairs.get(target.name, ())):
            return  # an encoded weight: its unit encodes, so it is built (whole), never a stream of bytes
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
        if self.merged_streams and self._encoded_part(name, tensor):
            return
        for pair in self.pairs.get(name, ()):
            self._whole(pair, tensor, self._running(pair, tensor.numel(), tensor.device))

    def _whole(self, pair: Pair, tensor: torch.Tensor, run: Running | Bounded) -> None:
        other, per = self._other_name(pair), pair.per
        if self.merged_streams:  # the 4-bit weight is `tensor`, its bytes two reference elements each
            read = self.other.read
            whole(tensor, lambda start, count: read(other, start, count), run, per=per)
        else:  # the 4-bit weight is the other side's
            whole(tensor, lambda start, count: self.other.read(other, start // per, count // per), run,
                  merged_first=False)
        self.checks.append(self._check(pair, run))

    def _encoded_part(self, name: str, tensor: torch.Tensor) -> bool:
        """An encoded weight or one of its parts, built by an encoding unit: held until all are built (the parts
        follow their weight in the unit), then the weight compared decoded. False: neither."""
        pair = self.part_of.get(name) or next((p for p in self.pairs.get(name, ()) if p.parts), None)
        if pair is None:
            return False
        self.encoded_parts[name] = tensor
        names = (pair.merged_name, *pair.parts)
        if all(n in self.encoded_parts for n in names):
            weight, *parts = (self.encoded_parts.pop(n) for n in names)
            self._whole(pair, weight, bounded_running(pair, self.listing, parts, weight.device, self.crit,
                                                      self.scratch))
        return True

    def _running(self, pair: Pair, numel: int, device: torch.device) -> Running | Bounded:
        """A pair's running figures; an encoded weight's when the merged side is a finished encoded model (its
        parts read whole from its file: the other side)."""
        if not pair.parts:
            return Running(numel, device, *self.crit.band(), self.scratch)
        parts = [self._read_whole(n) for n in pair.parts]
        return bounded_running(pair, self.listing, parts, device, self.crit, self.scratch)

    def _read_whole(self, name: str) -> torch.Tensor:
        """A copy: the next read reuses the buffer a file's tensor comes in (sides.TensorFiles.read)."""
        shape = self.listing.merged.tensors[name].shape
        return self.other.read(name, 0, math.prod(shape)).reshape(shape).clone()

    def _oriented(self, pair: Pair, start: int, mine: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.merged_streams:
            return mine, self.other.read(pair.reference_name, start, mine.numel())
        return self.other.read(pair.merged_name, start // pair.per, mine.numel() // pair.per), mine

    def _other_name(self, pair: Pair) -> str:
        return pair.reference_name if self.merged_streams else pair.merged_name

    def _check(self, pair: Pair, run: Running | Bounded) -> Check:
        m = self.listing.merged.tensors[pair.merged_name]
        r = self.listing.reference.tensors[pair.reference_name]
        return make_check(pair, run, file=Path(self.listing.merged.files[m.file]).name, crit=self.crit,
                          shapes=(m.shape, r.shape), dtypes_=(m.dtype, r.dtype))


def make_check(pair: Pair, run: Running | Bounded, *, file: str, crit: Criteria,
               shapes: tuple[tuple[int, ...], ...], dtypes_: tuple[str, str]) -> Check:
    """One pair's record once every block is compared; `shapes`, `dtypes_`: (merged's, reference's)."""
    if isinstance(run, Bounded):
        return bounded_check(pair, run, file=file, crit=crit, shapes=shapes, ref_dtype=dtypes_[1])
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

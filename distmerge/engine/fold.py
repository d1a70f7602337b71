"""Assemble a unit whose transform is a fold (families/transforms.Fold: an average's inputs) one group at a time.

UnitBuild (assemble.py) preallocates every source of a unit before the round's fragments arrive. A fold's unit
holds K groups of sources (K inputs of one tensor): FoldBuild keeps what arrives instead and assembles the groups
in the fold's order, once the round's fragments are all there:

    place_received   a fragment another rank read (or read with the packing): its bytes kept where they arrived
                     (the round's receive buffer), not copied
    place_local      a fragment this rank reads: noted, read only when its group's turn comes
    advance          for each group k in order whose sources have all come: its sources allocated and filled
                     (received bytes copied in, local ones read straight into them), fold.step(state, k, tensors),
                     the group's tensors dropped (those a later group shares kept until then)
    finish           advance; then fold.end(state) -> the targets (changed by a wrapping transform: --quantize's
                     FP8), each cast to its dtype and handed to the output (asked for only now: a sink's output
                     of a unit is made in the round that builds it)

A unit over the budget is carried over several rounds (plan.portions: whole groups per round, in order): `advance`
ends each round but the last, `finish` the last. So an owner holds one input's tensors of a unit, the fold's state
(an average: a float64 sum per target) and one round's received bytes (under the budget, or one group), instead
of all K inputs' tensors and bytes at once. Each fragment is still read once, by its reader.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

import torch

from distmerge import dtypes
from distmerge.engine.assemble import TargetOut, UnitBuild
from distmerge.engine.plan import Plan
from distmerge.engine.reader import Reader
from distmerge.errors import LayoutError
from distmerge.families import transforms
from distmerge.families.base import Unit
from distmerge.formats.base import Fragment


def unit_build(unit: Unit, plan: Plan, output: Callable[[], TargetOut], device: torch.device,
               reader: Reader) -> UnitBuild | FoldBuild:
    """The build of one unit on its owner: a fold's group by group (a fold wrapped by --quantize's transform too),
    any other's as assemble.UnitBuild. `output()`: where its targets go (sink.Sink.output of the unit)."""
    if transforms.folded(unit.transform, unit.params) is not None:
        return FoldBuild(unit, plan, output, device, reader)
    return UnitBuild(unit, plan, output(), device)


class FoldBuild:
    """One fold unit on its owner: `place` each fragment (local or received), then `advance` or `finish` (module
    docstring)."""

    direct = False

    def __init__(self, unit: Unit, plan: Plan, output: Callable[[], TargetOut], device: torch.device,
                 reader: Reader) -> None:
        self.unit, self.plan, self.output, self.device, self.reader = unit, plan, output, device, reader
        self.sources = [plan.sources[s] for s in unit.sources]
        self.fold, self.params, self.then = transforms.folded(unit.transform, unit.params)
        self.received: dict[str, list[tuple[Fragment, torch.Tensor | memoryview]]] = defaultdict(list)
        self.local: dict[str, list[Fragment]] = defaultdict(list)
        self.groups = self.fold.groups(**self.params)
        self.last = {i: k for k, group in enumerate(self.groups) for i in group}  # the last step each source serves
        self.index = {name: i for i, name in enumerate(unit.sources)}
        self.come: set[int] = set()  # the sources whose fragments have all been placed
        self.held: dict[int, torch.Tensor] = {}  # sources assembled, kept for a later step
        self.state, self.step = None, 0  # the fold's state, the next step

    def take_local(self, source: str, frag: Fragment) -> None:
        return None  # no place yet: read when its group is assembled (place_local)

    def place_local(self, source: str, frag: Fragment, reader: object) -> None:
        self.local[source].append(frag)

    def place_received(self, source: str, frag: Fragment, data: torch.Tensor | memoryview) -> None:
        self.received[source].append((frag, data))

    def advance(self, brought: tuple[str, ...]) -> None:
        """The steps whose sources have all come, in order, once this round's (`brought`) are placed: the round's
        received bytes are used now, never kept past it."""
        self.come.update(self.index[name] for name in brought)
        while self.step < len(self.groups) and all(i in self.come for i in self.groups[self.step]):
            group = self.groups[self.step]
            for i in group:
                if i not in self.held:
                    self.held[i] = self._assemble(i)
            self.state = self.fold.step(self.state, self.step, [self.held[i] for i in group], **self.params)
            for i in group:
                if self.last[i] == self.step:
                    self.held.pop(i, None)
            self.step += 1

    def finish(self) -> None:
        """The last round's: every source has come; the remaining steps, the end, the targets written."""
        self.advance(self.unit.sources)
        produced = self.fold.end(self.state, **self.params)
        self.state = None
        if self.then is not None:
            produced = self.then(produced)
        writer = self.output()
        for target, tensor in zip(self.unit.targets, produced, strict=True):
            if tuple(tensor.shape) != target.shape:
                raise LayoutError(f"{target.name}: built shape {list(tensor.shape)}, expected {list(target.shape)}")
            writer.write(target.name, tensor.to(dtypes.torch_dtype(target.dtype)))

    def _assemble(self, index: int) -> torch.Tensor:
        """Source `index` of the unit, whole: its received fragments copied in, its local ones read into it."""
        meta = self.sources[index].meta
        dtype = dtypes.torch_dtype(meta.dtype)
        tensor = torch.empty(meta.shape, dtype=dtype, device=self.device)
        for frag, data in self.received.pop(meta.name, ()):
            _copy_in(tensor, frag, data)
        for frag in self.local.pop(meta.name, ()):
            start = frag.flat_start()
            if start is not None and tensor.device.type == "cpu" and self.reader.can_copy(frag):
                self.reader.read_into(frag, tensor.view(-1)[start : start + frag.numel].view(torch.uint8))
            else:
                self.reader.read_into(frag, then=lambda data, frag=frag: _copy_in(tensor, frag, data))
        return tensor


def _copy_in(tensor: torch.Tensor, frag: Fragment, data: torch.Tensor | memoryview) -> None:
    if isinstance(data, memoryview):
        data = torch.frombuffer(data, dtype=torch.uint8) if len(data) else torch.empty(0, dtype=torch.uint8)
    view = data.view(dtypes.torch_dtype(frag.dtype)).view(frag.lengths)
    frag.view_in(tensor).copy_(view, non_blocking=True)

"""The one-pass import's sink (engine/sink.Sink): the merge engine hands each unit's owner its Hugging Face
tensors whole, in memory (engine/assemble.py, tensor path: nothing is written as safetensors), and the owner cuts
from them every chunk of each Megatron tensor they make, written at its place in the import's files
(write.Output).

The units were joined beforehand (source.together) so that the Hugging Face tensors of one Megatron tensor (q, k
and v of a layer's linear_qkv, gate and up of its linear_fc1) are one unit's targets: they reach one owner in one
round, and the owner holds them only until that unit's last target is in. Memory per rank: the round's units, as
for merge (its --budget), and the chunks cut from one unit.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from distmerge.engine.plan import Plan
from distmerge.importer.plan import ImportPlan
from distmerge.importer.write import Output, write_tensors


class ImportSink:
    """Sink of the merge engine's rounds: the targets of each unit this rank owns, cut into the import's chunks."""

    def __init__(self, merge_plan: Plan, plan: ImportPlan, out: Output) -> None:
        self.merge_plan, self.plan, self.out = merge_plan, plan, out
        self.made_from: dict[str, list[str]] = {}  # Hugging Face name -> the Megatron tensors it is a source of
        for name, t in plan.tensors.items():
            for source in t.sources:
                self.made_from.setdefault(source, []).append(name)

    def output(self, unit: int) -> UnitTargets:
        return UnitTargets([t.name for t in self.merge_plan.units[unit].targets], self._cut)

    def round_done(self) -> None:
        """Nothing to complete: every chunk was written as its unit finished."""

    def _cut(self, held: dict[str, torch.Tensor]) -> None:
        names = sorted({m for source in held for m in self.made_from.get(source, ())})
        missing = [s for m in names for s in self.plan.tensors[m].sources if s not in held]
        assert not missing, f"{missing[0]} is not among its unit's targets (source.together joins them)"
        write_tensors(self.plan, names, lambda name, first, count: held[name][first : first + count], self.out)


class UnitTargets:
    """assemble.TargetOut of one unit: its targets held as they are built; once the last is in, `cut(held)`."""

    takes_bytes = False  # every target is built as a tensor (assemble.py's tensor path)

    def __init__(self, names: list[str], cut: Callable[[dict[str, torch.Tensor]], None]) -> None:
        self.names, self.cut = names, cut
        self.held: dict[str, torch.Tensor] = {}

    def write(self, name: str, tensor: torch.Tensor) -> int:
        self.held[name] = tensor.detach().to("cpu")
        if len(self.held) == len(self.names):
            held, self.held = self.held, {}
            self.cut(held)
        return tensor.numel() * tensor.element_size()

    def offset(self, name: str, start: int = 0) -> int:
        raise AssertionError("an import's units are never direct (takes_bytes is False)")

    def copy_in(self, copy, nbytes: int) -> None:
        raise AssertionError("an import's units are never direct (takes_bytes is False)")

    def write_bytes(self, buf: memoryview, offset: int) -> int:
        raise AssertionError("an import's units are never direct (takes_bytes is False)")

"""An average's units: each input's family result (its units, under its own names) joined into one.

    input 1   unit [q, k, v] <- split_qkv(decoder.layers.0.self_attention.linear_qkv.weight)   (a Megatron save)
    input 2   units [q] <- identity(input-2:model...q_proj.weight), [k] <- ..., [v] <- ...     (an FSDP save)
      ->      unit [q, k, v] <- average(inputs: ((its sources), ((split_qkv, params, at, (0, 1, 2)),)),
                                                ((its sources), ((identity, (), at, (0,)), ... (2,)))); weights)

Targets that any input builds in one unit are one averaged unit, each input's own units inside it (`_components`).
Before any byte is read (prepare.py calls `combine` in the plan): every input's targets must have the same names,
shapes and dtypes as the first's; the first that differs is named in one line. A source several inputs' units share
(a --base-model folder's weight) is one source of the averaged unit, read once.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from distmerge import dtypes
from distmerge.average.fold import Average
from distmerge.disjoint_sets import DisjointSets
from distmerge.errors import InputError
from distmerge.families.base import FamilyResult, Target, Unit
from distmerge.formats.base import BASE_MODEL_PREFIX
from distmerge.natural_order import natural_key


@dataclass(frozen=True, kw_only=True)
class AverageOptions:
    """--average and --average-weights (output_options.py)."""

    on: bool = False
    weights: tuple[float, ...] | None = None  # None: 1/K each

    def of(self, count: int) -> tuple[float, ...]:
        """Each input's weight: as given, or float64(1/K)."""
        return self.weights if self.weights is not None else (1.0 / count,) * count


def check(options: AverageOptions, count: int, flag: str = "--input") -> list[str]:
    """The inputs and the averaging options agree (rank 0, before anything is read or written); the notes. `flag`:
    the inputs' (merge's --input, verify's --merged)."""
    if count > 1 and not options.on:
        raise InputError(f"{count} inputs given ({flag}, repeated): pass --average to average them, or one {flag} "
                         "to merge one checkpoint")
    if options.on and count < 2:
        raise InputError(f"--average needs two or more checkpoints: pass {flag} once for each, in the order to add "
                         "them")
    if options.weights is not None and not options.on:
        raise InputError(f"--average-weights weighs the inputs of --average: pass --average and an {flag} per weight")
    if options.weights is not None and len(options.weights) != count:
        raise InputError(f"--average-weights gives {len(options.weights)} weight(s) for {count} inputs: one per "
                         f"{flag}, in the same order")
    if not options.on:
        return []
    weights = options.of(count)
    total = math.fsum(weights)
    shown = "1/" + str(count) + " each" if options.weights is None else ", ".join(map(str, weights))
    note = f"average of {count} inputs, weights {shown}"
    return [note + ("" if options.weights is None or total == 1 else f" (they sum to {total:g}, not 1)")]


def combine(results: Sequence[FamilyResult], weights: Sequence[float], labels: Sequence[str]) -> FamilyResult:
    """One result whose units average the inputs' (each input's result under its prefixed source names)."""
    _refuse_adapters(results)
    _check_alike(results, labels)
    units = [averaged(targets, parts, tuple(weights)) for targets, parts in _components(results)]
    return replace(results[0], units=units, left_out={k: v for r in results for k, v in r.left_out.items()},
                   must_equal=tuple(pair for r in results for pair in r.must_equal))


def _components(results: Sequence[FamilyResult]) -> list[tuple[tuple[Target, ...], list[list[Unit]]]]:
    """The targets that some input's unit builds together, joined across the inputs (a Megatron save builds q, k and
    v in one unit, an FSDP save in three: one averaged unit of the three), in the first input's order: per group
    its targets and, per input, its units that build them."""
    built_together: DisjointSets[str] = DisjointSets()
    for result in results:
        for unit in result.units:
            for t in unit.targets[1:]:
                built_together.join(t.name, unit.targets[0].name)
    groups: dict[str, tuple[list[Target], list[list[Unit]]]] = {}
    for i, result in enumerate(results):
        for unit in result.units:
            targets, parts = groups.setdefault(built_together.root(unit.targets[0].name), ([], [[] for _ in results]))
            parts[i].append(unit)
            targets.extend(unit.targets if i == 0 else ())
    return [(tuple(targets), parts) for targets, parts in groups.values()]


def averaged(targets: tuple[Target, ...], parts: Sequence[Sequence[Unit]], weights: tuple[float, ...]) -> Unit:
    """One `average` unit of `targets` from each input's units that build them (fold.py's params)."""
    names: list[str] = []
    where = {t.name: j for j, t in enumerate(targets)}
    inputs = []
    for units in parts:
        group: list[int] = []
        made = []
        for unit in units:
            at = []
            for source in unit.sources:
                if source not in names:
                    names.append(source)
                if names.index(source) not in group:
                    group.append(names.index(source))
                at.append(group.index(names.index(source)))
            made.append((unit.transform, unit.params, tuple(at), tuple(where[t.name] for t in unit.targets)))
        inputs.append((tuple(group), tuple(made)))
    params = Average(inputs=tuple(inputs), weights=weights, floating=tuple(dtypes.is_float(t.dtype) for t in targets),
                     names=tuple(where))
    return Unit(sources=tuple(names), targets=targets, transform="average", params=params)


def prefixed(result: FamilyResult, prefix: str) -> FamilyResult:
    """A family's result for one input with that input's source names (a --base-model folder's stay as they are)."""
    if not prefix:
        return result

    def name(source: str) -> str:
        return source if source.startswith(BASE_MODEL_PREFIX) else prefix + source

    units = [replace(u, sources=tuple(map(name, u.sources))) for u in result.units]
    return replace(result, units=units, left_out={name(k): v for k, v in result.left_out.items()},
                   must_equal=tuple((name(a), name(b)) for a, b in result.must_equal))


def _refuse_adapters(results: Sequence[FamilyResult]) -> None:
    if any(t.group != "model" for r in results for u in r.units for t in u.targets):
        raise InputError("--average: the inputs hold LoRA adapters, and averaging adapters is not averaging their "
                         "products (B @ A): pass --lora merge to fuse each input's adapter into its weights and "
                         "average the fused weights")


def _check_alike(results: Sequence[FamilyResult], labels: Sequence[str]) -> None:
    """Every input's targets as the first's: names, shapes, dtypes; the first difference in name order, named."""
    first = _targets(results[0])
    for i, result in enumerate(results[1:], start=1):
        other = _targets(result)
        for name in sorted(first.keys() | other.keys(), key=natural_key):
            if first.get(name) != other.get(name):
                raise InputError(f"--average: input {i + 1} ({labels[i]}) differs from input 1 ({labels[0]}) at "
                                 f"{name}: {_what(first.get(name), other.get(name))}; nothing was written")


def _targets(result: FamilyResult) -> dict[str, tuple[tuple[int, ...], str]]:
    return {t.name: (t.shape, t.dtype) for u in result.units for t in u.targets}


def _what(first: tuple | None, other: tuple | None) -> str:
    if first is None:
        return "input 1 has no such tensor"
    if other is None:
        return "it has no such tensor"
    if first[0] != other[0]:
        return f"shape {list(other[0])}, input 1's {list(first[0])}"
    return (f"dtype {other[1]}, input 1's {first[1]} (--dtype writes the average of inputs of different dtypes in "
            "one dtype)")

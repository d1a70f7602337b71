"""An average's units: each input's family result (its units, under its own names) joined into one.

    input 1   units [q, k, v] <- split_qkv(decoder...linear_qkv)       (say a Megatron save)
    input 2   units [q], [k], [v] <- identity(model...q_proj) ...        (an FSDP save: other units, refused)
    input 2   units [q, k, v] <- split_qkv(input-2:decoder...)          (another Megatron save: the same targets)
      ->      [q, k, v] <- average(inputs: (split_qkv, its params, its sources), (split_qkv, ...); weights)

Before any byte is read (prepare.py calls `combine` in the plan): every input's targets must have the same names,
shapes and dtypes as the first's; the first that differs is named in one line. A source several inputs' units share
(a --base-model folder's weight) is one source of the averaged unit, read once.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace

from distmerge import dtypes
from distmerge.average import fold  # noqa: F401  (registers the `average` fold)
from distmerge.errors import InputError
from distmerge.families.base import FamilyResult, Unit
from distmerge.formats.base import BASE_MODEL_PREFIX


@dataclass(frozen=True, kw_only=True)
class AverageOptions:
    """--average and --average-weights (options/output_options.py)."""

    on: bool = False
    weights: tuple[float, ...] | None = None  # None: 1/K each

    def of(self, count: int) -> tuple[float, ...]:
        """Each input's weight: as given, or float64(1/K)."""
        return self.weights if self.weights is not None else (1.0 / count,) * count


def check(options: AverageOptions, count: int) -> list[str]:
    """The inputs and the averaging options agree (rank 0, before anything is read or written); the notes."""
    if count > 1 and not options.on:
        raise InputError(f"{count} inputs given (--input, repeated): pass --average to average them, or one --input "
                         "to merge one checkpoint")
    if options.on and count < 2:
        raise InputError("--average needs two or more checkpoints: pass --input once for each, in the order to add "
                         "them")
    if options.weights is not None and not options.on:
        raise InputError("--average-weights weighs the inputs of --average: pass --average and an --input per weight")
    if options.weights is not None and len(options.weights) != count:
        raise InputError(f"--average-weights gives {len(options.weights)} weight(s) for {count} inputs: one per "
                         "--input, in the same order")
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
    first = results[0]
    others = [{_key(u): u for u in r.units} for r in results[1:]]
    units = []
    for unit in first.units:
        matched = [found.get(_key(unit)) for found in others]
        if missing := [i + 2 for i, u in enumerate(matched) if u is None]:
            raise InputError(f"--average: input {missing[0]} ({labels[missing[0] - 1]}) builds "
                             f"{', '.join(_key(unit))} otherwise than input 1 ({labels[0]}): average saves of one "
                             "layout, or merge each and average the merged models' checkpoints of one layout")
        units.append(averaged(unit, matched, tuple(weights)))
    return replace(first, units=units, left_out={k: v for r in results for k, v in r.left_out.items()},
                   must_equal=tuple(pair for r in results for pair in r.must_equal))


def averaged(unit: Unit, others: Sequence[Unit], weights: tuple[float, ...]) -> Unit:
    """`unit` and the other inputs' units of the same targets as one `average` unit (fold.py's params)."""
    names: list[str] = []
    inputs = []
    for one in (unit, *others):
        for source in one.sources:
            if source not in names:
                names.append(source)
        inputs.append((one.transform, one.params, tuple(names.index(s) for s in one.sources)))
    params = (("inputs", tuple(inputs)), ("weights", weights),
              ("floating", tuple(dtypes.is_float(t.dtype) for t in unit.targets)),
              ("names", tuple(t.name for t in unit.targets)))
    return Unit(sources=tuple(names), targets=unit.targets, transform="average", params=params)


def prefixed(result: FamilyResult, prefix: str) -> FamilyResult:
    """A family's result for one input with that input's source names (a --base-model folder's stay as they are)."""
    if not prefix:
        return result

    def name(source: str) -> str:
        return source if source.startswith(BASE_MODEL_PREFIX) else prefix + source

    units = [replace(u, sources=tuple(map(name, u.sources))) for u in result.units]
    return replace(result, units=units, left_out={name(k): v for k, v in result.left_out.items()},
                   must_equal=tuple((name(a), name(b)) for a, b in result.must_equal))


def _key(unit: Unit) -> tuple[str, ...]:
    return tuple(t.name for t in unit.targets)


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
        for name in sorted(first.keys() | other.keys(), key=_natural):
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


def _natural(name: str) -> list:
    return [int(t) if i % 2 else t for i, t in enumerate(re.split(r"(\d+)", name))]

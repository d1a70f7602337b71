"""The `average` fold: every floating tensor of the output is, exactly,

    acc = 0 (float64)
    for each input i, in the order given:  acc += float64(w_i) * float64(x_i)
    the output = acc.to(the output dtype)          (the inputs' dtype, or --dtype; torch's cast)

where x_i is the tensor a merge of input i alone would build before its cast (the checkpoint's values, through its
family's transform: a QKV split, a fused LoRA weight). Each product is rounded once to float64 and added in input
order, so the bytes depend on neither the number of processes nor the device. An integer or bool tensor must hold
the same values in every input: it is written as it is, and a difference is an error naming it.

A unit's params (average/units.py makes them):

    inputs    per input, in order: (the indices of its sources among the unit's, its units: per unit of its
              family (transform, params, its sources' places among the input's, its targets' places among the
              averaged unit's))
    weights   per input: w_i
    floating  per target: averaged (True) or checked equal (False)
    names     per target: its name, for messages
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from distmerge.errors import LayoutError
from distmerge.families.transforms import Fold, Params, apply


@dataclass(frozen=True)
class Average(Params):
    """The fold's keywords (the module docstring says what each holds)."""

    inputs: tuple[tuple[tuple[int, ...], tuple[tuple[str, Params, tuple[int, ...], tuple[int, ...]], ...]], ...]
    weights: tuple[float, ...]
    floating: tuple[bool, ...]
    names: tuple[str, ...]


CHUNK = 1 << 20  # elements made float64 at a time: a tensor's float64 copy is never held whole beside the sum


def _groups(inputs: tuple, **_: object) -> tuple[tuple[int, ...], ...]:
    return tuple(group for group, _ in inputs)


def built(parts: tuple, tensors: list[torch.Tensor], count: int) -> list[torch.Tensor]:
    """One input's targets: each of its units' transform applied to its sources (`at`: their places in the
    input's group), its targets put at their places (`where`) among the averaged unit's."""
    made: list[torch.Tensor] = [torch.empty(0)] * count
    for transform, params, at, where in parts:
        for j, tensor in zip(where, apply(transform, [tensors[a] for a in at], params), strict=True):
            made[j] = tensor
    return made


def _step(state: list | None, k: int, tensors: list[torch.Tensor], inputs: tuple, weights: tuple[float, ...],
          floating: tuple[bool, ...], names: tuple[str, ...]) -> list:
    made = built(inputs[k][1], tensors, len(floating))
    first = state is None
    if first:  # acc = 0 is made by the first sum itself (add_weighted), not by a pass of zeros
        state = [torch.empty(t.shape, dtype=torch.float64, device=t.device) if f else None
                 for t, f in zip(made, floating, strict=True)]
    for j, (tensor, averaged) in enumerate(zip(made, floating, strict=True)):
        if averaged:
            add_weighted(state[j], tensor, weights[k], names[j], first=first)
        elif state[j] is None:
            state[j] = tensor
        elif state[j].shape != tensor.shape or not torch.equal(state[j], tensor.to(state[j].device)):
            raise LayoutError(f"{names[j]} ({str(tensor.dtype).removeprefix('torch.')}) differs between input 1 and "
                              f"input {k + 1}: an average keeps integer and bool tensors only when every input holds "
                              "the same values; average checkpoints of one run")
    return state


def add_weighted(acc: torch.Tensor, tensor: torch.Tensor, weight: float, name: str, first: bool = False) -> None:
    """acc += float64(weight) * float64(tensor), element by element, a chunk at a time. `first`: acc is not made
    yet (its memory holds anything): acc = 0 + w * x, which is w * x + 0.0 (the same bits: -0.0 + 0.0 is 0.0, and
    y + 0.0 is y for every other y), written without reading acc."""
    if tuple(tensor.shape) != tuple(acc.shape):
        raise LayoutError(f"{name}: an input built shape {list(tensor.shape)}, another {list(acc.shape)}")
    flat, into = tensor.reshape(-1), acc.view(-1)
    scratch = torch.empty(min(CHUNK, flat.numel()), dtype=torch.float64, device=acc.device)  # one, reused
    for start in range(0, flat.numel(), CHUNK):
        part = scratch[: min(CHUNK, flat.numel() - start)]
        part.copy_(flat[start : start + CHUNK]).mul_(weight)  # float64(x) exactly, times w rounded once
        if first:
            into[start : start + CHUNK].copy_(part.add_(0.0))
        else:
            into[start : start + CHUNK].add_(part)  # a separate rounding: never fused with the product


def _end(state: list, **_: object) -> list[torch.Tensor]:
    return state


AVERAGE = Fold(groups=_groups, step=_step, end=_end)

"""Several units as one: a unit doing what its members do, its owner holding every member's sources together.
quantize/fused.py joins the members of a fused set (one NVFP4 global scale), the one-pass import the Hugging Face
tensors of one Megatron tensor (importer/source.py); `joined` is the transform such a unit applies."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from distmerge.families.base import Unit
from distmerge.families.transforms import TRANSFORMS, Params


def join_units(units: list[Unit]) -> Unit:
    """One unit doing what `units` do: their sources (each once) in, their targets out, in order."""
    sources = tuple(dict.fromkeys(s for u in units for s in u.sources))
    at = {s: i for i, s in enumerate(sources)}
    parts = tuple((u.transform, u.params, tuple(at[s] for s in u.sources)) for u in units)
    return Unit(sources=sources, targets=tuple(t for u in units for t in u.targets), transform="joined",
                params=Joined(parts=parts))


@dataclass(frozen=True)
class Joined(Params):
    """joined's keywords: each part's (transform, params, its sources' places among the unit's)."""

    parts: tuple[tuple[str, Params, tuple[int, ...]], ...]


def joined(sources: list[torch.Tensor], parts: tuple[tuple[str, Params, tuple[int, ...]], ...]) -> list[torch.Tensor]:
    """Several units as one (a fused set's, fused.join): each part's transform on its own sources, the targets in
    the parts' order.

        sources [a, b, c]   parts (identity, (0,)), (identity, (1,)), (split, (2,))   ->   [a', b', c0, c1]
    """
    out: list[torch.Tensor] = []
    for name, params, at in parts:
        out += TRANSFORMS[name]([sources[i] for i in at], **dict(params))
    return out

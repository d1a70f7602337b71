"""Layout transforms: small pure functions from assembled source tensors to target tensors.

Each is looked up by name from a `Unit`; families declare which one applies to which names.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

Transform = Callable[..., list[torch.Tensor]]


def identity(sources: list[torch.Tensor]) -> list[torch.Tensor]:
    """One source, one target, same layout."""
    return list(sources)


TRANSFORMS: dict[str, Transform] = {"identity": identity}


def apply(name: str, sources: list[torch.Tensor], params: tuple[tuple[str, object], ...]) -> list[torch.Tensor]:
    return TRANSFORMS[name](sources, **dict(params))

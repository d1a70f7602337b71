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


def lora_fuse(sources: list[torch.Tensor], scale: float) -> list[torch.Tensor]:
    """W + (B @ A) * scale, computed in float32 and returned in W's dtype (PEFT's merge_and_unload order).

        W (out, in)   A (r, in)   B (out, r)     all whole tensors on the unit's owner
    """
    base, lora_a, lora_b = sources
    fused = base.float() + (lora_b.float() @ lora_a.float()) * scale
    return [fused.to(base.dtype)]


TRANSFORMS: dict[str, Transform] = {"identity": identity, "lora_fuse": lora_fuse}


def apply(name: str, sources: list[torch.Tensor], params: tuple[tuple[str, object], ...]) -> list[torch.Tensor]:
    return TRANSFORMS[name](sources, **dict(params))

"""Layout transforms: small pure functions from assembled source tensors to target tensors, by name.

A `Unit` names its transform (Unit.transform, with Unit.params); the engine applies it by that name (`apply`). The
generic ones are here; each family's own sit beside its tables and register themselves with `@transform` when the
family is imported (families/__init__.py imports every family):

    families/megatron/transforms.py    split_qkv, split_gate_up, mla_rope_halves
    families/torchtitan/transforms.py  rope_permute
    families/lora/transforms.py        lora_fuse
    families/value_head.py             with_zero_bias
    quantize/table.py                  quantized (--quantize: another transform's targets, some in FP8)
"""

from __future__ import annotations

from collections.abc import Callable

import torch

Transform = Callable[..., list[torch.Tensor]]
TRANSFORMS: dict[str, Transform] = {}


def transform(fn: Transform) -> Transform:
    """Register `fn` under its own name (a unit's `transform`)."""
    assert fn.__name__ not in TRANSFORMS, f"two transforms named {fn.__name__}"
    TRANSFORMS[fn.__name__] = fn
    return fn


@transform
def identity(sources: list[torch.Tensor]) -> list[torch.Tensor]:
    """One source, one target, same layout."""
    return list(sources)


@transform
def trim_rows(sources: list[torch.Tensor], rows: int) -> list[torch.Tensor]:
    """Padded vocabulary (Megatron rounds it up to a multiple of 128 x TP) -> the config's vocab_size rows."""
    (padded,) = sources
    return [padded[:rows].contiguous()]


@transform
def copies(sources: list[torch.Tensor], of: str, count: int, **params: object) -> list[torch.Tensor]:
    """One target that a checkpoint also carries under other names (DeepSeek-V3's MTP layers repeat the embedding
    and the output head, families/megatron/mtp.py): the transform `of` applied once, its one result given `count` times.

        source -> of(source) = t   ->   [t, t, ...]   (count targets, the same bytes)
    """
    (out,) = TRANSFORMS[of](sources, **params)
    return [out] * count


def apply(name: str, sources: list[torch.Tensor], params: tuple[tuple[str, object], ...]) -> list[torch.Tensor]:
    return TRANSFORMS[name](sources, **dict(params))

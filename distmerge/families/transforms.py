"""Layout transforms: small pure functions from assembled source tensors to target tensors, by name.

A `Unit` names its transform (Unit.transform, with Unit.params); the engine applies it by that name (`apply`). The
generic ones are here; each family's own sit beside its tables. None registers itself: distmerge/catalog.py
lists every transform, fold and wrapping change and puts them here (`add`, `add_fold`, `add_after`):

    families/transforms.py             identity, trim_rows, copies
    families/megatron/transforms.py    split_qkv, split_gate_up, mla_rope_halves
    families/torchtitan/transforms.py  rope_permute
    families/lora/transforms.py        lora_fuse
    families/value_head.py             with_zero_bias
    quantize/table.py                  quantized (--quantize: another transform's targets, some quantized)
    quantize/fused.py                  joined (a fused set's units as one)
    average/fold.py                    average (a fold: --average's weighted sum of several inputs' tensors)

A fold (`Fold`, put here with `add_fold`) is a transform made in steps: a unit's sources come in groups (an average's
inputs), and each group, once assembled, is folded into a state that the last step turns into the targets. The
engine assembles one group at a time, in the fold's order, and drops it before the next (engine/fold.py), so a
unit of K groups holds one group's tensors and the state, not K groups at once; `apply` runs the same steps on
sources assembled together, with the same result.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields
from typing import Any

import torch

Transform = Callable[..., list[torch.Tensor]]


@dataclass(frozen=True)
class Params:
    """A unit's transform parameters: each transform's own subclass, whose fields are the transform's keywords
    (SplitQkv(heads=, groups=, head_dim=) for split_qkv). The base, with no field, is a transform's that takes none.
    It iterates as (keyword, value) pairs, so `dict(params)` gives the keywords `apply` passes."""

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        return ((f.name, getattr(self, f.name)) for f in fields(self))


NO_PARAMS = Params()


@dataclass(frozen=True)
class TrimRows(Params):
    rows: int  # the config's vocab_size


@dataclass(frozen=True)
class Copies(Params):
    """copies' own keywords, then its inner transform's (`inner`), flat, as copies takes them."""

    of: str
    count: int
    inner: Params = NO_PARAMS

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        return iter((("of", self.of), ("count", self.count), *self.inner))
TRANSFORMS: dict[str, Transform] = {}


@dataclass(frozen=True)
class Segment:
    """Rows [start, start + count) of source number `source`, given `repeat` times one after another: a piece of
    an inverse transform's target (the inverses below are row copies, so a block of their target rows is read as
    row ranges of the sources, never the whole sources)."""

    source: int
    start: int
    count: int
    repeat: int = 1

    @property
    def rows(self) -> int:
        return self.count * self.repeat


# A transform's inverse, by the transform's name: (the sources' row counts, **the forward transform's params, and
# the inverse's own keywords) -> the target's rows as segments of the Hugging Face tensors, in order. catalog.py
# pairs each transform with its inverse (add_inverse); the import walks the same table rows backwards.
RowsOf = Callable[..., tuple["Segment", ...]]
INVERSES: dict[str, RowsOf] = {}


def add_inverse(forward: Transform, rows: RowsOf) -> None:
    """Make `rows` the inverse of the transform `forward` (its segments: see Segment); catalog.install calls it."""
    assert forward.__name__ not in INVERSES, f"two inverses of {forward.__name__}"
    INVERSES[forward.__name__] = rows


def inverse_segments(name: str, sizes: tuple[int, ...], params: Params = NO_PARAMS, **extra: Any
                     ) -> tuple[Segment, ...]:
    """The segments of the tensor that the transform `name` (with `params`) would split into tensors of `sizes`
    rows: its inverse. `extra`: the inverse's own keywords (pad_rows' `padded`)."""
    if name not in INVERSES:
        raise KeyError(f"the transform {name} has no inverse")
    return INVERSES[name](sizes, **dict(params), **extra)


def narrow(segments: tuple[Segment, ...], start: int, stop: int) -> tuple[Segment, ...]:
    """The segments of target rows [start, stop): a TP shard of a fused tensor, read without the rest."""
    out, at = [], 0
    for seg in segments:
        lo, hi = max(start, at), min(stop, at + seg.rows)
        if lo < hi:
            out.extend(_cut(seg, lo - at, hi - at))
        at += seg.rows
    return tuple(out)


def _cut(seg: Segment, lo: int, hi: int) -> list[Segment]:
    """Rows [lo, hi) of one segment (relative to its start)."""
    if seg.repeat == 1:
        return [Segment(source=seg.source, start=seg.start + lo, count=hi - lo)]
    if seg.count != 1:  # a repeated block longer than a row: cut row by row (never made by the inverses here)
        return [Segment(source=seg.source, start=seg.start + r % seg.count, count=1) for r in range(lo, hi)]
    return [Segment(source=seg.source, start=seg.start, count=1, repeat=hi - lo)]


def gather_rows(sources: list[torch.Tensor], segments: tuple[Segment, ...]) -> torch.Tensor:
    """The target of `segments` made from whole `sources` (the import reads only the rows instead: same result)."""
    parts = [sources[s.source][s.start : s.start + s.count].repeat(s.repeat, *([1] * (sources[s.source].dim() - 1)))
             for s in segments]
    return torch.cat(parts).contiguous()


def add(*fns: Transform) -> None:
    """Make each of `fns` known under its own name (a unit's `transform`); catalog.install calls it."""
    for fn in fns:
        assert fn.__name__ not in TRANSFORMS, f"two transforms named {fn.__name__}"
        TRANSFORMS[fn.__name__] = fn


def identity(sources: list[torch.Tensor]) -> list[torch.Tensor]:
    """One source, one target, same layout."""
    return list(sources)


def identity_rows(sizes: tuple[int, ...]) -> tuple[Segment, ...]:
    """identity's inverse: the one source's rows as they are."""
    return (Segment(source=0, start=0, count=sizes[0]),)


def trim_rows(sources: list[torch.Tensor], rows: int) -> list[torch.Tensor]:
    """Padded vocabulary (Megatron rounds it up to a multiple of 128 x TP) -> the config's vocab_size rows."""
    (padded,) = sources
    return [padded[:rows].contiguous()]


def pad_rows(sizes: tuple[int, ...], rows: int, *, padded: int) -> tuple[Segment, ...]:
    """trim_rows' inverse: the vocab_size rows, then the last row again up to `padded` rows, as Megatron-LM's own
    converter pads a vocabulary (tools/checkpoint/saver_mcore.py: "Expanding embedding to larger size by replicating
    final entry").

        [ row 0 | ... | row V-1 | row V-1 | ... | row V-1 ]      padded rows in all
    """
    if padded < rows:
        raise ValueError(f"padded {padded} < vocab {rows}")
    pad = (Segment(source=0, start=rows - 1, count=1, repeat=padded - rows),) if padded > rows else ()
    return (Segment(source=0, start=0, count=rows), *pad)


def copies(sources: list[torch.Tensor], of: str, count: int, **params: object) -> list[torch.Tensor]:
    """One target that a checkpoint also carries under other names (DeepSeek-V3's MTP layers repeat the embedding
    and the output head, families/megatron/mtp.py): the transform `of` applied once, its one result given `count` times.

        source -> of(source) = t   ->   [t, t, ...]   (count targets, the same bytes)
    """
    (out,) = TRANSFORMS[of](sources, **params)
    return [out] * count


def apply(name: str, sources: list[torch.Tensor], params: Params | tuple[tuple[str, object], ...] = NO_PARAMS
          ) -> list[torch.Tensor]:
    """Apply the transform `name` to `sources` with `params` as its keywords (a Params, or (keyword, value) pairs)."""
    return TRANSFORMS[name](sources, **dict(params))


@dataclass(frozen=True)
class Fold:
    """A transform in steps (the module docstring). Each callable takes the unit's params as keywords:

        groups(**params) -> ((i, j, ...), ...)    the unit's sources (indices) each step takes, in step order;
                                                  a source may serve several steps
        step(state, k, tensors, **params) -> state   step k: the tensors of group k (state None at step 0)
        end(state, **params) -> [targets]         the unit's targets (the engine casts each to its dtype)
    """

    groups: Callable[..., tuple[tuple[int, ...], ...]]
    step: Callable[..., Any]
    end: Callable[..., list[torch.Tensor]]


FOLDS: dict[str, Fold] = {}


def add_fold(name: str, made: Fold) -> None:
    """Make a fold known under `name`: a unit naming it is assembled group by group (engine/fold.py); as a transform
    (`apply`, a wrapping transform's inner) its steps run over sources assembled together."""
    assert name not in TRANSFORMS, f"two transforms named {name}"
    FOLDS[name] = made

    def whole(sources: list[torch.Tensor], **params: object) -> list[torch.Tensor]:
        state = None
        for k, group in enumerate(made.groups(**params)):
            state = made.step(state, k, [sources[i] for i in group], **params)
        return made.end(state, **params)

    whole.__name__ = name
    TRANSFORMS[name] = whole


def is_fold(name: str) -> bool:
    return name in FOLDS


# Transforms that apply an inner transform (params `inner`, `inner_params`) and then change its targets: name -> that
# change, (targets, **their other params) -> targets. A fold wrapped by one is still assembled group by group
# (engine/fold.py), the change applied to the fold's targets.
AFTER: dict[str, Callable[..., list[torch.Tensor]]] = {}


def add_after(name: str, change: Callable[..., list[torch.Tensor]]) -> None:
    """Make `change` the one the wrapping transform `name` makes to its inner transform's targets."""
    AFTER[name] = change


def folded(name: str, params: Params) -> tuple[Fold, dict[str, Any], Callable | None] | None:
    """A unit's fold, its params as keywords and the change a wrapping transform makes to its targets (None: no
    fold). A wrapping transform's params name their inner transform (`inner`) and its params (`inner_params`)."""
    if name in FOLDS:
        return FOLDS[name], dict(params), None
    inner = getattr(params, "inner", None)
    if name in AFTER and isinstance(inner, str) and inner in FOLDS:
        rest = {k: v for k, v in params if k not in ("inner", "inner_params")}
        return FOLDS[inner], dict(params.inner_params), lambda targets: AFTER[name](targets, **rest)  # type: ignore[attr-defined]
    return None

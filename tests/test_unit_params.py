"""A unit's transform parameters are a dataclass of the transform's own (families/transforms.Params), read by
attribute where the code needs one, and passed to the transform as its keywords."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from distmerge.families.base import Unit
from distmerge.families.megatron.transforms import SplitQkv
from distmerge.families.transforms import NO_PARAMS, Copies, Params, TrimRows, apply, folded


def test_params_are_frozen_dataclasses_passed_as_keywords():
    params = SplitQkv(heads=4, groups=2, head_dim=3)
    assert dataclasses.is_dataclass(params) and dict(params) == {"heads": 4, "groups": 2, "head_dim": 3}
    with pytest.raises(dataclasses.FrozenInstanceError):
        params.heads = 8  # type: ignore[misc]
    assert Unit(sources=("a",), targets=()).params is NO_PARAMS and dict(NO_PARAMS) == {}


def test_copies_passes_its_inner_transforms_params_flat():
    """copies takes `of`, `count` and the inner transform's own keywords (rows of trim_rows) side by side."""
    padded = torch.arange(12.0).view(4, 3)
    params = Copies(of="trim_rows", count=3, inner=TrimRows(rows=2))
    assert dict(params) == {"of": "trim_rows", "count": 3, "rows": 2}
    out = apply("copies", [padded], params)
    assert len(out) == 3 and all(torch.equal(t, padded[:2]) for t in out)


def test_a_wrapped_fold_is_found_through_its_params():
    """quantized wrapping the average fold: folded() finds the fold by the params' `inner`, with the inner params as
    its keywords and the wrapper's own as the change's."""
    from distmerge.average.fold import Average
    from distmerge.quantize.table import Quantized

    inner = Average(inputs=(), weights=(), floating=(), names=())
    found = folded("quantized", Quantized(inner="average", inner_params=inner, scheme="fp8-block", weights=()))
    assert found is not None
    fold, keywords, then = found
    assert keywords == {"inputs": (), "weights": (), "floating": (), "names": ()} and then is not None
    assert folded("quantized", Quantized(inner="identity", inner_params=Params(), scheme="fp8-block",
                                         weights=())) is None

"""Tensor and file names in the order a person reads them: `layers.2` before `layers.10`."""

from __future__ import annotations

import re

DIGITS = re.compile(r"(\d+)")


def natural_key(name: str) -> list[str | int]:
    """Return `name` split into text and numbers, the numbers as ints, for sorted(key=...): the parts alternate
    text, number, text ..., so two keys never compare a number with a text."""
    return [int(t) if i % 2 else t for i, t in enumerate(DIGITS.split(name))]

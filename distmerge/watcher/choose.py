"""`--steps`: which steps of the run a watch merges. Light (the command line parses it at start): nothing imported.

    all       every step (the default)
    latest    the finished steps of the highest number (verl's actor and critic of one step both), and any later
              step still being written
    every:K   the steps whose number is a multiple of K
    N,M,...   those numbers
A step without a number (a DCP folder found by its files) is chosen only by `all`.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Choice:
    kind: str  # all | latest | every | numbers
    every: int = 0
    numbers: frozenset[int] = frozenset()

    def __str__(self) -> str:
        if self.kind == "every":
            return f"every:{self.every}"
        if self.kind == "numbers":
            return ",".join(map(str, sorted(self.numbers)))
        return self.kind


def parse_steps(text: str) -> Choice:
    """A --steps value; argparse.ArgumentTypeError with what to write instead."""
    text = text.strip()
    if text in ("all", "latest"):
        return Choice(text)
    if text.startswith("every:") and text[6:].isdigit() and int(text[6:]) > 0:
        return Choice("every", every=int(text[6:]))
    parts = [p.strip() for p in text.split(",")]
    if parts and all(p.isdigit() for p in parts):
        return Choice("numbers", numbers=frozenset(int(p) for p in parts))
    raise argparse.ArgumentTypeError(f"not a choice of steps: {text!r} (all, latest, every:K, or numbers N,M)")


def chosen(choice: Choice, steps: Sequence[Any]) -> list[Any]:
    """The steps (with .number and .finished) `choice` takes, in their order."""
    if choice.kind == "all":
        return list(steps)
    numbered = [s for s in steps if s.number is not None]
    if choice.kind == "every":
        return [s for s in numbered if s.number % choice.every == 0]
    if choice.kind == "numbers":
        return [s for s in numbered if s.number in choice.numbers]
    last = max((s.number for s in numbered if s.finished), default=None)
    return [s for s in numbered if last is None or s.number > last or (s.number == last and s.finished)]


def positive_count(text: str) -> int:
    """--average-last K: how many of the last finished steps (at least 2: an average of one step is that step)."""
    if text.strip().isdigit() and int(text) >= 2:
        return int(text)
    raise argparse.ArgumentTypeError(f"not a count of steps: {text!r} (a whole number, 2 or more)")

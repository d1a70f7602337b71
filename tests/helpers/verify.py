"""verify of a merged folder against its reference, and a tensor changed on purpose (test_verify.py,
test_verify_plot.py, test_docs_examples.py)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from distmerge.front.cli import main as distmerge_main

SHARD = "300KB"  # the 0.82 MB llama fixture in 3 files: work for more than one rank


def verify(*args: object) -> int:
    return distmerge_main(["verify", *map(str, args)])


def bump(name: str) -> Callable[[dict[str, torch.Tensor]], None]:
    def edit(t: dict[str, torch.Tensor]) -> None:
        t[name] = t[name].clone()
        t[name].view(-1)[3] += 1e-2

    return edit

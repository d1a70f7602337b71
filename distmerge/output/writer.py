"""Writes one safetensors file whose header is fully known from the plan before any data exists.

Bytes may arrive in any order and in pieces (a fragment straight from an input file, a received
buffer, a whole assembled tensor): each lands at its planned offset, through the store's file (output/store.py:
a local file under a hidden temporary name, or an object-store upload). Once every byte is in, the file is made
durable, then visible under its final name: never half-written.

A shared file (plan.OutputFile.shared: several ranks write its units) is made in three steps: its owner creates
it (`create=True`); each writer joins it, writes its own units and makes them durable (`finish`); the owner
commits it (`commit`) once every writer's part is durable (sink.py orders the steps with collectives).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from distmerge.families.base import Target
from distmerge.output.store import FileLayout, OutFile, Store


def header_bytes(targets: tuple[Target, ...]) -> tuple[bytes, dict[str, tuple[int, int]]]:
    """The safetensors header (JSON padded with spaces to 8 bytes) and each tensor's data range."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    ranges: dict[str, tuple[int, int]] = {}
    at = 0
    for t in targets:
        ranges[t.name] = (at, at + t.nbytes)
        header[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [at, at + t.nbytes]}
        at += t.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text, ranges


class ShardWriter:
    takes_bytes = True  # a direct unit's bytes go straight to their place in the file (assemble.TargetOut)

    def __init__(self, store: Store | Path, name: str, targets: tuple[Target, ...], *, part: int | None = None,
                 create: bool = True, rank: int = 0, runs: tuple[tuple[int, int, int], ...] = (),
                 token: Any = None) -> None:
        """`store`: where the file goes (a folder: the local store). `part`: the bytes of a shared file this rank
        writes (None: the whole file, committed by `finish`). `create`: make the file (a shared file's other
        writers join the one its owner made, by its `token`). `runs`: (start, end, writer) of a shared file's
        byte runs (default: all of it this rank's)."""
        if not hasattr(store, "create"):
            from distmerge.output.local import LocalStore

            store = LocalStore(store)
        self.name = name
        head, self.ranges = header_bytes(targets)
        self.data_start = len(head)
        self.size = len(head) + sum(t.nbytes for t in targets)
        self.shared = part is not None
        self.own_bytes = part if self.shared else self.size - len(head)
        self.missing = self.own_bytes  # data bytes this rank has not yet written
        self.receipt: Any = None
        self.finished = False
        layout = FileLayout(name=name, header=head, size=self.size, runs=runs or ((0, self.size, rank),),
                            shared=self.shared)
        self.file: OutFile = store.create(layout, rank) if create else store.join(layout, rank, token)
        self.pwrite = self.file.pwrite  # the hot path: reader.copy_to's pieces go straight to the file

    def offset(self, name: str, start: int = 0) -> int:
        """File offset of byte `start` of tensor `name`."""
        return self.data_start + self.ranges[name][0] + start

    def write(self, name: str, tensor: torch.Tensor) -> int:
        """Write a whole assembled tensor at its place."""
        begin, end = self.ranges[name]
        data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        assert data.numel() == end - begin, f"{name}: {data.numel()} bytes, planned {end - begin}"
        return self.write_bytes(memoryview(data.numpy()).cast("B"), self.offset(name))

    def write_bytes(self, buf: memoryview, offset: int) -> int:
        self.pwrite(buf, offset)
        self.missing -= len(buf)
        return len(buf)

    def copy_in(self, copy: Callable[[Callable[[memoryview, int], None]], None], nbytes: int) -> None:
        """Let `copy(put)` deliver nbytes in pieces through `put(buffer, offset)` (reader.copy_to: a fragment
        read straight from its input file)."""
        copy(self.pwrite)
        self.missing -= nbytes

    @property
    def complete(self) -> bool:
        return self.missing == 0

    def finish(self) -> None:
        """Durable, then (a file this rank wrote whole) visible: after this the file is whole or absent, never
        half-written. A shared file's part is only made durable: its owner commits the file (`commit`) once
        every part is."""
        assert self.missing == 0, f"{self.name}: {self.missing} bytes never written"
        self.finished = True
        self.receipt = self.file.finish()
        if not self.shared:
            self.file.commit([self.receipt])

    def commit(self, receipts: list[Any] | None = None) -> None:
        self.file.commit(receipts if receipts is not None else [self.receipt])

    def abort(self) -> None:
        self.file.abort()

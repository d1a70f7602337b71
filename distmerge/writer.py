"""Writes one safetensors file whose header is fully known from the plan before any data exists.

Tensors may arrive in any order (a unit can produce tensors that are not neighbours in name order):
each is written with pwrite at its planned offset. The file lives under a hidden temporary name until
every tensor is in and it is fsynced; then it is renamed into place.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from distmerge.errors import OutputError
from distmerge.mapping import Target


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


def partial_name(name: str) -> str:
    return f".{name}.partial"


class ShardWriter:
    def __init__(self, out_dir: Path, name: str, targets: tuple[Target, ...]) -> None:
        self.final = out_dir / name
        self.temp = out_dir / partial_name(name)
        head, self.ranges = header_bytes(targets)
        self.data_start = len(head)
        self.size = len(head) + sum(t.nbytes for t in targets)
        self.pending = {t.name for t in targets}
        self.fd = os.open(self.temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self._pwrite(memoryview(head), 0)

    def write(self, name: str, tensor: torch.Tensor) -> int:
        begin, end = self.ranges[name]
        data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        assert data.numel() == end - begin, f"{name}: {data.numel()} bytes, planned {end - begin}"
        self._pwrite(memoryview(data.numpy()).cast("B"), self.data_start + begin)
        self.pending.discard(name)
        return end - begin

    @property
    def complete(self) -> bool:
        return not self.pending

    def finish(self) -> None:
        """fsync, close, rename: after this the file is whole or absent, never half-written."""
        try:
            os.fsync(self.fd)
        finally:
            os.close(self.fd)
            self.fd = -1
        os.replace(self.temp, self.final)

    def abort(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        self.temp.unlink(missing_ok=True)

    def _pwrite(self, buf: memoryview, offset: int) -> None:
        done = 0
        try:
            while done < len(buf):
                done += os.pwrite(self.fd, buf[done:], offset + done)
        except OSError as err:
            raise OutputError(f"cannot write {self.temp}: {err.strerror} (is the disk full?)") from None

"""Writes one safetensors file whose header is fully known from the plan before any data exists.

Bytes may arrive in any order and in pieces (a fragment straight from an input file, a received
buffer, a whole assembled tensor): each lands at its planned offset. The file lives under a hidden
temporary name until every byte is in and it is fsynced; then it is renamed into place.

A shared file (plan.OutputFile.shared: several ranks of one host write its units) is made in three steps:
its owner creates it at full size with the header; each writer opens it, writes its own units and fsyncs
(`finish`); the owner renames it (`commit`) once every writer's part is durable (engine.py orders the steps
with collectives).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import torch

from distmerge.errors import OutputError
from distmerge.families.base import Target
from distmerge.output_files import fsync_dir, partial_name
from distmerge.writeback import Writeback

# Large single write() calls into the page cache are several times slower than 1 MiB ones here
# (ext4: 800 MB in 8 MiB or 4 MiB calls took 0.4-3.2 s, in 1 MiB calls 0.25-0.47 s).
WRITE_CHUNK = 1 << 20


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

    def __init__(self, out_dir: Path, name: str, targets: tuple[Target, ...], *, part: int | None = None,
                 create: bool = True) -> None:
        """`part`: the bytes of a shared file this rank writes (None: the whole file, renamed by `finish`).
        `create`: make the temporary file (a shared file's other writers open the one its owner made)."""
        self.final = out_dir / name
        self.temp = out_dir / partial_name(name)
        self.shared = part is not None
        head, self.ranges = header_bytes(targets)
        self.data_start = len(head)
        self.size = len(head) + sum(t.nbytes for t in targets)
        self.own_bytes = part if self.shared else self.size - len(head)
        self.missing = self.own_bytes  # data bytes this rank has not yet written
        try:
            if create:
                self.final.parent.mkdir(parents=True, exist_ok=True)
                self.fd = os.open(self.temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
            else:
                self.fd = os.open(self.temp, os.O_WRONLY | os.O_NOFOLLOW)
        except OSError as err:
            self.fd = -1
            self._failed(err)
        self.writeback = Writeback(self.fd)  # the disk starts on early bytes while later ones are copied
        if not create:
            return
        self.pwrite(memoryview(head), 0)
        if self.shared:  # full size now: the other writers' ranges exist before they write them
            self._truncate()

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
        """fsync, close, rename: after this the file is whole or absent, never half-written. A shared file's
        part is only made durable: its owner renames the file (`commit`) once every part is."""
        assert self.missing == 0, f"{self.final.name}: {self.missing} bytes never written"
        try:
            os.fsync(self.fd)
        finally:
            os.close(self.fd)
            self.fd = -1
        if not self.shared:
            self.commit()

    def commit(self) -> None:
        os.replace(self.temp, self.final)
        fsync_dir(self.final.parent)

    def abort(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        self.temp.unlink(missing_ok=True)

    def pwrite(self, buf: memoryview, offset: int) -> None:
        done = 0
        try:
            while done < len(buf):
                done += os.pwrite(self.fd, buf[done : done + WRITE_CHUNK], offset + done)
        except OSError as err:
            self._failed(err)
        self.writeback.wrote(offset, len(buf))

    def _truncate(self) -> None:
        try:
            os.ftruncate(self.fd, self.size)
        except OSError as err:
            self._failed(err)

    def _failed(self, err: OSError) -> None:
        raise OutputError(f"cannot write {self.final}: {err.strerror} (is the disk full?); nothing was left behind")

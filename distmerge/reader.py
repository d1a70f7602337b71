"""Reads fragment bytes on the rank that owns the input file: one pread per fragment, no page cache
copies kept in this process (mmap is used only to learn where the bytes are)."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from distmerge import dtypes
from distmerge.errors import CorruptInputError
from distmerge.formats.base import Fragment, InputFile, InputFormat, OpenedFile


class Reader:
    def __init__(self, root: Path, fmt: InputFormat, files: tuple[InputFile, ...]) -> None:
        self.root = root
        self.fmt = fmt
        self.files = files
        self.opened: dict[int, OpenedFile] = {}
        self._fds: dict[int, int] = {}
        self.bytes_read = 0

    def open(self, indices: list[int]) -> list[Fragment]:
        """Discover: open the assigned files, return their fragments (the rank's inventory)."""
        found: list[Fragment] = []
        for i in indices:
            self.opened[i] = self.fmt.open(self.root, self.files[i])
            found.extend(self.opened[i].fragments)
        return found

    def read_into(self, frag: Fragment, dest: torch.Tensor) -> None:
        """Fill `dest` (CPU, contiguous uint8 of the fragment's size) with the fragment's bytes."""
        if frag.byte_offset < 0:
            view = self.opened[frag.file_index].views[(frag.key, frag.offsets)]
            dest.view(dtypes.torch_dtype(frag.dtype)).view(frag.lengths).copy_(view)
            self.bytes_read += dest.numel()
            return
        buf = memoryview(dest.numpy()).cast("B")
        fd = self._fd(frag.file_index)
        done = 0
        while done < len(buf):
            got = os.preadv(fd, [buf[done:]], frag.byte_offset + done)
            if got == 0:
                path = self.files[frag.file_index].path
                raise CorruptInputError(f"{path} ends before the bytes of {frag.key}: the file is truncated")
            done += got
        self.bytes_read += done

    def _fd(self, index: int) -> int:
        if index not in self._fds:
            self._fds[index] = os.open(self.root / self.files[index].path, os.O_RDONLY)
        return self._fds[index]

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self.opened.clear()

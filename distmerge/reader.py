"""Reads fragment bytes on the rank that owns the input file: pread into memory, or copy_file_range
straight into an output file. No mapping of the input is kept (mmap only told us where bytes are). Every
file is opened through input_tree.open_input, by the walk's record that came with the scan: on every rank,
a file replaced by a link or a FIFO after discovery is refused, never followed."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import torch

from distmerge import dtypes, input_tree
from distmerge.errors import CorruptInputError
from distmerge.formats import registry
from distmerge.formats.base import Fragment, InputFormat, OpenedFile, Scan

BOUNCE = 1 << 20  # fallback copy chunk (see writer.WRITE_CHUNK)


class Reader:
    def __init__(self, scan: Scan, fmt: InputFormat) -> None:
        self.scan = scan
        self.root = Path(scan.root)
        self.fmt = fmt
        self.files = scan.files
        self.opened: dict[int, OpenedFile] = {}
        self._fds: dict[int, int] = {}
        self.bytes_read = 0
        self._kernel_copy = hasattr(os, "copy_file_range")
        input_tree.adopt(scan.walked)  # files are opened by the walk's record, on every rank

    def open(self, indices: list[int]) -> list[Fragment]:
        """Discover: open the assigned files, return their fragments (the rank's inventory)."""
        found: list[Fragment] = []
        for i in indices:
            self.opened[i] = registry.open_file(self.fmt, self.scan, self.files[i])
            found.extend(self.opened[i].fragments)
        return found

    def can_copy(self, frag: Fragment) -> bool:
        return frag.byte_offset >= 0

    def read_into(self, frag: Fragment, dest: torch.Tensor, count: bool = True) -> None:
        """Fill `dest` (CPU, contiguous uint8 of the fragment's size) with the fragment's bytes; `count`:
        add them to bytes_read (the summary's `read`: bytes the output is made of)."""
        if frag.byte_offset < 0:
            view = self.opened[frag.file_index].views[(frag.key, frag.offsets)]
            dest.view(dtypes.torch_dtype(frag.dtype)).view(frag.lengths).copy_(view)
            self.bytes_read += dest.numel() * count
            return
        buf = memoryview(dest.numpy()).cast("B")
        fd, done = self._fd(frag.file_index), 0
        while done < len(buf):
            got = os.preadv(fd, [buf[done:]], frag.byte_offset + done)
            if got == 0:
                self._truncated(frag)
            done += got
        self.bytes_read += done * count

    def copy_to(self, frag: Fragment, out_fd: int, out_offset: int, nbytes: int) -> None:
        """Copy the fragment's bytes into an output file inside the kernel (no trip through memory).
        Raises OSError on a write failure: the writer, which knows the file's name, reports it."""
        src, done = self._fd(frag.file_index), 0
        while done < nbytes:
            got = self._copy_chunk(src, out_fd, nbytes - done, frag.byte_offset + done, out_offset + done)
            if got == 0:
                self._truncated(frag)
            done += got
        self.bytes_read += done

    def _copy_chunk(self, src: int, dst: int, count: int, src_off: int, dst_off: int) -> int:
        if self._kernel_copy:
            try:
                return os.copy_file_range(src, dst, count, src_off, dst_off)
            except OSError as err:  # another filesystem on an old kernel, or no support: copy by hand
                if err.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
                    raise
                self._kernel_copy = False
        data = os.pread(src, min(count, BOUNCE), src_off)
        return os.pwrite(dst, data, dst_off) if data else 0

    def _truncated(self, frag: Fragment) -> None:
        path = self.files[frag.file_index].path
        raise CorruptInputError(f"{path} ends before the bytes of {frag.key}: the file is truncated")

    def _fd(self, index: int) -> int:
        if index not in self._fds:
            file = self.files[index]  # a second input root's file (--base-model) names its own folder
            self._fds[index] = input_tree.open_input(Path(file.root or self.root) / file.path)[0]
        return self._fds[index]

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self.opened.clear()
        input_tree.adopt(None)

"""Starts the disk writing of an output file's bytes while the later bytes are still being copied in.

A merge writes into the page cache and fsyncs each file when its last byte is in. Left alone, the kernel
writes back almost nothing before that fsync, so copying and disk writing take turns. Asking the kernel to
start writeback of each range once it is written (Linux `sync_file_range(SYNC_FILE_RANGE_WRITE)`: queue the
dirty pages for the disk, do not wait) overlaps the two, and the final fsync finds little left: 0.78 GB copied
through reader.copy_to's buffer and fsynced in 0.34 s instead of 0.54 s by one process, 0.25 s instead of
0.41 s by two writing one file (tests/bench/bench_copy_paths.py, docs/benchmarks.md).
It also keeps the dirty part of the output in the page cache small while a rank writes hundreds of GB.

Durability does not depend on it: the writer still fsyncs every file before renaming it. Where the call does
not exist (not Linux, a libc without it) or a file system refuses it, writeback is simply left to the fsync.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from collections.abc import Callable

# Bytes written before the next writeback request: large enough that the requests cost nothing next to the
# copy (48 requests for 0.78 GB took 0.03-0.06 s of the copy's 0.3 s), small enough that the disk starts early.
KICK_BYTES = 16 << 20
SYNC_FILE_RANGE_WRITE = 2  # <linux/fs.h>: start writeback of dirty pages not yet under writeback; no waiting


def _sync_file_range() -> Callable[[int, int, int, int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        call = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    call.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    call.restype = ctypes.c_int
    return call


_CALL = _sync_file_range()


class Writeback:
    """One output file's written-but-not-yet-requested span. `wrote(offset, n)` after every write; once
    KICK_BYTES have gathered, writeback of the span that holds them is requested. The span may cover bytes
    another rank of a shared file writes, or not yet written holes: the kernel only queues what is dirty."""

    def __init__(self, fd: int) -> None:
        self.fd, self.call = fd, _CALL
        self.lo = self.hi = self.pending = 0

    def wrote(self, offset: int, nbytes: int) -> None:
        if self.call is None or nbytes <= 0:
            return
        if self.pending:
            self.lo, self.hi = min(self.lo, offset), max(self.hi, offset + nbytes)
        else:
            self.lo, self.hi = offset, offset + nbytes
        self.pending += nbytes
        if self.pending >= KICK_BYTES:
            self.flush()

    def flush(self) -> None:
        """Request writeback of what gathered (the fsync that follows waits for all of it anyway)."""
        if self.call is None or not self.pending:
            return
        lo, hi, self.pending = self.lo, self.hi, 0
        if self.call(self.fd, lo, hi - lo, SYNC_FILE_RANGE_WRITE) != 0:
            # ENOSYS, EINVAL (a file system without it), EIO (a failed writeback, which the fsync reports with
            # the file's name): stop asking; nothing is lost.
            self.call = None
            ctypes.set_errno(0)

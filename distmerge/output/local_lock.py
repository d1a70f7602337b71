"""The lock of an output folder (lock.py says what it is for): the file `OUT/.distmerge.lock`.

Made whole or not at all: the record is written to a file of its own name first, then hard-linked to the lock's
name, which fails if the lock exists (link is atomic on local file systems and on NFS, where O_CREAT|O_EXCL was not
before NFSv3; Lustre and GPFS keep it atomic). The holder keeps the file open: the lock is its own while the name
still leads to that inode; it renews it by touching the open file (the mtime is the lease's clock: the file
server's, on NFS). Removing a gone holder's lock is a rename to a name of our own first, then a look at what we
moved (its inode and its record, whose token is unique): if it is not the lock we judged gone (another merge
took it over meanwhile), it is put back.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from pathlib import Path
from typing import Any

from distmerge.errors import OutputError
from distmerge.output.lock import Found
from distmerge.output.names import LOCK


class FolderLock:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.path = root / LOCK
        self.where = str(self.path)
        self.fd = -1
        self.made_root = False

    def create(self, data: bytes) -> bool:
        try:
            return self._link(data)
        except OSError as err:
            raise OutputError(f"cannot make the lock {self.where}: {err.strerror} (is the disk full, or the folder "
                              "not writable?)") from None

    def _link(self, data: bytes) -> bool:
        try:
            self.root.mkdir(parents=True)
            self.made_root = True  # a merge that fails before writing anything leaves no empty folder behind
        except FileExistsError:
            pass
        temp = self.root / f"{LOCK}.{uuid.uuid4().hex}"
        fd = os.open(temp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        try:
            os.write(fd, data)
            os.fsync(fd)
            os.link(temp, self.path)
        except BaseException as err:
            os.close(fd)
            if isinstance(err, FileExistsError):
                return False
            raise
        finally:
            temp.unlink(missing_ok=True)
        self.fd = fd
        return True

    def read(self) -> Found | None:
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW)
        except FileNotFoundError:
            return None
        try:
            return _found(fd)
        finally:
            os.close(fd)

    def remove_if(self, version: Any) -> bool:
        aside = self.root / f"{LOCK}.{uuid.uuid4().hex}.gone"
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return True  # removed by someone else: the lock is free
        fd = os.open(aside, os.O_RDONLY | os.O_NOFOLLOW)
        try:
            moved = _found(fd).version
        finally:
            os.close(fd)
        if moved == version:
            aside.unlink()
            return True
        with contextlib.suppress(FileExistsError):  # a newer holder's lock: put back unless a third took the name
            os.link(aside, self.path)
        aside.unlink()
        return False

    def holds(self) -> bool:
        if self.fd < 0:
            return False
        try:
            here = os.stat(self.path)
        except FileNotFoundError:
            return False
        mine = os.fstat(self.fd)
        return (here.st_dev, here.st_ino) == (mine.st_dev, mine.st_ino)

    def renew(self) -> bool:
        if not self.holds():
            return False
        os.utime(self.fd)
        return True

    def release(self) -> None:
        if self.fd < 0:
            return
        if self.holds():
            self.path.unlink(missing_ok=True)
        os.close(self.fd)
        self.fd = -1
        if self.made_root:
            with contextlib.suppress(OSError):  # not empty: the merge's finished files stay for --resume
                self.root.rmdir()


def _found(fd: int) -> Found:
    """The lock open at `fd`. Its version is its inode and its record (whose token is unique): an inode number
    alone may be reused by the next lock as soon as the last one is removed."""
    st = os.fstat(fd)
    data = os.pread(fd, 1 << 16, 0)
    return Found(data=data, version=(st.st_dev, st.st_ino, data), renewed=st.st_mtime)

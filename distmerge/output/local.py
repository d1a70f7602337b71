"""The local store: an output folder on a local or shared POSIX file system.

Each output file is written under a hidden temporary name (`.NAME.partial`) with pwrite at its planned offsets,
its bytes handed to the disk early (writeback.py), fsynced when its last byte is in, then renamed into place and
the rename made durable (fsync of the folder). A shared file (several ranks of one host write it) is created at
its full size by its owner before the others open it; each writer fsyncs its own part (`finish`), the owner
renames it once every part is durable (`commit`). Ranks share files only within a host (`sharing`): disjoint
writes through one page cache are safe on any local file system, while writers on several nodes would depend on
a shared file system's coherence (NFS clients cache and flush pages on their own).
"""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from distmerge.errors import OutputError
from distmerge.input import tree
from distmerge.output.local_lock import FolderLock
from distmerge.output.names import FINISHED, INDEX_NAME, LOCK, PARTIAL, RECORDS, partial_name
from distmerge.output.store import FileLayout, Sharing, not_empty
from distmerge.output.writeback import Writeback

# Large single write() calls into the page cache are several times slower than 1 MiB ones here
# (ext4: 800 MB in 8 MiB or 4 MiB calls took 0.4-3.2 s, in 1 MiB calls 0.25-0.47 s).
WRITE_CHUNK = 1 << 20


class LocalStore:
    sharing = Sharing(within="host")

    def __init__(self, folder: Path | str) -> None:
        self.root = Path(folder)
        self.url = str(folder)

    def check_place(self, input_root: str) -> None:
        """Refuse an output that would touch the input, before anything is created there."""
        out = self.root.resolve()
        if "://" not in input_root:
            src = Path(input_root).resolve()
            if out == src or src in out.parents:
                raise OutputError(f"output {self.url} is inside the input {input_root}: choose a folder outside it")
        if out.exists() and not out.is_dir():
            raise OutputError(f"output {self.url} exists and is not a folder")

    def lock(self) -> FolderLock:
        return FolderLock(self.root)

    def check(self, input_root: str, overwrite: bool, *, resumable: bool = True) -> None:
        """Refuse outputs that would touch the input or clobber work (the lock aside); never modify anything."""
        self.check_place(input_root)
        out = self.root.resolve()
        # the lock, and the names other merges make it under while they try to take it (local_lock.py)
        if out.exists() and any(not p.name.startswith(LOCK) for p in out.iterdir()) and not overwrite:
            raise not_empty(self.url, resumable)

    def prepare(self, keep_finished: bool) -> None:
        """Create the folder and remove the old index first, so a stale model never looks done. --overwrite
        also removes earlier model files and their records; --resume keeps them for resume.py to judge."""
        out = self.root.resolve()
        out.mkdir(parents=True, exist_ok=True)
        if not keep_finished:  # --resume: resume.start removes it once it knows the merge is not already complete
            (out / INDEX_NAME).unlink(missing_ok=True)
        patterns = PARTIAL if keep_finished else PARTIAL + FINISHED
        for pattern in patterns:
            for path in out.glob(pattern):
                path.unlink()
        if not keep_finished:
            shutil.rmtree(out / RECORDS, ignore_errors=True)

    def host(self) -> str:
        """This machine (tree.host_id: host name and boot id, since host names repeat across containers) and
        its view of the output folder: its device (two containers of one machine may mount it apart)."""
        return f"{tree.host_id()}:{os.stat(self.root).st_dev}"

    def create(self, layout: FileLayout, rank: int) -> LocalFile:
        return LocalFile(self.root, layout, create=True)

    def join(self, layout: FileLayout, rank: int, token: Any) -> LocalFile:
        return LocalFile(self.root, layout, create=False)

    def write_small(self, name: str, data: bytes, temp: str | None = None) -> None:
        """Whole or absent after a crash: write a hidden partial file, fsync it, rename it, fsync the folder."""
        path = self.root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        part = self.root / temp if temp else path.parent / partial_name(path.name)
        with open(part, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(part, path)
        fsync_dir(path.parent)

    def put_stream(self, name: str, chunks: Iterable[bytes]) -> None:
        pieces = iter(chunks)
        first = next(pieces, b"")  # the source is opened and checked before anything is created here
        with open(self.root / name, "wb") as f:
            f.write(first)
            for chunk in pieces:
                f.write(chunk)

    def read(self, name: str) -> bytes | None:
        try:
            return (self.root / name).read_bytes()
        except OSError:
            return None

    def read_range(self, name: str, offset: int, nbytes: int) -> bytes:
        with open(self.root / name, "rb") as f:
            f.seek(offset)
            return f.read(nbytes)

    def size(self, name: str) -> int | None:
        path = self.root / name
        return path.stat().st_size if path.is_file() else None

    def sha256(self, name: str) -> str:
        digest = hashlib.sha256()
        with open(self.root / name, "rb") as f:
            while block := f.read(1 << 20):
                digest.update(block)
        return digest.hexdigest()

    def list(self, pattern: str) -> list[str]:
        return sorted(p.relative_to(self.root).as_posix() for p in self.root.glob(pattern))

    def remove(self, name: str) -> None:
        (self.root / name).unlink(missing_ok=True)


def fsync_dir(folder: Path) -> None:
    """Make a rename or a new file in `folder` durable (the file's own fsync does not cover its name)."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class LocalFile:
    """One output file under its temporary name: pwrite, writeback, fsync, rename."""

    token = None

    def __init__(self, root: Path, layout: FileLayout, *, create: bool) -> None:
        """`create`: make the temporary file (a shared file's other writers open the one its owner made)."""
        self.final = root / layout.name
        self.temp = root / partial_name(layout.name)
        self.fd = -1
        try:
            if create:
                self.final.parent.mkdir(parents=True, exist_ok=True)
                self.fd = os.open(self.temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
            else:
                self.fd = os.open(self.temp, os.O_WRONLY | os.O_NOFOLLOW)
        except OSError as err:
            self._failed(err)
        self.writeback = Writeback(self.fd)  # the disk starts on early bytes while later ones are copied
        if not create:
            return
        self.pwrite(memoryview(layout.header), 0)
        if layout.shared:  # full size now: the other writers' ranges exist before they write them
            try:
                os.ftruncate(self.fd, layout.size)
            except OSError as err:
                self._failed(err)

    def pwrite(self, buf: memoryview, offset: int) -> None:
        done = 0
        try:
            while done < len(buf):
                done += os.pwrite(self.fd, buf[done : done + WRITE_CHUNK], offset + done)
        except OSError as err:
            self._failed(err)
        self.writeback.wrote(offset, len(buf))

    def finish(self) -> None:
        """fsync and close: this rank's bytes are durable."""
        try:
            os.fsync(self.fd)
        finally:
            os.close(self.fd)
            self.fd = -1

    def commit(self, receipts: list[Any]) -> None:
        os.replace(self.temp, self.final)
        fsync_dir(self.final.parent)

    def abort(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        self.temp.unlink(missing_ok=True)

    def _failed(self, err: OSError) -> None:
        raise OutputError(f"cannot write {self.final}: {err.strerror} (is the disk full?); nothing was left behind")

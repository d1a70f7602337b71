"""Names an object store listed, as a folder tree held in memory: the lookups a format asks of a source (listdir,
is_file, is_dir, exists, stat) answered from the listing, with nothing laid out on disk.

A store has no folders of its own: `a/b.pt` makes the folder `a`. The names lie under a path no file system holds
(`top`, never made), rooted as the formats name files: a source of an object store (s3.py) adds each listing it
makes under the path it names it by (the input's prefix; a config folder beside it, listed when first asked about),
and answers every path under `top` from here. A name that is both an object and a folder of objects (`a` and
`a/b`) is no file tree: `add` returns it, for the source to refuse.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterable

from distmerge.input.source import Stat


class Listed:
    """The files (size and time) and folders (their names) of the listings added, by absolute path under `top`."""

    def __init__(self, top: str) -> None:
        self.top = top
        self.files: dict[str, tuple[int, int]] = {}  # path -> (size, mtime_ns)
        self.dirs: dict[str, set[str]] = {top: set()}  # folder path -> the names directly in it

    def add(self, root: str, names: Iterable[tuple[str, int, int]]) -> str | None:
        """Each (name, size, mtime_ns) as the file root/name, with the folders on its way up to `top`. Returns a
        path the names make both a file and a folder (None when there is none)."""
        added = []
        for rel, size, mtime_ns in names:
            path = f"{root}/{rel}"
            self.files[path] = (size, mtime_ns)
            added.append(path)
            child = path
            while child != self.top:
                parent, name = os.path.split(child)
                known = self.dirs.setdefault(parent, set())
                if name in known:  # the folders above are known too
                    break
                known.add(name)
                child = parent
        return next((p for p in added if p in self.dirs), None)

    def holds(self, path: str) -> bool:
        """Whether `path` is this listing's to answer (under `top`): a name not listed there is missing."""
        return path == self.top or path.startswith(self.top + "/")

    def is_file(self, path: str) -> bool:
        return path in self.files

    def is_dir(self, path: str) -> bool:
        return path in self.dirs

    def exists(self, path: str) -> bool:
        return path in self.files or path in self.dirs

    def listdir(self, path: str) -> list[str]:
        if path in self.dirs:
            return sorted(self.dirs[path])
        if path in self.files:
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), path)
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), path)

    def stat(self, path: str) -> Stat:
        if path in self.files:
            size, mtime_ns = self.files[path]
            return Stat(kind="file", size=size, mtime_ns=mtime_ns)
        if path in self.dirs:
            return Stat(kind="dir", size=0, mtime_ns=0)
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), path)

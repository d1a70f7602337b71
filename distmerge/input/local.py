"""A local (or shared POSIX) folder as a Source (source.py): walked once at discovery (tree.py says how and why),
every file opened through that walk or, on the other ranks, through the record of it that came with the scan. The
formats' lookups (listdir, is_file, stat ...) are the folder's as it is, and those that judge links (resolve,
folder) the walk's."""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from distmerge.errors import InputError
from distmerge.input import source, tree
from distmerge.input.reads import FileBatch
from distmerge.input.tree import InputTree, Opened, node_key


@dataclass(frozen=True, kw_only=True)
class Walked:
    """What the walk saw of the files a scan lists, sent to every rank with the scan: for each file (by the
    absolute path formats open it by) its path inside the walked root, with no link on the way, its size,
    device and inode. Device and inode are compared only on the node that walked (its machine and mount namespace):
    across the nodes of a shared file system inode numbers usually agree but device numbers do not, some file
    systems (FUSE, some NFS exports) number inodes per mount, and nodes that each hold a copy of the folder hold
    other files at the same path, so another node compares the size only."""

    root: str  # the walked input folder, resolved
    host: str  # node_key() of the walking process: its machine and mount namespace, where a path shows the same file
    files: dict[str, tuple[str, int, int, int]] = field(default_factory=dict)  # path -> (inside, size, dev, ino)
    folders: dict[str, str] = field(default_factory=dict)  # folders whose unlisted files are opened (scan root)
    listing: Any = None  # a source's own record (s3.Listing): what other ranks make the source again from
    # a folder on several nodes (input/nodes.py): node_key -> that node's files (a file only its holders open);
    # empty for one node
    nodes: dict[str, Any] = field(default_factory=dict)

    def source(self) -> source.Source:
        """The source a rank that did not walk opens these files by."""
        return self.listing.source() if self.listing is not None else LocalSource(self.root, walked=self)


KINDS = ((stat.S_ISREG, "file"), (stat.S_ISDIR, "dir"), (stat.S_ISLNK, "link"))  # source.Stat.kind


class LocalSource:
    """A folder of this machine or a shared file system."""

    plans_ahead = False

    def __init__(self, location: str | Path, *, walked: Walked | None = None) -> None:
        self.url = str(location)
        self.root = Path(walked.root) if walked is not None else Path(os.path.realpath(location))
        self.tree: InputTree | None = None  # on the process that walked it
        self.records: list[Walked] = []  # the records this process opens by

    # -- discovery (rank 0) ----------------------------------------------------------------------------------
    def walk(self) -> None:
        shown = self.url
        if not self.root.exists():
            raise InputError(f"input {shown} does not exist")
        if not self.root.is_dir():
            raise InputError(f"input {shown} is not a folder: pass the checkpoint folder")
        if not any(self.root.iterdir()):
            raise InputError(f"input {shown} is empty")
        self.tree = InputTree(self.root)

    # -- what the formats ask (rank 0): the folder as it is, links judged by the walk -------------------------------
    def at(self, folder: Path | str) -> source.Within:
        return source.Within(self, folder)

    def listdir(self, folder: Path | str) -> list[str]:
        return sorted(os.listdir(folder))

    def is_file(self, path: Path | str) -> bool:
        return Path(path).is_file()

    def is_dir(self, path: Path | str) -> bool:
        return Path(path).is_dir()

    def exists(self, path: Path | str) -> bool:
        return os.path.lexists(path)

    def stat(self, path: Path | str, follow: bool = True) -> source.Stat:
        st = os.stat(path, follow_symlinks=follow)
        kind = next((k for test, k in KINDS if test(st.st_mode)), "other")
        return source.Stat(kind=kind, size=st.st_size, mtime_ns=st.st_mtime_ns)

    def resolve(self, path: Path | str) -> tuple[Path, str]:
        walk = self._walk_of()
        rel, entry = walk.lookup(path)
        return walk.root / rel, entry.why if entry is not None and entry.kind == "refused" else ""

    def folder(self, path: Path | str) -> Path:
        return self._walk_of().folder(path)

    def _walk_of(self) -> InputTree:
        """The walk that judges paths (one outside it leads out of the input): discovery's, or (a folder nothing
        walked: a format used on its own, the --base-model folder) one made now, and not kept (a later walk()
        makes the input's own)."""
        return self.tree if self.tree is not None else InputTree(self.root)

    def read_text(self, path: Path | str, cap: int, what: str) -> str:
        return tree.read_text(Path(path), cap, what, self.open)

    def read_json(self, path: Path | str, cap: int, what: str) -> Any:
        return tree.read_json(Path(path), cap, what, self.open)

    def config_dir(self, folders: Iterable[Path], names: tuple[str, ...]) -> str | None:
        for folder in folders:
            for name in names:
                if self.is_file(folder / name / "config.json"):
                    return str(folder / name)
        return None

    def record(self, folder: Path | str, paths: Iterable[Path | str]) -> Walked:
        walk = self.tree
        assert walk is not None, "record() is rank 0's, after walk()"
        walked = Walked(root=str(walk.root), host=node_key(), listing=self._listing())
        walked.folders[os.path.abspath(folder)] = str(walk.folder(folder).relative_to(walk.root))
        for path in paths:
            real, entry = walk._checked(path, "file")
            walked.files[os.path.abspath(path)] = (str(real.relative_to(walk.root)), entry.size, entry.dev, entry.ino)
        return walked

    def _listing(self) -> Any:
        return None

    # -- every rank --------------------------------------------------------------------------------------------
    def adopt(self, walked: Walked | None) -> None:
        if walked is None:
            self.records.clear()
        elif walked not in self.records:
            self.records.append(walked)

    def holds(self, path: Path | str) -> bool:
        full = os.path.abspath(path)
        if self.tree is not None and self.tree.contains(full):
            return True
        return any(full in w.files or any(Path(full).is_relative_to(f) for f in w.folders) for w in self.records)

    def open(self, path: Path | str) -> Any:
        found = self._held(path)
        return found if found is not None else tree.open_any(path)

    def _held(self, path: Path | str) -> Any:
        """The file at `path` checked against the walk or a record, or None when neither lists it."""
        full = os.path.abspath(path)
        if self.tree is not None and self.tree.contains(full):
            real, entry = self.tree._checked(path, "file")
            return self._file(path, str(real.relative_to(self.tree.root)), entry.size, (entry.dev, entry.ino))
        for walked in self.records:
            if full in walked.files:
                rel, size, dev, ino = walked.files[full]
                if walked.nodes:
                    return self._on_this_node(walked, path, full, rel, size)
                return self._file(path, rel, size, (dev, ino) if walked.host == node_key() else None)
            folder = next((f for f in walked.folders if Path(full).is_relative_to(f)), None)
            if folder is not None:  # an unlisted file of the save (DCP's .metadata): no link on the way, regular
                return self._file(path, os.path.normpath(os.path.join(walked.folders[folder],
                                                                      os.path.relpath(full, folder))), None, None)
        return None

    def _file(self, shown: Path | str, rel: str, size: int | None, ident: tuple[int, int] | None,
              root: Path | None = None) -> Any:
        root = root if root is not None else self.root
        return Opened(tree.open_beneath(shown, root, rel, size, ident), root / rel)

    @staticmethod
    def _on_this_node(walked: Walked, shown: Path | str, full: str, rel: str, size: int) -> Any:
        """A file of a folder on several nodes, opened by this node's own record of it (the plan gives each file to
        a rank of a node that holds it: input/nodes.py)."""
        mine = walked.nodes.get(node_key())
        if mine is None or full not in mine.files:
            raise InputError(f"{shown} is not on this node's disk ({node_key()}): the plan gives each file to a node "
                             "that holds it (report this)")
        root = Path(mine.root)
        return Opened(tree.open_beneath(shown, root, rel, size, mine.files[full]), root / rel)

    # -- the read policy ---------------------------------------------------------------------------------------
    def batch(self, reader: Any) -> FileBatch:
        return FileBatch(reader)

    def each(self, fn: Callable[[Any], Any], items: list[Any]) -> list[Any]:
        return [fn(item) for item in items]

    def shown(self, message: str) -> str:
        return message

    def __str__(self) -> str:
        return self.url


def load(root: Path | str) -> InputTree:
    """Walk a folder as the input of what follows in this context (tests; discovery uses walk())."""
    src = LocalSource(root)
    src.tree = InputTree(Path(root))
    source.session().use(src)
    return src.tree

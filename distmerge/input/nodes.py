"""An input folder at the same path on several nodes, each node's disk holding some of its files (a training job
without a shared file system leaves each rank's files on its own node): the folder the formats see is the union of
what every node lists there, and each file is read on a node that holds it.

    phase     who                         what
    list      the first rank of each node walks the folder as its node sees it (`list_here`: an InputTree, or
                                          why there is none); the listings are gathered (engine/nodes.py)
    discover  rank 0                      a `NodesSource` over the joined listings (`JoinedTree`): the formats'
                                          lookups answered from it, a file rank 0's node holds opened there, any
                                          other read from a node that holds it (`RemoteFile`: each read one
                                          request to that node's first rank, which answers with `Answers`)
              rank 0                      record(): the walk's record (local.Walked) with, for each node, the
                                          files it holds (`NodeFiles`), which travels with the scan
    open      readers                     a file opened by its node's own record (local.LocalSource): the plan
                                          gives each file to a rank of a node that holds it

A node is a machine and the mount namespace of the process (`node_key`): two processes of one node see the same
disk, and two torchrun agents on one machine, each in a mount namespace of its own, are two nodes (the tests
simulate nodes so). A shared folder is the case where every node lists every file.
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from distmerge.errors import InputError
from distmerge.input import source, tree
from distmerge.input.local import LocalSource, Walked
from distmerge.input.tree import Entry, InputTree

FETCH_PIECE = 16 << 20  # bytes one request of a remote read carries at most


@dataclass(frozen=True, kw_only=True)
class Listing:
    """What one node sees at an input path: its walk, or why there is none (missing, not a folder)."""

    tree: InputTree | None
    why: str = ""


def list_here(location: Path | str) -> Listing:
    """The folder walked as this node sees it; a node that lacks it lists nothing (another node may hold it all)."""
    root = Path(location)
    if not root.exists():
        return Listing(tree=None, why="does not exist")
    if not root.is_dir():
        return Listing(tree=None, why="is not a folder")
    return Listing(tree=InputTree(root))


def same_files(listings: list[Listing]) -> bool:
    """Whether every node lists the same files, of the same sizes (a shared folder: nothing to join)."""
    def files(lst: Listing) -> set[tuple[str, int]] | None:
        return None if lst.tree is None else {(rel, e.size) for rel, e in lst.tree.entries.items() if e.kind == "file"}
    return all(files(lst) is not None and files(lst) == files(listings[0]) for lst in listings)


@dataclass(frozen=True, kw_only=True)
class NodeFiles:
    """One node's view of the files a scan lists: its root (resolved there) and, per file, its device and inode,
    checked when a rank of that node opens it."""

    root: str
    files: dict[str, tuple[int, int]] = field(default_factory=dict)  # absolute path (the joined root's) -> dev, ino


class JoinedTree(InputTree):
    """The union of the nodes' walks of one folder, looked up as one walk (links, refusals, kinds): `held[rel]` is
    the nodes that hold a regular file there, each with its own entry."""

    def __init__(self, listings: list[Listing], shown: str) -> None:  # noqa: D107 - no walk: the nodes walked
        trees = {node: lst.tree for node, lst in enumerate(listings) if lst.tree is not None}
        if not trees:
            raise InputError(f"input {shown} {listings[0].why} on any of the {len(listings)} nodes")
        first = trees[min(trees)]
        self.root, self.given = first.root, first.given
        self.roots = {node: t.root for node, t in trees.items()}
        self.entries: dict[str, Entry] = {}
        self._links: dict[str, str] = {}
        self.held: dict[str, dict[int, Entry]] = defaultdict(dict)
        for node, t in sorted(trees.items()):
            for rel, entry in t.entries.items():
                self._join(rel, entry, node, shown)
            for rel, target in t._links.items():
                self._links.setdefault(rel, target)
        if not any(rel for rel in self.entries) and not self._links:
            raise InputError(f"input {shown} is empty on every node")
        self.children: dict[str, set[str]] = defaultdict(set)
        for rel in (*self.entries, *self._links):
            if rel:
                parent, _, name = rel.rpartition("/")
                self.children[parent].add(name)

    def _join(self, rel: str, entry: Entry, node: int, shown: str) -> None:
        known = self.entries.setdefault(rel, entry)
        if entry.kind == "file":
            self.held[rel][node] = entry
        if {known.kind, entry.kind} == {"file", "dir"}:
            raise InputError(f"{shown}/{rel} is a file on one node and a folder on another: each node must hold the "
                             "same checkpoint's files at the same path")

    def holders(self, rel: str) -> dict[int, Entry]:
        return self.held.get(rel, {})


class NodesSource(LocalSource):
    """A folder at the same path on several nodes (see the module's docstring). `here`: rank 0's node (whose
    files it opens itself); `fetch(node, rel, offset, nbytes)`: bytes of a file another node holds, asked of it."""

    def __init__(self, location: str | Path, listings: list[Listing], keys: list[str], here: int,
                 fetch: Callable[[int, str, int, int], bytes]) -> None:
        super().__init__(location)
        self.tree = JoinedTree(listings, str(location))
        self.root = self.tree.root
        self.keys, self.here, self._fetch = keys, here, fetch

    def walk(self) -> None:
        """Walked already, by every node (list_here)."""

    # -- the formats' lookups, answered from the joined walks --------------------------------------------------------
    def _rel(self, path: Path | str) -> tuple[str, Entry | None]:
        return self.tree.lookup(path)

    def listdir(self, folder: Path | str) -> list[str]:
        rel, entry = self._rel(folder)
        if entry is None or entry.kind != "dir":
            raise NotADirectoryError(20, "Not a directory" if entry else "No such file or directory", str(folder))
        return sorted(self.tree.children.get(rel, ()))

    def is_file(self, path: Path | str) -> bool:
        return self._kind(path) == "file"

    def is_dir(self, path: Path | str) -> bool:
        return self._kind(path) == "dir"

    def _kind(self, path: Path | str) -> str | None:
        if not self.tree.contains(os.path.abspath(path)):
            return "file" if Path(path).is_file() else "dir" if Path(path).is_dir() else None
        entry = self._rel(path)[1]
        return entry.kind if entry is not None else None

    def exists(self, path: Path | str) -> bool:
        if not self.tree.contains(os.path.abspath(path)):
            return os.path.lexists(path)
        rel = os.path.relpath(os.path.abspath(path), self.tree.root)
        return rel in self.tree._links or self._rel(path)[1] is not None

    def stat(self, path: Path | str, follow: bool = True) -> source.Stat:
        full = os.path.abspath(path)
        if not self.tree.contains(full):
            return super().stat(path, follow)
        if not follow and os.path.relpath(full, self.tree.root) in self.tree._links:
            return source.Stat(kind="link", size=0, mtime_ns=0)
        entry = self._rel(path)[1]
        if entry is None:
            raise FileNotFoundError(2, "No such file or directory", str(path))
        kind = entry.kind if entry.kind in ("file", "dir") else "other"
        return source.Stat(kind=kind, size=entry.size, mtime_ns=entry.mtime_ns)

    def nodes_holding(self, path: Path | str) -> tuple[int, ...]:
        """The nodes whose disks hold the file at `path` (verify's finished models: who compares what)."""
        real, _ = self.tree._checked(path, "file")
        return tuple(sorted(self.tree.holders(str(real.relative_to(self.tree.root)))))

    # -- the record every rank opens by ---------------------------------------------------------------------------
    def record(self, folder: Path | str, paths: Any) -> Walked:
        walked = super().record(folder, paths)
        by_node: dict[int, NodeFiles] = {}
        for full in walked.files:
            rel = walked.files[full][0]
            holders = self.tree.holders(rel)
            if len({e.size for e in holders.values()}) > 1:
                sizes = ", ".join(f"{e.size:,} bytes on node {n}" for n, e in sorted(holders.items()))
                raise InputError(f"{full} differs between the nodes that hold it ({sizes}): each node must hold the "
                                 "same checkpoint's files; remove the stale copy")
            for node, entry in holders.items():
                by_node.setdefault(node, NodeFiles(root=str(self.tree.roots[node]))).files[full] = (entry.dev,
                                                                                                    entry.ino)
        walked.nodes.update({self.keys[n]: files for n, files in by_node.items()})
        return walked

    # -- opening: here, or from the node that holds the file -------------------------------------------------------
    def _held(self, path: Path | str) -> Any:
        full = os.path.abspath(path)
        if not self.tree.contains(full):
            return super()._held(path)
        real, _ = self.tree._checked(path, "file")
        rel = str(real.relative_to(self.tree.root))
        holders = self.tree.holders(rel)
        if self.here in holders:
            entry = holders[self.here]
            root = self.tree.roots[self.here]
            return tree.Opened(tree.open_beneath(path, root, rel, entry.size, (entry.dev, entry.ino)), root / rel)
        node = min(holders)
        return RemoteFile(lambda offset, n: self._fetch(node, rel, offset, n), holders[node].size, f"{path}")


class RemoteFile:
    """A file another node holds, read through requests to it (source.InFile): rank 0's lookups at discovery and
    finalize (markers, metadata, the config folder); never the tensor data, which its own node reads."""

    by_request = False  # read when needed: each read is one request, answered from that node's page cache

    def __init__(self, fetch: Callable[[int, int], bytes], size: int, shown: str) -> None:
        self._fetch, self.size, self.ident, self.shown = fetch, size, ("remote", shown), shown

    def map(self) -> None:
        return None

    def pread(self, nbytes: int, offset: int) -> bytes:
        """Bytes from `offset`, one request a piece. A read of several pieces fills one buffer as they come (a
        1024-rank save's .metadata is ~0.2 GB: never held twice), and returns it as is (a bytearray)."""
        end = min(offset + nbytes, self.size)
        if end - offset <= FETCH_PIECE:
            return self._fetch(offset, end - offset) if end > offset else b""
        buf, at = bytearray(end - offset), offset
        while at < end:
            piece = self._fetch(at, min(FETCH_PIECE, end - at))
            if not piece:
                del buf[at - offset:]
                break
            buf[at - offset: at - offset + len(piece)] = piece
            at += len(piece)
        return buf  # type: ignore[return-value]  (bytes-like, as every caller uses it)

    def readinto(self, buf: memoryview, offset: int) -> int:
        data = self.pread(len(buf), offset)
        buf[: len(data)] = data
        return len(data)

    read_full = readinto

    def copy_range(self, offset: int, nbytes: int, put: Callable[[memoryview, int], None], bounce: memoryview,
                   shown: str) -> int:
        return tree.copy_through(self.readinto, offset, nbytes, put, bounce)

    def close(self, *_exc: object) -> None:
        pass

    def __enter__(self) -> RemoteFile:
        return self

    __exit__ = close


class Answers:
    """A node's first rank answering rank 0's reads of the files its node holds (`answer`, one request each), by
    the same checks as any open of an input file: the path inside the folder its own walk listed, no link on the
    way, the size and inode it listed."""

    def __init__(self, trees: dict[str, InputTree]) -> None:
        self.trees = trees  # the input's path as given -> this node's walk of it
        self._open: dict[tuple[str, str], tree.Opened] = {}

    def answer(self, request: tuple[str, str, int, int]) -> bytes:
        location, rel, offset, nbytes = request
        key = (location, rel)
        if key not in self._open:
            walk = self.trees[location]
            real, entry = walk._checked(walk.root / rel, "file")
            fd = tree.open_beneath(real, walk.root, rel, entry.size, (entry.dev, entry.ino))
            self._open[key] = tree.Opened(fd, real)
        return self._open[key].pread(min(nbytes, FETCH_PIECE), offset)

    def close(self) -> None:
        for f in self._open.values():
            f.close()
        self._open.clear()

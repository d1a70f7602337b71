"""The input source: everything a merge reads of its checkpoint comes through one `Source`, so that where the input
lives (a local or shared folder, an S3-compatible bucket) is one object the engine is handed, never a question it
asks (the output side's twin: output/store.py).

Two sources exist: `local.LocalSource` (a folder, walked once: tree.py) and `s3.S3Source` (`s3://bucket/prefix`:
listed once, read by ranged GETs). `open_source` picks one by the input's name, from `SCHEMES`; a new source is one
module implementing this protocol plus its line in `SCHEMES` (or `register` from outside: docs/extending.md), and
`distmerge.merge(input=...)` takes a Source object as it is.

Call order (as torch.distributed.checkpoint's StorageReader documents its own). "readers" are the ranks the plan
assigns input files (plan.readers):

    phase     who            call                                 what the source does
    discover  rank 0         open_source(input) -> Source         nothing yet
              rank 0         walk()                               list the input once (lstat walk; one LIST);
                                                                  formats then look at `root`
              rank 0         is_file, config_dir(folders, names)  the config folder near the save, beside the
                                                                  input too (a bucket lists what it is asked)
              rank 0         record(folder, paths) -> Walked      what the walk saw of the scan's files, sent to
                                                                  every rank with the scan
    open      every rank     adopt(walked) (session.adopt)        the source this rank opens the scan's files by
              readers        open(path) -> file                   checked against the record: pread / readinto /
                                                                  read_spans, of the listed size
    rounds    readers        batch(reader) -> a round's reads     the read policy: merged ranged GETs (objects),
                                                                  or Reader.fill's spans (files)
    errors    every rank     shown(message)                       the message naming the input as the user
                                                                  named it (an object's URL, not a placeholder)
    exit      every process  session.forget()                     nothing of the input kept (api.as_found)

The sources of a merge are bound to it, not to the process (`Session`, in a ContextVar): two merges in one process
(the in-job API, verify of two checkpoints) hold their own, and threads a source starts get its session
(`Session.bind`).
"""

from __future__ import annotations

import contextvars
import importlib
import os
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol


class InFile(Protocol):
    """An input file opened for reading (tree.Opened, s3.ObjectFile)."""

    fd: int  # a descriptor to map or pread, or -1: read through the methods below
    size: int  # as listed
    ident: Any  # what tells two names of one file apart (device and inode; bucket and key)
    few_reads: bool  # each read costs a request: read ahead and check what the bytes must be lazily (zip_records)

    def pread(self, nbytes: int, offset: int) -> bytes: ...

    def readinto(self, buf: memoryview, offset: int) -> int: ...

    def close(self) -> None: ...


@dataclass(frozen=True, kw_only=True)
class Expected:
    """Bytes [at, at + length) of a file must pass `check` (which raises CorruptInputError) before any byte of
    [at, until) is handed out: a zip record's local header, whose place and length the zip directory predicted
    (zip_records), checked by whichever read first reaches the record instead of by a read of its own (a file
    with `few_reads`: its `expect(checks)`)."""

    at: int
    length: int
    until: int
    check: Callable[[bytes], None]


class Source(Protocol):
    url: str  # as messages name the input
    root: Path  # where the formats look: the folder, or the placeholders of a listing
    tree: Any  # tree.InputTree of `root` on the process that walked it, else None

    def walk(self) -> None: ...

    def holds(self, path: Path | str) -> bool:
        """Whether `path` names something of this source (its own files, or a config folder it was asked for)."""

    def open(self, path: Path | str) -> InFile | None:
        """The file at `path` checked against the walk or the record; None when it is none of this source's."""

    def is_file(self, path: Path | str) -> bool: ...

    def config_dir(self, folders: Iterable[Path], names: tuple[str, ...]) -> str | None:
        """The first folder/name (folder by folder, name by name) that holds a config.json; "" names the folder."""

    def record(self, folder: Path | str, paths: Iterable[Path | str]) -> Any: ...

    def adopt(self, walked: Any) -> None: ...

    def batch(self, reader: Any) -> Any:
        """The read policy: an object with read_into, copy_to, fill and run (reads.py)."""

    def each(self, fn: Callable[[Any], Any], items: list[Any]) -> list[Any]:
        """fn over items: at once where a read costs a round trip, else in order."""

    def shown(self, message: str) -> str: ...

    plans_ahead: bool  # the read policy: a round's reads may take later rounds' fragments in passing, and an
    # owner's own fragments are read with the packing (reads.Batch); False: each round reads its own (Reader.fill)


# -- which source an input's name is: one line per scheme ------------------------------------------------------
SCHEMES: dict[str, str] = {"s3://": "distmerge.input.s3:S3Source"}
_REGISTERED: dict[str, Callable[[str], Source]] = {}


def register(scheme: str, make: Callable[[str], Source]) -> None:
    """A source for inputs named `scheme...` (`gs://`), from outside distmerge."""
    _REGISTERED[scheme] = make


def is_source(value: object) -> bool:
    """A Source object given as an input (the API's `input=`), not a name of one."""
    return not isinstance(value, (str, os.PathLike)) and all(hasattr(value, m) for m in ("walk", "open", "root"))


def name_of(location: Any) -> str:
    """An input as messages and records name it: a Source by its url."""
    return str(location.url) if is_source(location) else str(location)


def is_url(location: object) -> bool:
    return isinstance(location, str) and "://" in location


def open_source(location: Any) -> Source:
    """The source of an input: a Source object as it is, a URL by its scheme, else a local folder."""
    if not isinstance(location, (str, os.PathLike)):
        return location
    text = str(location)
    for scheme, make in _REGISTERED.items():
        if text.startswith(scheme):
            return make(text)
    for scheme, where in SCHEMES.items():
        if text.startswith(scheme):
            return _made(where, text)
    if is_url(text):
        from distmerge.errors import InputError

        raise InputError(f"input {text}: distmerge reads local folders and {', '.join(SCHEMES)} URLs")
    return _made(LOCAL, text)


LOCAL = "distmerge.input.local:LocalSource"  # any other input


def _made(where: str, *args: Any) -> Source:
    module, _, name = where.partition(":")
    return getattr(importlib.import_module(module), name)(*args)


def of(path: Path | str) -> Source:
    """The source of this merge that holds `path`; a local folder's (its policy, nothing walked) otherwise."""
    return find(path) or _made(LOCAL, path)


def config_dir(folders: Iterable[Path], names: tuple[str, ...]) -> str | None:
    """The config folder near a save (formats/base.config_dir), asked of the source the save is in: a bucket
    lists a folder beside its prefix as a disk has one."""
    folders = list(folders)
    return of(folders[0]).config_dir(folders, names) if folders else None


def record(folder: Path | str, paths: Iterable[Path | str]) -> Any:
    """The walk's record of a scan's files (rank 0, discovery), or None outside a walked input."""
    src = find(folder)
    return src.record(folder, paths) if src is not None and src.tree is not None else None


def each(fn: Callable[[Any], Any], items: list[Any]) -> list[Any]:
    """fn over items (paths of one input), as that input's source makes several small reads."""
    return of(items[0]).each(fn, items) if items else []


# -- the sources of one merge ----------------------------------------------------------------------------------
class Session:
    """The sources a merge reads by: the one it walked, and those adopted from records (other ranks; a second
    input). Lookups by path go to the source whose root is the longest that holds it."""

    def __init__(self) -> None:
        self.sources: list[Source] = []

    def use(self, source: Source) -> Source:
        """The input of a new merge: replaces any earlier one (a later command never judges by a stale walk)."""
        self.sources = [source]
        return source

    def adopt(self, walked: Any, also: bool = False) -> None:
        """Open the scan's files by the record from now on (None: forget the records). `also`: keep those before
        (verify reads two inputs)."""
        if not also:
            self.sources = [s for s in self.sources if s.tree is not None]
            for s in self.sources:
                s.adopt(None)
        if walked is None:
            return
        mine = next((s for s in self.sources if str(s.root) == walked.root), None)
        if mine is None:
            mine = walked.source()
            self.sources.append(mine)
        mine.adopt(walked)

    def find(self, path: Path | str) -> Source | None:
        full = os.path.abspath(path)
        found = [s for s in self.sources if s.holds(full)]
        return max(found, key=lambda s: len(str(s.root))) if found else None

    @contextmanager
    def bound(self) -> Iterator[None]:
        token = _SESSION.set(self)
        try:
            yield
        finally:
            _SESSION.reset(token)

    def bind(self) -> None:
        """In a thread a source starts (ThreadPoolExecutor's initializer): this session is its own."""
        _SESSION.set(self)


_SESSION: contextvars.ContextVar[Session | None] = contextvars.ContextVar("distmerge_input", default=None)


def session() -> Session:
    """The session of this merge (this context): made on first use."""
    found = _SESSION.get()
    if found is None:
        found = Session()
        _SESSION.set(found)
    return found


def forget() -> None:
    """Nothing of any input kept in this context (an API call's end: a job outlives its merges)."""
    _SESSION.set(None)


def find(path: Path | str) -> Source | None:
    """The source of this merge that holds `path`, if any."""
    found = _SESSION.get()
    return found.find(path) if found is not None else None


def shown(message: str) -> str:
    """A message naming each input as the user named it (comm.py applies it to every error that crosses ranks)."""
    found = _SESSION.get()
    for src in found.sources if found is not None else ():
        message = src.shown(message)
    return message

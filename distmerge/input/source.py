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
              rank 0         walk()                               list the input once (lstat walk; one LIST)
              rank 0         fmt.detect(source),                  the formats look at `root` through the source:
                             fmt.scan(source, options)            listdir, is_file, is_dir, exists, stat, resolve,
                                                                  folder, read_text / read_json (markers,
                                                                  trackers), open (pickles, headers), each;
                                                                  at(folder) for a save inside the folder given
              rank 0         config_dir(folders, names)           the config folder near the save, beside the
                                                                  input too (a bucket lists what it is asked)
              rank 0         record(folder, paths) -> Walked      what the walk saw of the scan's files, sent to
                                                                  every rank with the scan
    open      every rank     adopt(walked) (session.adopt)        the source this rank opens the scan's files by
              readers        fmt.open(source, scan, file),        checked against the record: an InFile of the
                             open(path) -> InFile                 listed size; what a caller may do with it
                                                                  (map it, read ahead) is asked of the file
    rounds    readers        batch(reader) -> a round's reads     the read policy: merged ranged GETs (objects),
                                                                  or Reader.fill's spans (files)
    errors    every rank     shown(message)                       the message naming the input as the user
                                                                  named it (an object's URL, not its path)
    exit      every process  the end of fresh_session()           nothing of the input kept (api.as_found)

Formats and the engine never ask which kind of source they read: a lookup that works on a disk works in a bucket.
Paths are names within the source (rooted at `root`); a format never opens, lists or stats one itself
(tests/test_structure.py checks it).

The sources of a merge are bound to it, not to the process (`Session`, in a ContextVar): two merges in one process
(the in-job API, verify of two checkpoints) hold their own, and threads a source starts get its session
(`Session.bind`).
"""

from __future__ import annotations

import bisect
import contextvars
import importlib
import mmap
import os
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol


class InFile(Protocol):
    """An input file opened for reading (tree.Opened, s3.ObjectFile). What a caller may do with it is asked of the
    file (`by_request`, `map`), never of the kind of store it lies in."""

    size: int  # as listed
    ident: Any  # what tells two names of one file apart (device and inode; bucket and key)
    by_request: bool  # each read is a request (a round trip; on some servers a read of the whole object): callers
    # read ahead what they will need and keep it (`keep`), let a check wait for the read that reaches its bytes
    # (`expect`), ask for many ranges in one read (`read_spans`; reads.Batch). False: a read is a system call,
    # made when its bytes are needed.

    def map(self) -> mmap.mmap | None:
        """A private, writable mapping of the whole file (its pages read when used; nothing is ever written back),
        or None where the file cannot be mapped: read its bytes instead."""

    def pread(self, nbytes: int, offset: int) -> bytes: ...

    def readinto(self, buf: memoryview, offset: int) -> int: ...

    def read_full(self, buf: memoryview, offset: int) -> int:
        """buf filled from `offset`; fewer bytes only where the file ends (returns how many)."""

    def copy_range(self, offset: int, nbytes: int, put: Callable[[memoryview, int], None], bounce: memoryview,
                   shown: str) -> int: ...

    def close(self) -> None: ...

    # with by_request: keep(offset, data), expect(checks: list[Expected]), read_spans(start, end, spans) (s3.py)


@dataclass(frozen=True, kw_only=True)
class Expected:
    """Bytes [at, at + length) of a file must pass `check` (which raises CorruptInputError) before any byte of
    [at, until) is handed out: a zip record's local header, whose place and length the zip directory predicted
    (zip_records), checked by whichever read first reaches the record instead of by a read of its own (a file
    read `by_request`: its `expect(checks)`)."""

    at: int
    length: int
    until: int
    check: Callable[[bytes], None]


class Checks:
    """The checks (Expected) of one file read by request not yet made in this process, sorted by `at`; their
    guarded ranges are disjoint (s3.ObjectFile.expect)."""

    def __init__(self, items: list[Expected]) -> None:
        self.items = sorted(items, key=lambda c: c.at)
        self.starts = [c.at for c in self.items]
        self.done: set[int] = set()

    def due(self, lo: int, hi: int) -> list[Expected]:
        """The checks a read of [lo, hi) must make, in file order."""
        k = bisect.bisect_left(self.starts, hi) - 1
        out = []
        while k >= 0 and self.items[k].until > lo:
            if self.items[k].at not in self.done:
                out.append(self.items[k])
            k -= 1
        return out[::-1]



@dataclass(frozen=True, kw_only=True)
class Stat:
    """What a source says of one path (Source.stat)."""

    kind: str  # "file", "dir", "link" (asked not to follow links), "other" (a FIFO, a device, a socket)
    size: int
    mtime_ns: int  # with size, tells --resume whether the input changed since the interrupted run


class Source(Protocol):
    url: str  # as messages name the input
    root: Path  # where the formats look: the folder, or the path a listing's names are looked up by
    tree: Any  # what the walk saw (tree.InputTree, s3.Listing) on the process that walked it, else None
    plans_ahead: bool  # the read policy: a round's reads may take later rounds' fragments in passing, and an
    # owner's own fragments are read with the packing (reads.Batch); False: each round reads its own (Reader.fill)

    def walk(self) -> None: ...

    # -- what the formats ask, rank 0 at discovery (paths: names within the source, rooted at `root`) -------------
    def at(self, folder: Path | str) -> Source:
        """The same input looked at from a folder inside it (`root` = folder): a save inside the folder given."""

    def listdir(self, folder: Path | str) -> list[str]:
        """The names in a folder, sorted; OSError when it is no folder."""

    def is_file(self, path: Path | str) -> bool: ...

    def is_dir(self, path: Path | str) -> bool: ...

    def exists(self, path: Path | str) -> bool:
        """Anything at `path`, a link too (even one that leads nowhere: reading it says what is wrong)."""

    def stat(self, path: Path | str, follow: bool = True) -> Stat:
        """Kind, size and time of what is at `path` (`follow`: of what a link leads to); OSError when nothing."""

    def resolve(self, path: Path | str) -> tuple[Path, str]:
        """Where `path` leads by the walk, following only links that stay inside the input, and, for what distmerge
        does not open there (a link out, a FIFO), why ("" otherwise; a missing path is the caller's to find)."""

    def folder(self, path: Path | str) -> Path:
        """The folder `path` leads to by the walk; InputError for a link out of the input or no folder."""

    def read_text(self, path: Path | str, cap: int, what: str) -> str:
        """A small file whole (a tracker, a marker), refused past `cap` bytes; `what` names it in errors."""

    def read_json(self, path: Path | str, cap: int, what: str) -> Any: ...

    def config_dir(self, folders: Iterable[Path], names: tuple[str, ...]) -> str | None:
        """The first folder/name (folder by folder, name by name) that holds a config.json; "" names the folder."""

    def record(self, folder: Path | str, paths: Iterable[Path | str]) -> Any: ...

    # -- every rank ------------------------------------------------------------------------------------------------
    def adopt(self, walked: Any) -> None: ...

    def holds(self, path: Path | str) -> bool:
        """Whether `path` names something of this source (its own files, or a config folder it was asked for)."""

    def open(self, path: Path | str) -> InFile:
        """The file at `path`, checked against the walk or the record where the source holds it; any other path
        (a folder the user named: --hf-config, --base-model) as any regular file it leads to."""

    def batch(self, reader: Any) -> Any:
        """The read policy: an object with read_into, copy_to, fill and run (reads.py)."""

    def each(self, fn: Callable[[Any], Any], items: list[Any]) -> list[Any]:
        """fn over items: at once where a read costs a round trip, else in order."""

    def shown(self, message: str) -> str: ...


class Within:
    """A source looked at from a folder inside it (Source.at): `root` is that folder, everything else is the
    source's own, so the files are opened, and the lookups answered, exactly as the source's (a format scanning
    torchtitan's step-N or Megatron's iter_N through its DCP reader; detection of a save one folder down)."""

    def __init__(self, src: Source, folder: Path | str) -> None:
        self.source, self.root = src, Path(folder)

    def at(self, folder: Path | str) -> Within:
        return Within(self.source, folder)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.source, name)

    def __str__(self) -> str:
        return str(self.source)


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


def looking_at(where: Any) -> Source:
    """A Source as it is; else the source of this merge that holds the folder `where` (looking from it: a save
    inside the input), or the folder as it is (nothing walked: a format asked on its own, verify's --merged)."""
    if is_source(where):
        return where
    src = find(where)
    if src is None:
        return _made(LOCAL, where)
    full = Path(os.path.abspath(where))
    return src if full == src.root else src.at(full)


# -- the sources of one merge ----------------------------------------------------------------------------------
class Session:
    """The sources a merge reads by: the one it walked, and those adopted from records (other ranks; a second
    input). Lookups by path go to the source whose root is the longest that holds it."""

    def __init__(self) -> None:
        self.sources: list[Source] = []
        self.standing: list[Source] = []  # kept by use(): a config folder the nodes joined (engine/nodes.py)

    def use(self, source: Source) -> Source:
        """The input of a new merge: replaces any earlier one (a later command never judges by a stale walk)."""
        self.sources = [source]
        return source

    def add(self, source: Source) -> Source:
        """Another input of the same merge (an average's: engine/inputs.py), beside the first."""
        self.sources.append(source)
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
        found = [s for s in (*self.sources, *self.standing) if s.holds(full)]
        return max(found, key=lambda s: len(str(s.root))) if found else None

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


@contextmanager
def fresh_session() -> Iterator[None]:
    """Run the block with a session of its own, made on first use, and put back the one before at its end: nothing
    of the inputs the block walked is kept (an API call's end, as a job outlives its merges; a watch's step, as the
    next step's walk is its own). The one way code outside this module starts or drops a session."""
    token = _SESSION.set(None)
    try:
        yield
    finally:
        _SESSION.reset(token)


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

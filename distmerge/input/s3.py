"""An input in an object store (`--input s3://bucket/prefix`) as a Source (source.py): listed once, read by ranged
GETs. This file and its line in source.SCHEMES are all a new input store takes.

The listing (one paginated LIST, at discovery, on rank 0) is laid out as empty placeholders (folders, and sparse
files of each object's size and time) in a private temporary folder, which the walk (tree.py) and this source's
lookups (listdir, is_file, stat ...: the local source's) answer from. No byte of a placeholder is read: `open`
gives an `ObjectFile`, whose reads are ranged GETs pinned to the ETag listed (an object replaced since is an error,
not a mix of two checkpoints), which cannot be mapped and asks to be read ahead (`map()` None, `by_request`). The
listing travels with the scan (local.Walked): a rank on another host lays out the same placeholders at the same
path. A folder beside or above the prefix (a config folder) is listed when a format asks for its config.json.

A request costs a round trip on S3 (and, on some servers, a read of the whole object), so reads are few and
large: one GET can feed many destinations (`read_spans`: reads.Batch merges a round's fragments of an object);
bytes read at discovery are served again from memory while the file is open (`keep`: a zip's directory and
head) and, for the first and last 64 KiB of an object, for the whole merge (`ENDS`, kept by the source); and a
check that would have cost a GET of its own (a zip record's local header) waits for the read that reaches its
bytes (`expect`). Errors name the object (`s3://bucket/prefix/model_world_size_2_rank_0.pt`), not its
placeholder (`shown`, which comm.py applies to every error that crosses ranks). What is kept (listings, checks,
remembered ends) is the S3Source's: two merges keep their own.
"""

from __future__ import annotations

import atexit
import bisect
import os
import shutil
import tempfile
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from distmerge import s3_client
from distmerge.errors import CorruptInputError, InputError
from distmerge.input import source
from distmerge.input.local import LocalSource
from distmerge.input.reads import Batch
from distmerge.input.source import Expected
from distmerge.input.tree import MAX_ENTRIES, InputTree

WIDEN = 1 << 16  # a GET starts at most this much earlier to take in a header to check (Expected)
PIECE = 1 << 20  # a GET's body is handed to its destinations in pieces of this size (nothing holds it whole)


@dataclass(frozen=True, kw_only=True)
class Listing:
    """What the LIST saw: the object under each placeholder path, relative to the placeholder root."""

    url: str  # s3://bucket/prefix, as given
    bucket: str
    prefix: str
    root: str  # the placeholder root (same path on every host)
    top: str  # the private temporary folder it lies in, removed at exit by the process that made it
    objects: dict[str, tuple[int, int, str]] = field(default_factory=dict)  # rel -> (size, mtime_ns, etag)

    def key(self, rel: str) -> str:
        return f"{self.prefix}/{rel}" if self.prefix else rel

    def url_of(self, rel: str) -> str:
        return f"{s3_client.SCHEME}{self.bucket}/{self.key(rel)}"

    def source(self) -> S3Source:
        """The source a rank that did not list opens the objects by: the same placeholders, laid out here."""
        lay_out(self)
        return S3Source(self.url, self)


def listing(url: str, cap: int, top: str | None = None, one_level: bool = False) -> Listing:
    """Rank 0, at discovery: list the prefix once and lay out its placeholders. One line for a missing bucket,
    an empty prefix, denied access or more than `cap` objects."""
    loc = s3_client.parse(url, "input", InputError)
    try:
        found = s3_client.list_objects(loc, cap, one_level)
    except ImportError as err:
        raise InputError(f"input {url}: {err}") from None
    except ValueError:
        raise InputError(f"input {url} holds more than {cap:,} objects: pass the checkpoint's own prefix") from None
    except s3_client.sdk_errors() as err:
        raise InputError(f"cannot list input {url}: {s3_client.describe(err)}") from None
    if not found:
        raise InputError(f"input {url} does not exist (no object under it)")
    top = top or os.path.realpath(tempfile.mkdtemp(prefix="distmerge-input-"))
    root = os.path.join(top, loc.bucket, loc.prefix).rstrip("/")
    start = len(loc.prefix) + 1 if loc.prefix else 0
    objects = {}
    for obj in found:
        rel = obj["Key"][start:]
        if rel.endswith("/") and obj["Size"] == 0:  # a "folder" marker some tools write
            continue
        objects[_checked(url, rel)] = (int(obj["Size"]), int(obj["LastModified"].timestamp() * 1e9),
                                       str(obj.get("ETag", "")))
    made = Listing(url=url.rstrip("/"), bucket=loc.bucket, prefix=loc.prefix, root=root, top=top,
                   objects=objects)
    if not one_level:
        lay_out(made)
    return made


def _checked(url: str, rel: str) -> str:
    parts = rel.split("/")
    if not rel or any(p in ("", ".", "..") for p in parts):
        raise InputError(f"input {url} holds an object named {rel!r}, which is no file path: distmerge reads "
                         "checkpoints whose object names are file paths (as the trainers write them)")
    return rel


def lay_out(made: Listing) -> None:
    """The placeholders at `made.root`, unless this host has them already: built beside it, then renamed into
    place, so that a rank never sees half of them."""
    if os.path.isdir(made.root):
        return
    parent = os.path.dirname(made.root)
    os.makedirs(parent, exist_ok=True)
    build = tempfile.mkdtemp(prefix=".building-", dir=parent)
    try:
        for rel, (size, mtime_ns, _) in made.objects.items():
            path = os.path.join(build, rel)
            try:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                with open(path, "wb") as f:
                    f.truncate(size)  # sparse: no data, only the size formats see
                os.utime(path, ns=(mtime_ns, mtime_ns))
            except (IsADirectoryError, NotADirectoryError, FileExistsError):
                raise InputError(f"input {made.url}: {made.url_of(rel)} is both an object and a folder of "
                                 "objects: not a checkpoint distmerge can read") from None
        os.rename(build, made.root)
        atexit.register(shutil.rmtree, made.top, ignore_errors=True)
    except OSError:
        shutil.rmtree(build, ignore_errors=True)
        if not os.path.isdir(made.root):  # another rank of this host won the rename: theirs is the same
            raise


class _Checks:
    """The checks of one object not yet made in this process, sorted by `at`; their guarded ranges are disjoint."""

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


# Small reads at either end of an object are remembered by the source: discovery reads the ends of a rank file
# several times (copies.first_copy hashes 64 KiB at each end, archive_name reads the first record's name,
# zip_records the directory at the end and the pickle at the start), each a GET of its own otherwise.
ENDS = 1 << 16
ENDS_KEPT = 256  # objects whose ends are remembered (the oldest forgotten first): at most 32 MiB
CONCURRENT = 8  # small reads of several objects made at once (each a round trip): S3Source.each
CONFIG_OBJECTS = 10_000  # files a folder outside the prefix may hold to be listed as a config folder


class S3Source(LocalSource):
    """`s3://bucket/prefix`: its placeholders walked as a folder, its objects read by ranged GETs."""

    plans_ahead = True

    def __init__(self, url: str, made: Listing | None = None) -> None:
        self.url, self.listing, self.tree, self.records = url.rstrip("/"), made, None, []
        self.root = Path(made.root) if made is not None else Path(self.url)
        self.beside: list[Listing] = []  # folders outside the prefix listed since (a config folder's files)
        self._looked: set[str] = set()
        self.lock = threading.Lock()
        self.checks: dict[tuple[str, str, str], _Checks] = {}  # (bucket, key, etag) -> its checks
        self.ends: dict[tuple[str, str, str], list[tuple[int, bytes]]] = {}  # remembered ends (ENDS)

    def walk(self) -> None:
        self.listing = listing(self.url, MAX_ENTRIES)
        self.root, self.tree = Path(self.listing.root), InputTree(Path(self.listing.root))

    def _listing(self) -> Listing | None:
        return self.listing  # what the other ranks make this source again from

    def _file(self, shown: Path | str, rel: str, size: int | None, ident: tuple[int, int] | None) -> ObjectFile:
        return ObjectFile(self, self.listing, os.path.normpath(rel))

    def holds(self, path: Path | str) -> bool:
        return super().holds(path) or self._beside(os.path.abspath(path)) is not None

    def _held(self, path: Path | str) -> ObjectFile | None:
        found = super()._held(path)
        if found is not None:
            return found
        full = os.path.abspath(path)
        made = self._beside(full)
        return ObjectFile(self, made, os.path.relpath(full, made.root)) if made is not None else None

    def _beside(self, full: str) -> Listing | None:
        return next((m for m in self.beside if os.path.dirname(full) == m.root and os.path.basename(full) in
                     m.objects), None)

    def is_file(self, path: Path | str) -> bool:
        """A placeholder's; the files of a folder outside the prefix, in the same bucket (a config folder beside
        the save, or above it), are listed the first time one is asked about: one LIST of that folder's own files."""
        full = os.path.abspath(path)
        bucket_dir = os.path.join(self.listing.top, self.listing.bucket)
        folder = os.path.dirname(full)
        inside = full.startswith(self.listing.root + "/")
        if not inside and folder.startswith(bucket_dir + "/") and folder not in self._looked:
            self._looked.add(folder)
            self._list_beside(folder, bucket_dir)
        return os.path.isfile(full)

    def _list_beside(self, folder: str, bucket_dir: str) -> None:
        """Its files laid out as placeholders in place (rank 0 alone looks there: no other rank races it)."""
        url = f"{s3_client.SCHEME}{self.listing.bucket}/{os.path.relpath(folder, bucket_dir)}"
        try:
            made = listing(url, CONFIG_OBJECTS, top=self.listing.top, one_level=True)
        except InputError:  # nothing there (or more than a config folder holds): not the folder looked for
            return
        os.makedirs(folder, exist_ok=True)
        for name, (size, mtime_ns, _) in made.objects.items():
            if not os.path.lexists(path := os.path.join(folder, name)):
                with open(path, "wb") as f:
                    f.truncate(size)
                os.utime(path, ns=(mtime_ns, mtime_ns))
        self.beside.append(made)

    def batch(self, reader: Any) -> Batch:
        return Batch(reader)

    def each(self, fn: Callable[[Any], Any], items: list[Any]) -> list[Any]:
        with ThreadPoolExecutor(max_workers=CONCURRENT, thread_name_prefix="distmerge-ends",
                                initializer=source.session().bind) as pool:
            return list(pool.map(fn, items))

    def shown(self, message: str) -> str:
        for made in (self.listing, *self.beside) if self.listing is not None else ():
            if made.root in message:
                message = message.replace(made.root, made.url)
        return message

    def remember(self, ident: tuple[str, str, str], offset: int, data: bytes) -> None:
        with self.lock:
            self.ends.setdefault(ident, []).append((offset, data))
            while len(self.ends) > ENDS_KEPT:
                del self.ends[next(iter(self.ends))]


class ObjectFile:
    """An object of the input opened for reading (S3Source.open): positional reads by ranged GETs."""

    by_request = True  # reads cost a request each: callers that can ask for many ranges at once do (reads.Batch)

    def __init__(self, src: S3Source, made: Listing, rel: str) -> None:
        if rel not in made.objects:
            raise InputError(f"{made.url_of(rel)} was not listed: not an object of the input")
        self.src, self.made, self.rel = src, made, rel
        self.size, _, self.etag = made.objects[rel]
        self.ident = ("s3", made.bucket, made.key(rel))
        self.real = Path(made.root) / rel
        self.known: list[tuple[int, bytes]] = []  # regions already read while this file is open (keep)
        self._id = (made.bucket, made.key(rel), self.etag)

    def map(self) -> None:  # nothing to map: callers read the bytes they need (torch_save.mapped_views)
        return None

    def keep(self, offset: int, data: bytes) -> None:
        """Serve later reads inside [offset, offset + len(data)) from these bytes (a zip's directory, its head)
        while this file is open, instead of asking the store again."""
        self.known.append((offset, data))

    def expect(self, checks: list[Expected]) -> None:
        """Checks to make before the bytes they guard are handed out, by any read of this object in this process
        (zip_records: the records' local headers). Those whose bytes are already kept are made now."""
        made = _Checks(checks)
        with self.src.lock:
            self.src.checks[self._id] = made
        for check in checks:
            data = self._kept(check.at, check.length)
            if data is not None:
                check.check(data)
                made.done.add(check.at)

    def readinto(self, buf: memoryview, offset: int) -> int:
        """Fill buf from `offset`; short only where the object ends."""
        want = max(0, min(len(buf), self.size - offset))
        if not want:
            return 0
        data = self._kept(offset, want) if not self._due(offset, offset + want) else None
        if data is not None:  # no check waits on these bytes: those of kept regions are made when kept (expect)
            buf[:want] = data
            return want

        def put(piece: memoryview, at: int) -> None:
            buf[at : at + len(piece)] = piece

        self.read_spans(offset, offset + want, [(offset, want, put)])
        if want <= ENDS and (offset == 0 or offset + want == self.size):
            self.src.remember(self._id, offset, bytes(buf[:want]))
        return want

    def read_full(self, buf: memoryview, offset: int) -> int:
        """buf filled from `offset` by one ranged GET; fewer bytes only where the object ends."""
        return self.readinto(buf, offset)

    def copy_range(self, offset: int, nbytes: int, put: Callable[[memoryview, int], None], bounce: memoryview,
                   shown: str) -> int:
        """Bytes [offset, offset + nbytes) to `put(piece, position in the range)`: one ranged GET, in pieces."""
        self.read_spans(offset, offset + nbytes, [(offset, nbytes, put)])
        return nbytes

    def pread(self, nbytes: int, offset: int) -> bytes:
        buf = bytearray(max(0, min(nbytes, self.size - offset)))
        self.readinto(memoryview(buf), offset)
        return bytes(buf)

    def read_spans(self, start: int, end: int, spans: list[tuple[int, int, Callable[[memoryview, int], None]]]) \
            -> None:
        """One ranged GET of bytes [start, end), streamed in pieces of PIECE: each span (offset, nbytes,
        deliver) inside it, sorted by offset, gets its bytes as `deliver(piece, position in the span)` as they
        arrive (nothing the size of the GET is held). The checks `expect` left on the bytes it reaches are made
        first (the GET starts early enough to include them). One line naming the object on a failed or short
        read."""
        first = 0

        def deliver(piece: memoryview, pos: int) -> None:
            nonlocal first
            stop = pos + len(piece)
            while first < len(spans) and spans[first][0] + spans[first][1] <= pos:
                first += 1
            for offset, nbytes, put in spans[first:]:
                if offset >= stop:
                    break
                lo, hi = max(offset, pos), min(offset + nbytes, stop)
                if lo < hi:
                    put(piece[lo - pos : hi - pos], lo - offset)

        try:
            done = self._stream(start, end, deliver)
        except s3_client.sdk_errors() as err:
            raise CorruptInputError(f"cannot read {self.made.url_of(self.rel)}: {s3_client.describe(err)}") from None
        if done < end:
            raise CorruptInputError(f"{self.made.url_of(self.rel)} ended at byte {done:,}, listed with "
                                    f"{self.size:,}: a short read (the object changed, or the store cut it short)")

    def _stream(self, start: int, end: int, deliver: Callable[[memoryview, int], None]) -> int:
        """GET [start, end), widened to the checks due there (a header further than WIDEN before `start`, which a
        read from the middle of a large record reaches, is read alone instead); returns where the bytes stopped
        (end, or the object's end if it is shorter than listed)."""
        with self.src.lock:
            checks = self.src.checks.get(self._id)
            due = checks.due(start, end) if checks is not None else []
        for c in [c for c in due if c.at + c.length < start - WIDEN]:
            c.check(b"".join(s3_client.stream_range(self.made.bucket, self.made.key(self.rel), c.at, c.length,
                                                    self.etag)))
            checks.done.add(c.at)
            due.remove(c)
        lo = min([start, *(c.at for c in due)])
        hi = max([end, *(c.at + c.length for c in due)])
        pos, k, held = lo, 0, bytearray()
        for data in s3_client.stream_range(self.made.bucket, self.made.key(self.rel), lo, hi - lo, self.etag, PIECE):
            view, stop = memoryview(data), pos + len(data)
            while k < len(due) and due[k].at < stop:  # header bytes before the data they guard: checked first
                c = due[k]
                held += view[max(c.at, pos) - pos : min(c.at + c.length, stop) - pos]
                if len(held) < c.length:
                    break
                c.check(bytes(held))
                checks.done.add(c.at)
                k, held = k + 1, bytearray()
            a, b = max(pos, start), min(stop, end)
            if a < b:
                deliver(view[a - pos : b - pos], a)
            pos = stop
        if k < len(due):  # the object ended inside a header
            due[k].check(bytes(held))
        return min(pos, end)

    def _due(self, start: int, end: int) -> list[Expected]:
        with self.src.lock:
            checks = self.src.checks.get(self._id)
            return checks.due(start, end) if checks is not None else []

    def _kept(self, offset: int, nbytes: int) -> bytes | None:
        for at, data in (*self.known, *self.src.ends.get(self._id, ())):
            if at <= offset and offset + nbytes <= at + len(data):
                return data[offset - at : offset - at + nbytes]
        return None

    def close(self) -> None:
        self.known = []

    def __enter__(self) -> ObjectFile:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

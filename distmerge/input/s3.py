"""An input in an object store (`--input s3://bucket/prefix`) as a Source (source.py): listed once, read by ranged
GETs. This file and its line in source.SCHEMES are all a new input store takes.

The listing (one paginated LIST, at discovery, on rank 0) is held in memory (listed.Listed), and the formats'
lookups (listdir, is_file, stat, resolve, folder ...) answered from it, by paths under a root no file system holds
(nothing is laid out on disk). `open` gives an `ObjectFile`, whose reads are ranged GETs pinned to the ETag listed
(an object replaced since is an error, not a mix of two checkpoints), which cannot be mapped and asks to be read
ahead (`map()` None, `by_request`). The listing travels with the scan (local.Walked): every rank answers from it,
by the same paths. A folder beside or above the prefix (a config folder) is listed when a format asks for its
config.json, and is a folder of this source from then on.

A request costs a round trip on S3 (and, on some servers, a read of the whole object), so reads are few and
large: one GET can feed many destinations (`read_spans`: reads.Batch merges a round's fragments of an object);
bytes read at discovery are served again from memory while the file is open (`keep`: a zip's directory and
head) and, for the first and last 64 KiB of an object, for the whole merge (`ENDS`, kept by the source); and a
check that would have cost a GET of its own (a zip record's local header) waits for the read that reaches its
bytes (`expect`). Errors name the object (`s3://bucket/prefix/model_world_size_2_rank_0.pt`), not its path here
(`shown`, applied by comm.py to every error that crosses ranks). What is kept (listings, checks, remembered ends)
is the S3Source's: two merges keep their own.
"""

from __future__ import annotations

import os
import secrets
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
from distmerge.input.listed import Listed
from distmerge.input.local import LocalSource, Walked
from distmerge.input.reads import Batch
from distmerge.input.source import Checks, Expected
from distmerge.input.tree import MAX_ENTRIES, host_id

WIDEN = 1 << 16  # a GET starts at most this much earlier to take in a header to check (Expected)
PIECE = 1 << 20  # a GET's body is handed to its destinations in pieces of this size (nothing holds it whole)


@dataclass(frozen=True, kw_only=True)
class Listing:
    """What the LIST saw: the object under each name, relative to the root path it is looked up by."""

    url: str  # s3://bucket/prefix, as given
    bucket: str
    prefix: str
    root: str  # top/bucket/prefix: the path formats name the objects by (same on every host; never on disk)
    top: str  # a folder no file system holds, this listing's own: every path under it is answered from memory
    objects: dict[str, tuple[int, int, str]] = field(default_factory=dict)  # rel -> (size, mtime_ns, etag)

    def key(self, rel: str) -> str:
        return f"{self.prefix}/{rel}" if self.prefix else rel

    def url_of(self, rel: str) -> str:
        return f"{s3_client.SCHEME}{self.bucket}/{self.key(rel)}"

    def source(self) -> S3Source:
        """The source a rank that did not list opens the objects by: the same listing, the same paths."""
        return S3Source(self.url, self)


def listing(url: str, cap: int, top: str | None = None, one_level: bool = False) -> Listing:
    """Rank 0, at discovery: list the prefix once. One line for a missing bucket, an empty prefix, denied access or
    more than `cap` objects."""
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
    top = top or os.path.join(tempfile.gettempdir(), f"distmerge-input-{secrets.token_hex(8)}")  # never made
    root = os.path.join(top, loc.bucket, loc.prefix).rstrip("/")
    start = len(loc.prefix) + 1 if loc.prefix else 0
    objects = {}
    for obj in found:
        rel = obj["Key"][start:]
        if rel.endswith("/") and obj["Size"] == 0:  # a "folder" marker some tools write
            continue
        objects[_checked(url, rel)] = (int(obj["Size"]), int(obj["LastModified"].timestamp() * 1e9),
                                       str(obj.get("ETag", "")))
    return Listing(url=url.rstrip("/"), bucket=loc.bucket, prefix=loc.prefix, root=root, top=top, objects=objects)


def _checked(url: str, rel: str) -> str:
    parts = rel.split("/")
    if not rel or any(p in ("", ".", "..") for p in parts):
        raise InputError(f"input {url} holds an object named {rel!r}, which is no file path: distmerge reads "
                         "checkpoints whose object names are file paths (as the trainers write them)")
    return rel


# Small reads at either end of an object are remembered by the source: discovery reads a rank file's ends several
# times (copies.first_copy hashes 64 KiB at each, archive_name the first record's name, zip_records the directory).
ENDS = 1 << 16
ENDS_KEPT = 256  # objects whose ends are remembered (the oldest forgotten first): at most 32 MiB
CONCURRENT = 8  # small reads of several objects made at once (each a round trip): S3Source.each
CONFIG_OBJECTS = 10_000  # files a folder outside the prefix may hold to be listed as a config folder


class S3Source(LocalSource):
    """`s3://bucket/prefix`: its listing looked up in memory, its objects read by ranged GETs. Paths outside the
    listing's `top` (a folder the user named) are the local source's."""

    plans_ahead = True

    def __init__(self, url: str, made: Listing | None = None) -> None:
        self.url, self.listing, self.tree, self.records = url.rstrip("/"), None, None, []
        self.root = Path(self.url)
        self.names: Listed | None = None
        self.beside: list[Listing] = []  # folders outside the prefix listed since (a config folder's files)
        self._looked: set[str] = set()
        self.lock = threading.Lock()
        self.checks: dict[tuple[str, str, str], Checks] = {}  # (bucket, key, etag) -> its checks
        self.ends: dict[tuple[str, str, str], list[tuple[int, bytes]]] = {}  # remembered ends (ENDS)
        if made is not None:
            self._use(made)

    def _use(self, made: Listing) -> None:
        self.listing, self.root, self.names = made, Path(made.root), Listed(made.top)
        both = self.names.add(made.root, ((rel, size, mtime) for rel, (size, mtime, _) in made.objects.items()))
        if both is not None:
            raise InputError(f"input {made.url}: {made.url_of(os.path.relpath(both, made.root))} is both an object "
                             "and a folder of objects: not a checkpoint distmerge can read")

    def walk(self) -> None:
        self._use(listing(self.url, MAX_ENTRIES))
        self.tree = self.listing  # what the walk saw, on the process that made it

    # -- what the formats ask (rank 0), answered from the listing -------------------------------------------------
    def _mine(self, path: Path | str) -> str | None:
        """`path` as the listing's to answer (under its top), or None: a folder the user named, on disk."""
        full = os.path.abspath(path)
        return full if self.names is not None and self.names.holds(full) else None

    def _ask(self, name: str, path: Path | str, *args: Any) -> Any:
        """A lookup answered from the listing under its top; elsewhere (a folder the user named) the local one."""
        full = self._mine(path)
        return getattr(LocalSource, name)(self, path, *args) if full is None else getattr(self.names, name)(full)

    def listdir(self, folder: Path | str) -> list[str]:
        return self._ask("listdir", folder)

    def is_file(self, path: Path | str) -> bool:
        """A listed object; the files of a folder outside the prefix, in the same bucket (a config folder beside
        the save, or above it), are listed the first time one is asked about: one LIST of that folder's own files."""
        if (full := self._mine(path)) is not None:
            self._look_beside(os.path.dirname(full))
        return self._ask("is_file", path)

    def is_dir(self, path: Path | str) -> bool:
        return self._ask("is_dir", path)

    def exists(self, path: Path | str) -> bool:
        return self._ask("exists", path)

    def stat(self, path: Path | str, follow: bool = True) -> source.Stat:
        return self._ask("stat", path, follow)

    def resolve(self, path: Path | str) -> tuple[Path, str]:
        full = os.path.abspath(path)  # a bucket has no links: a path inside leads where it says
        return Path(full), "" if self._inside(full) is not None else "outside the input"

    def folder(self, path: Path | str) -> Path:
        """A folder of the listing, or a config folder listed beside it (is_file)."""
        full = os.path.abspath(path)
        if (self._inside(full) is None and full not in (m.root for m in self.beside)) or not self.names.is_dir(full):
            raise InputError(f"{path} is not a folder of the input (missing, or outside it): distmerge does not open "
                             "it")
        return Path(full)

    def _inside(self, full: str) -> str | None:
        """The name of `full` within the prefix ("": the prefix itself), or None."""
        root = str(self.root)
        return "" if full == root else full[len(root) + 1:] if full.startswith(root + "/") else None

    def _look_beside(self, folder: str) -> None:
        """A folder of the bucket outside the prefix, listed once: its own files (rank 0 alone looks there)."""
        made = self.listing
        bucket_dir = os.path.join(made.top, made.bucket)
        if self._inside(folder) is not None or not folder.startswith(bucket_dir + "/") or folder in self._looked:
            return
        self._looked.add(folder)
        url = f"{s3_client.SCHEME}{made.bucket}/{os.path.relpath(folder, bucket_dir)}"
        try:
            near = listing(url, CONFIG_OBJECTS, top=made.top, one_level=True)
        except InputError:  # nothing there (or more than a config folder holds): not the folder looked for
            return
        new = [(n, size, mtime) for n, (size, mtime, _) in near.objects.items()
               if not self.names.is_dir(os.path.join(folder, n))]  # a folder of the listing stays one
        self.names.add(folder, new)
        self.beside.append(near)

    def record(self, folder: Path | str, paths: Any) -> Walked:
        walked = Walked(root=str(self.root), host=host_id(), listing=self.listing)
        for path in paths:
            full = os.path.abspath(path)
            rel = self._inside(full)
            if rel not in self.listing.objects:
                raise InputError(f"{path} is not a regular file of the input (missing, or changed since distmerge "
                                 "listed the folder)")
            walked.files[full] = (rel, self.listing.objects[rel][0], 0, 0)
        return walked

    # -- every rank: the objects by their listing ---------------------------------------------------------------
    def holds(self, path: Path | str) -> bool:
        full = os.path.abspath(path)
        return self.listing is not None and (self._inside(full) is not None or any(
            full == m.root or os.path.dirname(full) == m.root for m in self.beside))

    def _held(self, path: Path | str) -> ObjectFile | None:
        full = os.path.abspath(path)
        rel = self._inside(full) if self.listing is not None else None
        if rel is not None:
            return ObjectFile(self, self.listing, os.path.normpath(rel))
        made = next((m for m in self.beside if os.path.dirname(full) == m.root), None)
        return ObjectFile(self, made, os.path.basename(full)) if made is not None else None

    # -- the read policy ---------------------------------------------------------------------------------------
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
        made = Checks(checks)
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

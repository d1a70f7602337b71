"""An input in an object store (`--input s3://bucket/prefix`): listed once, read by ranged GETs.

The listing (one paginated LIST, at discovery, on rank 0) is laid out as a tree of empty placeholders: folders,
and sparse files of each object's size and time, in a private temporary folder. Every format detects, lists and
sizes the checkpoint there exactly as it does a folder (input_tree walks it; no format knows the difference),
and no byte of it is ever read: input_tree.open_input hands out an `ObjectFile` for each placeholder, whose reads
are ranged GETs of exactly the bytes asked for, pinned to the ETag the listing saw (an object replaced since is
an error, not a mix of two checkpoints). The listing travels to every rank with the scan (input_tree.Walked), and
a rank on another host lays out the same placeholders at the same path before it opens anything.

Errors name the object (`s3://bucket/prefix/model_world_size_2_rank_0.pt`), not its placeholder: `shown`
rewrites any message that names a placeholder (comm.py applies it to every error that crosses ranks).
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from distmerge import s3_client
from distmerge.errors import CorruptInputError, InputError

PIECE = 1 << 20  # a fragment streamed into an output file arrives in pieces of this size (reader.copy_to)


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


_LISTINGS: dict[str, Listing] = {}  # placeholder root -> its listing, in this process


def is_url(location: object) -> bool:
    return isinstance(location, str) and "://" in location


def listing(url: str, cap: int) -> Listing:
    """Rank 0, at discovery: list the prefix once and lay out its placeholders. One line for a missing bucket,
    an empty prefix, denied access or more than `cap` objects."""
    loc = s3_client.parse(url, "input", InputError)
    try:
        found = s3_client.list_objects(loc, cap)
    except ImportError as err:
        raise InputError(f"input {url}: {err}") from None
    except ValueError:
        raise InputError(f"input {url} holds more than {cap:,} objects: pass the checkpoint's own prefix") from None
    except s3_client.sdk_errors() as err:
        raise InputError(f"cannot list input {url}: {s3_client.describe(err)}") from None
    if not found:
        raise InputError(f"input {url} does not exist (no object under it)")
    top = os.path.realpath(tempfile.mkdtemp(prefix="distmerge-input-"))
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
    _LISTINGS[made.root] = made
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


def source_of(path: str) -> tuple[Listing, str] | None:
    """The listing a placeholder path belongs to, and its path inside it (None: not a placeholder)."""
    for root, made in _LISTINGS.items():
        if path == root or path.startswith(root + "/"):
            return made, os.path.relpath(path, root)
    return None


def shown(message: str) -> str:
    """A message with every placeholder path written as the object's URL."""
    for root, made in _LISTINGS.items():
        if root in message:
            message = message.replace(root, made.url)
    return message


class ObjectFile:
    """An object of the input opened for reading (input_tree.open_input): positional reads by ranged GETs."""

    fd = -1  # no descriptor: nothing can map it (torch_save.mapped_views reads the views' bytes instead)

    def __init__(self, made: Listing, rel: str) -> None:
        if rel not in made.objects:
            raise InputError(f"{made.url_of(rel)} was not listed: not an object of the input")
        self.made, self.rel = made, rel
        self.size, _, self.etag = made.objects[rel]
        self.ident = ("s3", made.bucket, made.key(rel))
        self.real = Path(made.root) / rel

    def readinto(self, buf: memoryview, offset: int) -> int:
        """Fill buf from `offset`; short only where the object ends."""
        want = max(0, min(len(buf), self.size - offset))
        if not want:
            return 0
        try:
            got = s3_client.read_range(self.made.bucket, self.made.key(self.rel), offset, buf[:want], self.etag)
        except s3_client.sdk_errors() as err:
            raise CorruptInputError(f"cannot read {self.made.url_of(self.rel)}: {s3_client.describe(err)}") from None
        if got < want:
            raise CorruptInputError(f"{self.made.url_of(self.rel)} ended at byte {offset + got:,}, listed with "
                                    f"{self.size:,}: a short read (the object changed, or the store cut it short)")
        return got

    def pread(self, nbytes: int, offset: int) -> bytes:
        buf = bytearray(max(0, min(nbytes, self.size - offset)))
        self.readinto(memoryview(buf), offset)
        return bytes(buf)

    def pieces(self, offset: int, nbytes: int) -> Iterator[bytes]:
        """Bytes [offset, offset + nbytes) from one ranged GET in pieces of PIECE, for streaming into an output."""
        done = 0
        try:
            for data in s3_client.stream_range(self.made.bucket, self.made.key(self.rel), offset, nbytes, self.etag,
                                               PIECE):
                done += len(data)
                yield data
        except s3_client.sdk_errors() as err:
            raise CorruptInputError(f"cannot read {self.made.url_of(self.rel)}: {s3_client.describe(err)}") from None
        if done < nbytes:
            raise CorruptInputError(f"{self.made.url_of(self.rel)} ended at byte {offset + done:,}, listed with "
                                    f"{self.size:,}: a short read (the object changed, or the store cut it short)")

    def close(self) -> None:
        pass

    def __enter__(self) -> ObjectFile:
        return self

    def __exit__(self, *_exc: object) -> None:
        pass

"""The input folder, resolved once: which paths under it may be opened, and the one way small files are read.

Checkpoints come from shared storage, other teams and the internet (docs/reliability.md, "Threat model").
So the folder is walked once, at discovery, with `lstat` only: every entry is recorded as a regular file,
a folder, a link that stays inside (recorded as the entry it leads to), or refused (a link that leads
out of the input, a FIFO, a device, a socket). Later lookups go through that record, never through the
file system's own resolution, so a linked `iter_N/` or `huggingface/` cannot move the anchor the
inside-check resolves against. Every later open of an input file goes through `open_input`: each folder on
the way and the file itself are opened with O_NOFOLLOW from the walked root (so a file or folder swapped
for a link after the walk is refused, never followed), the file with O_NONBLOCK (a FIFO cannot block),
then fstat must show a regular file of the recorded size and, on the host that walked, the recorded device
and inode. The walk's record of the listed files travels with the scan (`Walked`), so ranks other than
0 check the same things. Small files (configs, trackers, markers) are read through `read_small`, which
never reads past its cap.
"""

from __future__ import annotations

import errno
import json
import mmap
import os
import socket
import stat
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from distmerge.errors import CorruptInputError, InputError
from distmerge.input import source

MAX_ENTRIES = 1_000_000  # entries walked under one input folder; a checkpoint folder has far fewer
# Size caps for the small files distmerge reads whole (a real one is far below each).
TRACKER_CAP = 4 * 1024  # Megatron's latest_checkpointed_iteration.txt, DeepSpeed's `latest`
MARKER_CAP = 1024 * 1024  # fsdp_config.json, lora_train_meta.json, torch_dist's metadata.json
CONFIG_CAP = 16 * 1024 * 1024  # config.json and the other JSON files of the config folder
COPY_CAP = 1024 * 1024 * 1024  # one file copied into the output (tokenizer model, custom code)
JSON_DEPTH = 100  # nesting a config may have; deeper JSON is refused before Python's recursion limit


@dataclass(frozen=True)
class Entry:
    kind: str  # "file", "dir", "refused"
    dev: int = 0
    ino: int = 0
    size: int = 0
    why: str = ""  # for "refused": what it is ("a link to /x", "a FIFO")
    mtime_ns: int = 0  # what another node's lookups of this entry answer (input/nodes.py)


class InputTree:
    """Every entry under `root`, by path relative to it (links inside recorded as their targets)."""

    def __init__(self, root: Path) -> None:
        self.root = Path(os.path.realpath(root))
        self.given = Path(os.path.abspath(root))  # the name it was passed by, when the folder itself is a link
        self.entries: dict[str, Entry] = {"": _entry_of(os.lstat(self.root))}
        self._links: dict[str, str] = {}  # link's relative path -> its target's
        self._walk()

    def _walk(self) -> None:
        stack = [""]
        while stack:
            rel = stack.pop()
            try:
                listing = list(os.scandir(self.root / rel))
            except OSError as err:
                raise InputError(f"{self.root / rel} cannot be listed ({err.strerror})") from None
            for item in listing:
                if len(self.entries) >= MAX_ENTRIES:
                    raise InputError(f"{self.root} holds more than {MAX_ENTRIES:,} files and folders: pass the "
                                     "checkpoint's own folder")
                path = f"{rel}/{item.name}" if rel else item.name
                st = item.stat(follow_symlinks=False)
                if stat.S_ISLNK(st.st_mode):
                    self._link(path, item.path)
                    continue
                self.entries[path] = _entry_of(st)
                if stat.S_ISDIR(st.st_mode):
                    stack.append(path)

    def _link(self, path: str, full: str) -> None:
        try:
            target = os.path.realpath(full, strict=True)
        except OSError as err:
            if err.errno == errno.ELOOP:  # a.pt -> b.pt -> a.pt: refused here, not an OSError at the first stat
                self.entries[path] = Entry(kind="refused", why="a link loop: it leads back to itself")
                return
            target = os.path.realpath(full)  # a dangling link: missing, as the file it names
        rel = os.path.relpath(target, self.root)
        if rel == "." or not _leaves(rel):
            self._links[path] = "" if rel == "." else rel
            return
        self.entries[path] = Entry(kind="refused", why=f"a link to {target}, outside the input")

    def lookup(self, path: Path | str) -> tuple[str, Entry | None]:
        """The record of root/path, following only links that stay inside. Returns (relative path, entry)."""
        full = os.path.abspath(self.root / path)
        rel = os.path.relpath(full, self.given if Path(full).is_relative_to(self.given) else self.root)
        if rel == ".":
            return "", self.entries[""]
        if _leaves(rel):
            return rel, Entry(kind="refused", why="outside the input")
        cur = ""
        for part in rel.split(os.sep):
            cur = f"{cur}/{part}" if cur else part
            for _ in range(64):  # a link to a link inside: a few hops at most
                if cur not in self._links:
                    break
                cur = self._links[cur]
            entry = self.entries.get(cur)
            if entry is None or entry.kind == "refused":
                return cur, entry
        return cur, self.entries.get(cur)

    def _checked(self, path: Path | str, kind: str) -> tuple[Path, Entry]:
        rel, entry = self.lookup(path)
        shown = self.root / path
        if entry is not None and entry.kind == "refused":
            raise InputError(f"{shown} leads outside the input folder or is not a plain file or folder "
                             f"({entry.why or rel}); distmerge does not open it")
        if entry is None or entry.kind != kind:
            what = "file" if kind == "file" else "folder"
            raise InputError(f"{shown} is not a regular {what} of the input (missing, or changed since distmerge "
                             "listed the folder)")
        return self.root / rel, entry

    def file(self, path: Path | str) -> Path:
        """The real path of a regular file inside the input, or InputError."""
        return self._checked(path, "file")[0]

    def folder(self, path: Path | str) -> Path:
        return self._checked(path, "dir")[0]

    def contains(self, full: str) -> bool:
        """Whether an absolute path lies in this tree (lexically, by either name of its root)."""
        return any(full == str(r) or full.startswith(str(r) + "/") for r in (self.root, self.given))


def _leaves(rel: str) -> bool:
    """A relative path (from os.path.relpath) that climbs out of its base (`..foo` is a name inside)."""
    return rel == ".." or rel.startswith("../") or os.path.isabs(rel)


def _entry_of(st: os.stat_result) -> Entry:
    if stat.S_ISREG(st.st_mode):
        return Entry(kind="file", dev=st.st_dev, ino=st.st_ino, size=st.st_size, mtime_ns=st.st_mtime_ns)
    if stat.S_ISDIR(st.st_mode):
        return Entry(kind="dir", dev=st.st_dev, ino=st.st_ino, mtime_ns=st.st_mtime_ns)
    return Entry(kind="refused", why=_special(st.st_mode))


def _special(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def host_id() -> str:
    """This machine (and boot): where device and inode numbers mean the same file."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read(64).strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def node_key() -> str:
    """This process's node: its machine (and boot) and mount namespace, which together decide what a path shows
    (input/nodes.py: two torchrun agents on one machine, each in a mount namespace of its own, are two nodes)."""
    try:
        namespace = os.stat("/proc/self/ns/mnt").st_ino
    except OSError:
        namespace = 0
    return f"{host_id()}/mnt:{namespace}"


# -- opening: through the record, never by a path the file system resolves --------------------------------
class Opened:
    """An input file opened for reading (source.InFile): positional reads on its descriptor, which can be mapped."""

    by_request = False  # a read is a system call: callers read what they need when they need it

    def __init__(self, fd: int, real: Path) -> None:
        st = os.fstat(fd)
        self.fd, self.real, self.size, self.ident = fd, real, st.st_size, (st.st_dev, st.st_ino)

    def map(self) -> mmap.mmap:
        """Private and writable (torch.frombuffer wants a writable buffer); the file is never written."""
        return mmap.mmap(self.fd, 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)

    def pread(self, nbytes: int, offset: int) -> bytes:
        return os.pread(self.fd, nbytes, offset)

    def readinto(self, buf: memoryview, offset: int) -> int:
        return os.preadv(self.fd, [buf], offset)  # bytes into buf from `offset`; may be short (the caller reads on)

    def read_full(self, buf: memoryview, offset: int) -> int:
        """buf filled from `offset`; fewer bytes only where the file ends (returns how many)."""
        done = 0
        while done < len(buf):
            got = os.preadv(self.fd, [buf[done:]], offset + done)
            if got == 0:
                break
            done += got
        return done

    def copy_range(self, offset: int, nbytes: int, put: Callable[[memoryview, int], None], bounce: memoryview,
                   shown: str) -> int:
        """Bytes [offset, offset + nbytes) to `put(piece, position in the range)` through the reused `bounce`
        buffer; returns how many (fewer where the file ends). A read failure is one line naming `shown`; put's own
        failures (a full disk) pass through."""
        def read(buf: memoryview, at: int) -> int:
            try:
                return os.preadv(self.fd, [buf], at)
            except OSError as err:
                raise CorruptInputError(f"cannot read {shown}: {err.strerror}") from None

        return copy_through(read, offset, nbytes, put, bounce)

    def close(self, *_exc: object) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> Opened:
        return self

    __exit__ = close


def copy_through(read: Callable[[memoryview, int], int], offset: int, nbytes: int,
                 put: Callable[[memoryview, int], None], bounce: memoryview) -> int:
    """Bytes [offset, offset + nbytes) of a file, `read(buf, at)` a piece at a time into the reused `bounce`, each
    piece handed to `put(piece, position in the range)`; returns how many (fewer where the file ends)."""
    done = 0
    while done < nbytes:
        got = read(bounce[: min(len(bounce), nbytes - done)], offset + done)
        if got == 0:
            break
        put(bounce[:got], done)
        done += got
    return done


def readable(f: Any) -> Any:
    """An opened input file as open_input gives it; a bare descriptor is wrapped (borrowed: never closed here)."""
    return Opened(f, Path(f"/dev/fd/{f}")) if isinstance(f, int) else f


def open_input(path: Path | str) -> Any:
    """A file of the input opened for reading, through the source of this merge that holds it (source.py: checked
    against the walk or its record, as the module docstring says; an object of an object-store input); outside
    any input (--hf-config, --base-model: the user's own folders) any regular file its path leads to. One line
    when the file is not the one listed."""
    return source.of(path).open(path)


def open_any(path: Path | str) -> Opened:
    """A regular file no walk lists (a folder the user named), opened with no link on the way from its folder."""
    real = Path(os.path.realpath(path))
    if not real.is_file():
        raise InputError(f"{path} is not a regular file")
    return Opened(open_beneath(path, real.parent, real.name, None, None), real)


_FOLDER = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # O_NONBLOCK: opening a FIFO returns at once


def open_beneath(shown: Path | str, root: Path, rel: str, size: int | None, ident: tuple[int, int] | None) -> int:
    """root/rel opened one component at a time, none followed if it is a link; then fstat: a regular file,
    of `size` and device and inode `ident` when given."""
    parts = [p for p in rel.split(os.sep) if p not in ("", ".")]
    if not parts or ".." in parts:
        raise InputError(f"{shown} is not a file inside the input folder")
    try:
        at = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)  # the root was resolved when walked
    except OSError as err:
        raise InputError(f"{shown} cannot be opened ({err.strerror}): its folder {root} is gone") from None
    try:
        for part in parts[:-1]:
            at, previous = os.open(part, _FOLDER, dir_fd=at), at
            os.close(previous)
        fd = os.open(parts[-1], _FILE, dir_fd=at)
    except OSError as err:
        raise InputError(f"{shown} cannot be opened ({err.strerror}): distmerge opens only the regular files and "
                         "folders it listed, never a link put in their place; merge a checkpoint nothing else is "
                         "writing") from None
    finally:
        os.close(at)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or (size is not None and st.st_size != size) or (
            ident is not None and (st.st_dev, st.st_ino) != ident):
        os.close(fd)
        now = "a regular file" if stat.S_ISREG(st.st_mode) else _special(st.st_mode)
        listed = "" if size is None else f", listed with {size:,}"
        raise InputError(f"{shown} is not the regular file distmerge listed (now {now} of {st.st_size:,} bytes"
                         f"{listed}): it changed after the input was listed; merge a checkpoint nothing else is "
                         "writing")
    return fd


Opener = Callable[[Path | str], Any]  # a source's open: path -> source.InFile


def read_small(path: Path, cap: int, what: str, opener: Opener = open_input) -> bytes:
    """The whole of a small file, refused (one line) when it is bigger than `cap`; opened by `opener` (its
    source's open)."""
    with opener(path) as f:
        size, chunks, got = f.size, [], 0
        while size <= cap and got <= cap:
            data = f.pread(min(1 << 20, cap + 1 - got), got)
            if not data:
                break
            chunks.append(data)
            got += len(data)
    if size > cap or got > cap:
        raise InputError(f"{path} is larger than a {what} can be ({max(size, got):,} bytes, limit {cap:,}): "
                         "not the file distmerge expects; fix or remove it")
    return b"".join(chunks)


def read_text(path: Path, cap: int, what: str, opener: Opener = open_input) -> str:
    try:
        return read_small(path, cap, what, opener).decode("utf-8")
    except UnicodeDecodeError:
        raise InputError(f"{path} is not UTF-8 text: not a {what}; fix or remove it") from None


def read_json(path: Path, cap: int, what: str, opener: Opener = open_input):
    """JSON of bounded size and nesting (a deeply nested file would exhaust Python's recursion)."""
    text = read_text(path, cap, what, opener)
    depth = deepest = 0
    for ch in text:  # brackets inside strings count too: the bound only has to be safe, not exact
        if ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    if deepest > JSON_DEPTH:
        raise InputError(f"{path} nests {deepest} levels deep (a {what} needs far fewer, limit {JSON_DEPTH}): "
                         "fix or remove it")
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as err:
        raise InputError(f"{path} is not valid JSON ({str(err)[:120]}): fix or remove it") from None


def read_chunks(src: Path, cap: int = COPY_CAP, opener: Opener = open_input) -> Iterator[bytes]:
    """One file of the config folder, for the output (tokenizer model, custom code), in 1 MiB pieces: a regular
    file of bounded size, read from the file that was checked (never reopened by name); opened by `opener` (its
    source's open)."""
    with opener(src) as f:
        if f.size > cap:
            raise InputError(f"{src} is larger than distmerge copies ({cap:,} bytes): copy it yourself")
        copied = 0
        while data := f.pread(1 << 20, copied):
            copied += len(data)
            if copied > cap:
                raise InputError(f"{src} grew past {cap:,} bytes while being copied")
            yield data

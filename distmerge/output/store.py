"""The output store: everything a merge writes goes through one `Store`, so that where the output lives (a local
or shared POSIX folder, an S3-compatible bucket) is one object the engine is handed, never a question it asks.

Two stores exist: `local.LocalStore` (a folder: pwrite, early writeback, fsync, rename) and `s3.ObjectStore`
(`s3://bucket/prefix`: one multipart upload per output file). `open_store` (output/__init__.py) picks one by the
output's name. A new store is one module implementing this protocol, every method of its four roles (PlaceChecks,
Locking, Writing, ResumeReads, below; docs/extending.md): a Store object handed in is checked whole.

Call order (as torch.distributed.checkpoint's StorageWriter documents its own). Every rank makes the same
collectives; "owner" is plan.OutputFile.owner, "writers" the ranks that write a file's units:

    phase     who            call                                  what the store does
    discover  rank 0         check_place(input)                    refuse an output inside the input, creating
                                                                   nothing
              rank 0         lock() -> LockFile                    the output's lock (lock.py), taken before
                                                                   anything else is written, held to the exit
              rank 0         check(input, overwrite)               refuse an output holding work (the lock
                                                                   aside) without --overwrite / --resume
              rank 0         prepare(keep_finished)                remove the index and half-written files (and,
                                                                   without --resume, earlier model files, records)
    plan      every rank     host()                                ranks with equal answers may write one file,
                             sharing                               if `sharing` allows (spread.py asks it)
    resume    owners         size, read_range, read, sha256        check the finished files they own
              rank 0         read, remove, write_small             the decision: index gone, records rewritten
    shared    owners         create(layout, rank) -> OutFile       each file several ranks write, at its planned
                                                                   size, before any other writer joins it
              (all_gather of each created file's `token`)
              other writers  join(layout, rank, token) -> OutFile  in the round that first needs it
    rounds    writers        create (a file one rank writes), then
                             file.pwrite(buf, offset)              any order, any size, each byte once
                             file.finish() -> receipt              when all of this rank's bytes are in: durable
              owner          file.commit([receipts])               a file one rank wrote: durable, then visible
                                                                   under its final name
    commit    (all_gather of the receipts, only if `sharing.receipts` and the plan has shared files)
              owners         file.commit(receipts of every writer) shared files, after the last round
              owners         write_small(record)                   resume.py's completion record
    finalize  rank 0         write_small, put_stream, list, remove config, tokenizer, manifest; last the index,
                                                                   once the lock is found still its own
    exit      rank 0         LockFile.release()                    on every path: success, failure, SIGTERM
    failure   every rank     file.abort()                          nothing of the file is visible, ever

Names are relative to the output, with '/' (`lora_adapter/adapter_model.safetensors`). `write_small` is atomic:
the object is whole or absent after a crash. Errors are OutputError, one line naming the file or object.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from distmerge.errors import OutputError
from distmerge.output.lock import LockFile


@dataclass(frozen=True, kw_only=True)
class Sharing:
    """Whether several processes may write one output file, as a store declares it (spread.py asks)."""

    within: str  # "host": ranks whose host() agree (one page cache); "any": any ranks; "none": never
    min_run: int = 0  # each writer's run of consecutive bytes is at least this long, but the file's last (S3 parts)
    receipts: bool = False  # the owner's commit needs every writer's receipt (an all_gather after the last round)


@dataclass(frozen=True, kw_only=True)
class FileLayout:
    """One output file as the plan made it: what a store needs to create or join it."""

    name: str  # relative to the output
    header: bytes  # the safetensors header: the file's first bytes, known before any data
    size: int  # header + data
    runs: tuple[tuple[int, int, int], ...]  # (start, end, writer rank) in file order, the header in the first
    shared: bool = False  # several ranks write it (plan.OutputFile.shared)


class OutFile(Protocol):
    """One output file being written by this rank (its part of it, when shared)."""

    token: Any  # what the other writers of a shared file join it with (picklable; None when nothing)

    def pwrite(self, buf: memoryview, offset: int) -> None:
        """Bytes at their place in the file; the buffer may be reused as soon as this returns."""

    def finish(self) -> Any:
        """All of this rank's bytes are in: make them durable. Returns a receipt for the commit (picklable)."""

    def commit(self, receipts: list[Any]) -> None:
        """Owner: the file, every writer's part durable, becomes visible under its final name."""

    def abort(self) -> None:
        """Drop the file: nothing of it is visible. Safe to call twice, and after finish."""


# The store's methods by role: what each phase of the call order above asks of it. A plug-in implements every
# role (Store); a Store object handed to the API is checked whole before anything starts (missing_members).


class PlaceChecks(Protocol):
    """Rank 0, before anything is written: is the output a place this merge may write, and made ready for it."""

    def check_place(self, input_root: str) -> None:
        """Refuse an output inside the input, creating nothing."""

    def check(self, input_root: str, overwrite: bool, *, resumable: bool = True) -> None:
        """Refuse an output holding work (the lock aside) without --overwrite / --resume (not_empty)."""

    def prepare(self, keep_finished: bool) -> None:
        """Remove the index and half-written files (and, unless `keep_finished`, earlier model files)."""


class Locking(Protocol):
    """Rank 0: the output's lock (lock.py), taken before anything else is written and held to the exit."""

    def lock(self) -> LockFile: ...


class Writing(Protocol):
    """Every writer: the model files, at their planned places, and the small files around them."""

    sharing: Sharing

    def host(self) -> str:
        """Name the place this rank writes from: ranks with equal answers may share a file, as `sharing` allows."""

    def create(self, layout: FileLayout, rank: int) -> OutFile: ...

    def join(self, layout: FileLayout, rank: int, token: Any) -> OutFile: ...

    def write_small(self, name: str, data: bytes, temp: str | None = None) -> None:
        """Whole or absent after a crash. `temp`: the local store's temporary name, for callers that race."""

    def put_stream(self, name: str, chunks: Iterable[bytes]) -> None:
        """A file copied into the output (tokenizer, custom code)."""

    def remove(self, name: str) -> None:
        """Gone, if it was there."""


class ResumeReads(Protocol):
    """What a resumed merge and the finishing steps read back: the files already written, checked."""

    def read(self, name: str) -> bytes | None:
        """A small file whole; None when it is absent."""

    def read_range(self, name: str, offset: int, nbytes: int) -> bytes: ...

    def size(self, name: str) -> int | None:
        """None when absent."""

    def sha256(self, name: str) -> str: ...

    def list(self, pattern: str) -> list[str]:
        """Names matching a glob pattern (fnmatch, one folder level per '/'), sorted."""


ROLES: tuple[type, ...] = (PlaceChecks, Locking, Writing, ResumeReads)


class Store(PlaceChecks, Locking, Writing, ResumeReads, Protocol):
    """The whole output store: every role, and the name messages give it."""

    url: str  # as messages name the output


def members(role: type) -> tuple[str, ...]:
    """Return the public attributes and methods a role declares (its own, not its bases')."""
    return tuple(n for n in (*vars(role).get("__annotations__", {}), *vars(role)) if not n.startswith("_"))


def store_members() -> tuple[str, ...]:
    """Return every member a Store has: `url`, then each role's, in the order of ROLES."""
    return (*members(Store), *(m for role in ROLES for m in members(role)))


def missing_members(value: object) -> list[str]:
    """Return the Store members `value` lacks (a method must be callable), in store_members' order: a plug-in
    missing one would otherwise fail in the middle of a merge, when that role is first asked for."""
    attributes = {n for role in (Store, *ROLES) for n in vars(role).get("__annotations__", {})}
    return [n for n in store_members()
            if not (hasattr(value, n) if n in attributes else callable(getattr(value, n, None)))]


def not_empty(url: str, resumable: bool) -> OutputError:
    """The refusal of an output that holds work, naming the options the command has (`resumable`: merge's
    --resume; the import has only --overwrite)."""
    finish = ", or --resume to finish an interrupted merge" if resumable else ""
    return OutputError(f"output {url} is not empty: pass --overwrite to replace its model files{finish}")

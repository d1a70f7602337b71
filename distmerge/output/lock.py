"""One merge per output: the lock a merge holds on its output from before its first write to its exit.

A second merge into the same output (a requeued job, a retry, two jobs pointed at one folder) fails at once with one
line naming the holder, instead of both writing and both exiting 0 while the folder holds one model or none.

The lock is one small object beside the model, `OUT/.distmerge.lock` (names.LOCK), holding its holder's record
(host, pid, start time, the command's input). Each store makes it with its own atomic primitive (`Store.lock`
returns a `LockFile`): a hard link of a finished record on a folder (local.py: atomic on local file systems and on
NFS, whose O_EXCL is not atomic before NFSv3), a conditional create (`If-None-Match: *`) on an object store
(s3.py). Rank 0 takes it (engine/run.py, in discovery: every rank learns the outcome with discovery's broadcast),
renews it from a thread (`Lease`), checks it is still its own right before it writes the index (the commit
marker), and releases it on every exit path.

A lock whose holder is gone is taken over by `--resume` or `--overwrite`, saying so. Gone means:
  - on the same machine (host name and boot id): its process is dead (pid, and the process's start time, since
    pids are reused). A stopped process (SIGSTOP, a hung file system) still holds: only its death frees the lock.
  - on another machine: it has not renewed the lock for LEASE_S seconds (the lock's time, by the store's clock:
    a folder's mtime, an object's Last-Modified, against this machine's clock: cluster clocks agree to well
    under a second with NTP, LEASE_S is minutes). A holder that was stalled longer than that and comes back finds
    its lock gone at its next renewal or check, and fails without writing its index.
Without either option such an output is refused with a line that says so, as any output holding work is.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from distmerge.errors import OutputError, OutputLocked
from distmerge.input import tree

LEASE_S = 300.0  # a holder on another machine that has not renewed for this long is gone (the lock's docstring)
RENEW_S = LEASE_S / 6  # how often the holder renews: a few missed renewals (a slow store) never lose the lock
TAKE_TRIES = 4  # rounds of "create, find it held by a gone holder, remove it" before giving up on a busy lock


@dataclass(frozen=True, kw_only=True)
class Holder:
    """Who holds the lock: what the refusal names, and what tells whether the holder is gone."""

    host: str  # the host name, as the refusal shows it
    machine: str  # host name and boot id (tree.host_id): where a pid means this process
    pid: int
    pid_start: str  # the process's start time in clock ticks since boot (/proc/PID/stat field 22): pids are reused
    started: float  # seconds since the epoch
    input: str
    command: str
    token: str  # unique per taking: a lock renewed or removed by its holder is its own
    lease_s: float = LEASE_S

    def encode(self) -> bytes:
        return (json.dumps(asdict(self), indent=1) + "\n").encode()

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.started))
        here = self.machine == tree.host_id()
        return f"pid {self.pid} on {self.host}{' (this machine)' if here else ''}, started {when}, input {self.input}"


def this_process(input_root: str) -> Holder:
    pid = os.getpid()
    return Holder(host=socket.gethostname(), machine=tree.host_id(), pid=pid, pid_start=_start_ticks(pid),
                  started=time.time(), input=input_root, command=shlex.join(sys.argv)[:400],
                  token=uuid.uuid4().hex)


def parse(data: bytes) -> Holder | None:
    """The record, or None when it is not one (a lock file written by something else, or damaged)."""
    try:
        fields = json.loads(data)
        return Holder(**fields) if isinstance(fields, dict) else None
    except (ValueError, TypeError):
        return None


@dataclass(frozen=True)
class Found:
    """The lock as it is now: its bytes, the store's version of it (what remove_if compares), its last renewal."""

    data: bytes
    version: Any
    renewed: float  # seconds since the epoch, by the store's clock


class LockFile(Protocol):
    """A store's lock object (Store.lock). Every call is atomic on its own; `version` is opaque."""

    where: str  # as messages name it

    def create(self, data: bytes) -> bool:
        """Make the lock with `data` if there is none; False if there is one."""

    def read(self) -> Found | None:
        """The lock, None if there is none."""

    def remove_if(self, version: Any) -> bool:
        """Remove the lock if it is still the one read at `version`; False if it changed (someone else took it)."""

    def renew(self) -> bool:
        """The holder: touch its lock; False if it is no longer its own."""

    def holds(self) -> bool:
        """The holder: the lock is still the one it made."""

    def release(self) -> None:
        """The holder: remove its lock, if it is still its own. Safe to call twice."""


def gone(holder: Holder, renewed: float) -> bool:
    """Whether the lock's holder is gone (the module docstring's rule)."""
    if holder.machine == tree.host_id():
        return not _alive(holder.pid, holder.pid_start)
    return time.time() - renewed > holder.lease_s


def take(lock: LockFile, me: Holder, url: str, take_over: bool, say: Callable[[str], None], *,
         resumable: bool = True) -> Lease:
    """Take the output's lock for `me`, or raise OutputError naming the holder. `take_over` (--resume,
    --overwrite): a gone holder's lock is removed and taken, and `say` tells the user so. `resumable`: the command
    has --resume (merge; not the import), which the refusal then offers."""
    for _ in range(TAKE_TRIES):
        if lock.create(me.encode()):
            return Lease(lock)
        found = lock.read()
        if found is None:  # released between the two calls: try again
            continue
        other = parse(found.data)
        if other is None:
            if time.time() - found.renewed <= LEASE_S:
                raise OutputError(f"output {url} is locked ({lock.where} holds no record distmerge can read, and "
                                  f"is recent): another program may be writing it; choose another --output")
        elif not gone(other, found.renewed):
            raise OutputLocked(f"output {url} is being written by another merge ({other.describe()}): wait for it "
                              "to end, or choose another --output")
        if not take_over:
            holder = other.describe() if other else "unknown"
            finish = "--resume to finish its work, or " if resumable else ""
            raise OutputError(f"output {url} holds the lock of a merge that is gone ({holder}): pass {finish}"
                              "--overwrite to start over")
        if lock.remove_if(found.version):
            say(f"lock: taking over {lock.where} from a merge that is gone ({other.describe() if other else '?'})")
    raise OutputError(f"output {url}: its lock {lock.where} kept changing hands while this merge tried to take it: "
                      "other merges are starting on it; choose another --output")


class Lease:
    """A taken lock, renewed every RENEW_S seconds from a daemon thread until released."""

    def __init__(self, lock: LockFile, every: float = RENEW_S) -> None:
        self.lock = lock
        self.lost = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._renew, args=(every,), name="distmerge-lock", daemon=True)
        self._thread.start()

    def _renew(self, every: float) -> None:
        while not self._stop.wait(every):
            with contextlib.suppress(Exception):  # a store that failed once may answer next time; check() decides
                self.lost = self.lost or not self.lock.renew()

    def check(self, url: str) -> None:
        """Raise unless the lock is still this merge's own: right before the index makes the output finished."""
        if self.lost or not self.lock.holds():
            raise OutputError(f"output {url}: this merge lost its lock {self.lock.where} (it was taken over while "
                              "this merge was stalled longer than the lease): another merge owns the output now; "
                              "nothing was marked finished")

    def release(self) -> None:
        self._stop.set()
        self.lock.release()


def _start_ticks(pid: int) -> str:
    """The process's start time (clock ticks since boot), '' where /proc does not say."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
    except OSError:
        return ""
    return stat.rpartition(")")[2].split()[19]  # field 22; the name in parentheses may hold spaces


def _alive(pid: int, started: str) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        pass
    return not started or _start_ticks(pid) in ("", started)

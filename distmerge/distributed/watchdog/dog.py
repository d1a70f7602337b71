"""The watchdog's thread (see the package's docstring): it publishes, reads, watches, and ends the process."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from distmerge.distributed.namespaces import next_namespace
from distmerge.distributed.watchdog.pulse import Pulse
from distmerge.distributed.watchdog.verdict import Reading, Record, Verdict, judge, lost_line, verdict_line

log = logging.getLogger("distmerge")

SPEAKER_WAIT_S = 10.0  # how long a rank that found the verdict waits for the lowest live rank to print it
# What gloo and NCCL say when a peer's connection closes (its process killed, its node lost): Watchdog.lost
LOST_PEER = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "remote process exited")
CLEANUP_WAIT_S = 5.0  # the most the on_abort callbacks may take before the process ends anyway


def _run() -> str:
    """The torchrun run and restart this process belongs to: an agent's store outlives a restart's processes, whose
    counts start again at 0."""
    return os.environ.get("TORCHELASTIC_RUN_ID", "") + "." + os.environ.get("TORCHELASTIC_RESTART_COUNT", "")


class StoreSilent(Exception):
    """The store did not answer a request within the watchdog's store timeout."""


class Watchdog:
    """One per Comm that starts its own group (start_for): see the module docstring."""

    def __init__(self, *, pulse: Pulse, rank: int, world: int, timeout_s: float, address: tuple[str, int],
                 namespace: str, served_by_rank_0: bool, aborts: list[Callable[[], Any]],
                 on_silence: Callable[[str, bool], None] | None) -> None:
        self.pulse, self.rank, self.world, self.timeout = pulse, rank, world, timeout_s
        self.period = max(0.25, min(5.0, timeout_s / 4))
        self.window = 2 * self.period + 1.0  # long enough for a live peer to publish at least once
        self.store_timeout = timedelta(seconds=min(10.0, max(2.0, 2 * self.period)))
        self.address, self.namespace, self.served_by_rank_0 = address, namespace, served_by_rank_0
        self.aborts, self.on_silence = aborts, on_silence
        self.host, self.pid = socket.gethostname(), os.getpid()
        self.verdict: Verdict | None = None
        self.ending = False  # a verdict under a command: this thread is ending the process (_fire)
        self._beat = 0
        self._store: Any = None  # the store client (_stored), None after an error: made again
        self._caller: threading.Thread | None = None  # the thread of the last store request (_stored)
        self._store_failing: tuple[tuple[int, float], float] | None = None  # (the wait, since when)
        self._first: Reading | None = None
        self._rank_0: Record | None = None  # its last record read: its host and pid, should the store go silent
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="distmerge-watchdog", daemon=True)

    @classmethod
    def start_for(cls, pulse: Pulse, *, rank: int, world: int, timeout_s: float, aborts: list[Callable[[], Any]],
                  on_silence: Callable[[str, bool], None] | None) -> Watchdog | None:
        """Started on the group just made (the default group's store), or None where its store is not a TCPStore
        (a file:// rendezvous: the group's own timeout alone then)."""
        import torch.distributed as dist

        # Taken before anything can return None, so that every rank counts it alike (distributed/namespaces.py).
        namespace = next_namespace(f"distributed/watchdog/{_run()}")
        store = dist.distributed_c10d._get_default_store()
        while isinstance(store, dist.PrefixStore):
            store = store.underlying_store
        if not isinstance(store, dist.TCPStore):
            log.debug("no watchdog: the rendezvous store is a %s, not a TCPStore", type(store).__name__)
            return None
        dog = cls(pulse=pulse, rank=rank, world=world, timeout_s=timeout_s, address=(store.host, store.port),
                  namespace=namespace,
                  served_by_rank_0=os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True",
                  aborts=aborts, on_silence=on_silence)
        try:
            dog._publish()  # before the first collective: every rank has a record once any waits
        except Exception as err:  # noqa: BLE001  (the group works: the thread tries again, a wait judges the store)
            log.debug("watchdog: cannot publish: %s", err)
        dog._thread.start()
        return dog

    def stop(self) -> None:
        """End the thread: at once, or once its store request is answered (store_timeout at most). A request
        that a silent store never answers keeps its own thread (_stored), which this leaves as it is."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(self.store_timeout.total_seconds() + 1.0)
        self._store = None

    # -- the thread ---------------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.wait(self.period):
            try:
                self._publish()
            except Exception as err:  # noqa: BLE001  (the store is judged when a wait needs it: _watch)
                log.debug("watchdog: cannot publish: %s", err)
            try:
                self._watch()
            except Exception as err:  # noqa: BLE001  (the thread must live on: the backstop stays)
                log.debug("watchdog: %s: %s", type(err).__name__, err)

    def _connect(self) -> Any:
        import torch.distributed as dist

        host, port = self.address
        tcp = dist.TCPStore(host, port, is_master=False, timeout=self.store_timeout, wait_for_workers=False)
        return dist.PrefixStore(self.namespace, tcp)

    def _stored(self, call: Callable[[Any], Any]) -> Any:
        """call(store), in a thread of its own, waited for store_timeout at most: a TCPStore client waits for a
        stopped server's answer without end (check, add; get too, after its own timeout, for the answer to its
        cancel). A request left unanswered keeps that thread (blocked in C, a daemon) and its connection: the
        next call makes a new one, once that thread is done; until then each call fails at once, so at most one
        thread waits on a silent store. The connection is made again after any error, too (a late answer would
        be read as the next request's)."""
        if self._caller is not None and self._caller.is_alive():
            raise StoreSilent("an earlier request is still unanswered")
        store, box = self._store, []

        def run() -> None:
            try:
                client = store if store is not None else self._connect()
                box.append((client, call(client), None))
            except Exception as err:  # noqa: BLE001  (handed to the watchdog thread)
                box.append((None, None, err))

        self._caller = threading.Thread(target=run, name="distmerge-watchdog-store", daemon=True)
        self._caller.start()
        self._caller.join(self.store_timeout.total_seconds())
        self._store = box[0][0] if box else None
        if not box:
            raise StoreSilent(f"no answer in {self.store_timeout.total_seconds():g} s")
        if box[0][2] is not None:
            raise box[0][2]
        return box[0][1]

    def _publish(self) -> None:
        self._beat += 1
        pulse = self.pulse
        record = Record(rank=self.rank, beat=self._beat, step=pulse.step, waiting=pulse.wait is not None,
                        phase=pulse.phase, host=self.host, pid=self.pid)
        self._stored(lambda s: s.set(f"rank/{self.rank}", record.encode()))

    def _read(self, wait: tuple[int, float]) -> Reading:
        keys = [f"rank/{r}" for r in range(self.world)]

        def read(store) -> list[bytes | None]:
            if store.check(keys):
                return store.multi_get(keys)
            return [store.get(k) if store.check([k]) else None for k in keys]

        raws = self._stored(read)
        return Reading(wait=wait, at=time.monotonic(), records={r: Record.decode(raw) for r, raw in enumerate(raws)})

    def _watch(self) -> None:
        wait = self.pulse.wait
        if wait is None or (self._first is not None and self._first.wait != wait):
            self._first = self._store_failing = None
        if wait is None:
            return
        now = time.monotonic()
        waited = now - wait[1]
        first = self._first
        if first is None and waited < self.timeout - self.window:
            return
        if first is not None and (waited < self.timeout or now - first.at < self.window):
            return
        try:
            reading = self._read(wait)
        except Exception as err:  # noqa: BLE001  (a store that does not answer: judged below)
            self._store_down(wait, waited, err)
            return
        self._store_failing = None
        self._rank_0 = reading.records.get(0) or self._rank_0
        if first is None:
            self._first = reading
            return
        stopped, stuck = judge(first, reading, self.rank)
        if not stopped and not stuck:
            self._first = reading  # all answer and none is behind: the backstop decides; look again later
            return
        line = verdict_line(stopped, stuck, reading, phase=self.pulse.during(), waited=waited, timeout=self.timeout)
        self._fire(Verdict(line=line, silent=frozenset([*stopped, *(s.rank for s in stuck)])))

    def _store_down(self, wait: tuple[int, float], waited: float, err: Exception) -> None:
        if self._store_failing is None or self._store_failing[0] != wait:
            self._store_failing = (wait, time.monotonic())
        failing_for = time.monotonic() - self._store_failing[1]
        if waited < self.timeout or failing_for < self.window:
            return
        log.debug("watchdog: the store does not answer: %s", _first_line(err))
        host, port = self.address
        head = f"sent nothing for {waited:.0f} s during {self.pulse.during()} (--timeout {self.timeout:g})"
        if self.served_by_rank_0:  # srun, or any launch but torchrun's: rank 0's process serves the store
            who = self._rank_0.who if self._rank_0 is not None else f"rank 0 ({host})"
            line = (f"{who} {head}, and the rendezvous store its process serves ({host}:{port}) does not answer "
                    "either: it is stopped, or its node is stalled")
        else:
            line = (f"a rank {head}, and torchrun's rendezvous store at {host}:{port} does not answer either: "
                    "the node it runs on, or its launcher, is stalled")
        self._fire(Verdict(line=line, silent=frozenset({0}) if self.served_by_rank_0 else frozenset()))

    # -- the end ------------------------------------------------------------------------------------
    def _fire(self, verdict: Verdict) -> None:
        self.verdict = verdict
        log.debug("watchdog: %s", verdict.line)
        if self.on_silence is None:
            return  # the API: the backstop's error is raised as the verdict (comm.process_group)
        self.ending = True
        try:
            self._cleanup()
            speak = self._speaks(verdict)
            self.on_silence(verdict.line, speak)
            if speak:
                self._said()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)

    def lost(self, err: BaseException) -> str | None:
        """In the main thread, after a collective failed: when the transport says a peer closed its connection, the
        ranks whose heartbeat stopped, from two readings `window` apart (None: not that, or all answer)."""
        if not any(words in str(err) for words in LOST_PEER):
            return None
        try:
            first = self._read((self.pulse.step, 0.0))
            time.sleep(self.window)
            second = self._read((self.pulse.step, 0.0))
        except Exception:  # noqa: BLE001  (the store is gone too: the transport's own line stays)
            return None
        stopped = judge(first, second, self.rank)[0]
        return lost_line(stopped, second, phase=self.pulse.during()) if stopped else None

    def await_end(self) -> None:
        """In the main thread, when its collective failed (the backstop) while this thread ends the process: let it
        (it prints the line, once), rather than print the error a second time. Returns if it has not by then."""
        if self.ending:
            time.sleep(CLEANUP_WAIT_S + SPEAKER_WAIT_S + 5.0)

    def _cleanup(self) -> None:
        """The Comm's on_abort callbacks, each in a thread of its own (one that hangs, on a hung filesystem, holds
        none of the others), all waited for CLEANUP_WAIT_S at most."""
        def run(callback: Callable[[], Any]) -> None:
            try:
                callback()
            except Exception as err:  # noqa: BLE001  (the others still run, the process still ends)
                log.debug("on_abort callback %r: %s", callback, err)

        helpers = [threading.Thread(target=run, args=(c,), name="distmerge-on-abort", daemon=True) for c in self.aborts]
        for helper in helpers:
            helper.start()
        deadline = time.monotonic() + CLEANUP_WAIT_S
        for helper in helpers:
            helper.join(max(0.0, deadline - time.monotonic()))

    def _speaks(self, verdict: Verdict) -> bool:
        """Whether this rank prints the line: the lowest live rank does, if its claim in the store is the first;
        another does when the lowest has not printed within SPEAKER_WAIT_S (and its claim is the first). A
        store that does not answer: the lowest live rank alone."""
        lowest = min((r for r in range(self.world) if r not in verdict.silent), default=self.rank)
        if self.rank != lowest:
            deadline = time.monotonic() + SPEAKER_WAIT_S
            while time.monotonic() < deadline:
                try:
                    if self._stored(lambda s: s.check(["said"])):
                        return False
                except Exception:  # noqa: BLE001  (no store: the lowest live rank speaks)
                    return False
                time.sleep(0.2)
        try:
            return self._stored(lambda s: s.add("claimed", 1)) == 1
        except Exception:  # noqa: BLE001
            return self.rank == lowest

    def _said(self) -> None:
        with contextlib.suppress(Exception):  # the others then stop waiting at SPEAKER_WAIT_S
            self._stored(lambda s: s.set("said", b"1"))


def _first_line(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return lines[0][:200] if lines else type(err).__name__

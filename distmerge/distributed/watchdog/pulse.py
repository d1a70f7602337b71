"""The main thread's side of the watchdog (see the package's docstring): what it is doing, for the thread to read."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

BACKSTOP_S = 25.0  # the group's own timeout is --timeout + this: the watchdog, not gloo's text, speaks first
POLL_S = (0.0002, 0.005)  # an NCCL exchange's wait: its first and longest pause between looks (WatchedWork.wait)


class Pulse:
    """What the main thread is doing, for the watchdog thread to read: attributes written by the main thread alone,
    each in one assignment (atomic under the GIL). Every Comm has one; only a watchdog reads it."""

    def __init__(self) -> None:
        self.step = 0  # collectives joined
        self.phase = ""  # the engine's words: "discovery", "round 3 of 12"
        self.wait: tuple[int, float] | None = None  # (the step waited for, since when: time.monotonic())

    def join(self) -> int:
        """A collective call of this rank: its step."""
        self.step += 1
        return self.step

    @contextmanager
    def waiting(self, step: int) -> Iterator[None]:
        before, self.wait = self.wait, (step, time.monotonic())
        try:
            yield
        finally:
            self.wait = before

    def during(self) -> str:
        return self.phase or f"collective {self.step}"


class WatchedWork:
    """An all_to_all in flight (Comm.all_to_all_async): `wait()` is marked as a wait on its step, for the watchdog.
    NCCL's work.wait() only makes the current stream wait, and the CPU would block later, in a copy no one marks;
    so on a GPU the main thread looks at the work (is_completed: a CUDA event query, no sync) until it is done."""

    def __init__(self, work: Any, pulse: Pulse, step: int, *, poll: bool) -> None:
        self._work, self._pulse, self._step, self._poll = work, pulse, step, poll

    def wait(self) -> None:
        with self._pulse.waiting(self._step):
            pause = POLL_S[0]
            while self._poll and not self._work.is_completed():
                time.sleep(pause)
                pause = min(2 * pause, POLL_S[1])
            self._work.wait()

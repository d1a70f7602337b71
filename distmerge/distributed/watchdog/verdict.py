"""The watchdog's records, its judgement of two readings and its line (see the package's docstring). Pure."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

NAMED_AT_MOST = 8  # ranks listed by name in the line; the rest counted


@dataclass(frozen=True, kw_only=True)
class Record:
    """What a rank publishes every period."""

    rank: int
    beat: int
    step: int
    waiting: bool
    phase: str
    host: str
    pid: int

    def encode(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @staticmethod
    def decode(raw: bytes | None) -> Record | None:
        try:
            return Record(**json.loads(raw)) if raw else None
        except (ValueError, TypeError):
            return None

    @property
    def who(self) -> str:
        return f"rank {self.rank} ({self.host}, pid {self.pid})"


@dataclass(frozen=True, kw_only=True)
class Reading:
    """Every rank's record (None: none published) as read at `at` (this host's monotonic clock), in the wait
    (step, since) it was read for."""

    wait: tuple[int, float]
    at: float
    records: dict[int, Record | None]


@dataclass(frozen=True, kw_only=True)
class Verdict:
    line: str
    silent: frozenset[int]  # the ranks named (the lowest other rank speaks)


def judge(first: Reading, second: Reading, me: int) -> tuple[list[int], list[Record]]:
    """The ranks that hold up this rank's wait: (stopped, stuck). Stopped: no record, or a heartbeat that did not
    advance between the readings. Stuck: alive, short of the step waited for, not waiting itself, step unchanged."""
    step = second.wait[0]
    stopped, stuck = [], []
    for rank, now in sorted(second.records.items()):
        before = first.records.get(rank)
        if rank == me:
            continue
        if now is None or (before is not None and now.beat == before.beat):
            stopped.append(rank)
        elif now.step < step and not now.waiting and before is not None and before.step == now.step:
            stuck.append(now)
    return stopped, stuck


def verdict_line(stopped: list[int], stuck: list[Record], reading: Reading, *, phase: str, waited: float,
                 timeout: float) -> str:
    """One line: who, how long, in which phase, --timeout, and what their records say."""
    known = {r: rec for r, rec in reading.records.items() if rec is not None}
    names = [known[r].who if r in known else f"rank {r}" for r in sorted([*stopped, *(s.rank for s in stuck)])]
    who = names[0] if len(names) == 1 else "ranks " + ", ".join(n.removeprefix("rank ") for n in names[:NAMED_AT_MOST])
    who += f" and {len(names) - NAMED_AT_MOST} more" if len(names) > NAMED_AT_MOST else ""
    head = f"{who} sent nothing for {waited:.0f} s during {phase} (--timeout {timeout:g})"
    where = stuck[0].phase if stuck else ""
    working = f"its own part of {where}" if where in ("", phase) else where
    if len(names) == 1:
        if stopped:
            return f"{head}: its process does not answer either: it is stopped, or its node is stalled"
        return (f"{head}: its process is alive but still working on {working}: a read or write that does not return? "
                "(a hung filesystem)")
    why = []
    if stopped:
        why.append(f"{_ranks(stopped)} {'does' if len(stopped) == 1 else 'do'} not answer at all (stopped, or a "
                   "stalled node)")
    if stuck:
        why.append(f"{_ranks([s.rank for s in stuck])} {'is' if len(stuck) == 1 else 'are'} alive but still working "
                   f"on {working.replace('its own', 'their own') if len(stuck) > 1 else working} (a read or write "
                   "that does not return?)")
    return f"{head}: {'; '.join(why)}"


def lost_line(stopped: list[int], reading: Reading, *, phase: str) -> str:
    """One line for the ranks whose connection closed and whose heartbeat stopped: a process, or a node, gone."""
    known = {r: rec for r, rec in reading.records.items() if rec is not None}
    names = [known[r].who if r in known else f"rank {r}" for r in stopped[:NAMED_AT_MOST]]
    who = names[0] if len(stopped) == 1 else "ranks " + ", ".join(n.removeprefix("rank ") for n in names)
    who += f" and {len(stopped) - NAMED_AT_MOST} more" if len(stopped) > NAMED_AT_MOST else ""
    return (f"{who} {'is' if len(stopped) == 1 else 'are'} gone during {phase}: the connection closed and the "
            "heartbeat stopped (a killed process, or a lost node); nothing was committed: rerun with --resume to keep "
            "the files already finished")


def _ranks(ranks: list[int]) -> str:
    shown = ", ".join(str(r) for r in ranks[:NAMED_AT_MOST])
    return ("rank " if len(ranks) == 1 else "ranks ") + shown + (f" and {len(ranks) - NAMED_AT_MOST} more"
                                                                  if len(ranks) > NAMED_AT_MOST else "")

"""What the user sees: progress on rank 0 while the merge runs, one summary table at the end.

rich is imported only where it draws (a bar on a terminal, the summary table at the end): a --quiet run and
every rank but 0 never pay its import (~0.05 s of CPU, and more objects for the GC to walk).
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict
from typing import TYPE_CHECKING

from distmerge.results import MergeResult

if TYPE_CHECKING:
    from rich.progress import Progress as RichProgress
    from rich.table import Table


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n} B"


class Progress:
    """A rich bar on a terminal; plain lines at each 10% otherwise; nothing when disabled."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.total = self.done = 0
        self._bar: RichProgress | None = None
        self._task = None
        self._next_line = 0.0
        self._t0 = 0.0

    def say(self, line: str) -> None:
        """A line before the bar (what --resume found)."""
        if self.enabled and line:
            print(line, flush=True)

    def start(self, total: int, files: int, kept: int = 0) -> None:
        """`total`: the bytes this run writes, into `files` less `kept` (files --resume keeps are not counted)."""
        if not self.enabled:
            return
        self.total, self._t0 = total, time.perf_counter()
        into = f"{files - kept} of {files} file(s) ({kept} kept)" if kept else f"{files} file(s)"
        if sys.stdout.isatty():
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                DownloadColumn,
                TaskProgressColumn,
                TextColumn,
                TimeRemainingColumn,
                TransferSpeedColumn,
            )
            from rich.progress import Progress as RichProgress

            self._bar = RichProgress(
                TextColumn(f"merging into {into}"),
                BarColumn(),
                TaskProgressColumn(),
                DownloadColumn(),
                TransferSpeedColumn(),
                TimeRemainingColumn(),
                console=Console(),
            )
            self._bar.start()
            self._task = self._bar.add_task("merge", total=total)
        else:
            print(f"merging {human_bytes(total)} into {into}", flush=True)

    def advance(self, nbytes: int) -> None:
        if not self.enabled or not nbytes:
            return
        self.done += nbytes
        if self._bar is not None:
            self._bar.update(self._task, completed=self.done)
        elif self.total and self.done / self.total >= self._next_line:
            rate = self.done / max(time.perf_counter() - self._t0, 1e-9)
            pct = 100 * self.done / self.total
            done, total = human_bytes(self.done), human_bytes(self.total)
            print(f"  {pct:5.1f}%  {done} of {total}  {human_bytes(rate)}/s", flush=True)
            self._next_line = min(1.0, self.done / self.total + 0.1)

    def stop(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None


def summary_table(result: MergeResult) -> Table:
    from rich.table import Table

    table = Table()
    several = result.nodes > 1  # then: each rank's node, and what reached it from the others' disks
    for column in ("rank", *("node",) * several, "read", *("from other nodes",) * several, "written", "files",
                   "peak RSS"):
        table.add_column(column, justify="right")
    for r in result.ranks:
        table.add_row(
            str(r.rank), *(str(r.node),) * several, human_bytes(r.bytes_read),
            *(human_bytes(r.bytes_from_other_nodes),) * several, human_bytes(r.bytes_written), str(r.files_written),
            human_bytes(r.peak_rss),
        )
    return table


def print_summary(result: MergeResult) -> None:
    from rich.console import Console

    console = Console(width=max(100, Console().width))
    for note in result.notes:
        console.print(f"note: {note}", markup=False)
    console.print(summary_table(result))
    kept = (f" ({result.resumed_files} file(s) kept from an earlier run, {human_bytes(result.bytes_written)} "
            "written)" if result.resumed_files else "")
    console.print(
        f"distmerge: {result.tensors} tensors, {len(result.files)} file(s), {human_bytes(result.total_bytes)}{kept} "
        f"in {result.seconds:.2f} s ({human_bytes(write_rate(result))}/s), {result.processes} process(es) on "
        f"{result.device}{_across(result)} -> {result.output}",
        markup=False,
        soft_wrap=True,  # one line whatever the terminal width: scripts grep it
    )


def _across(result: MergeResult) -> str:
    """On several nodes: how many, and the bytes that crossed between them."""
    if result.nodes < 2:
        return ""
    crossed = sum(r.bytes_from_other_nodes for r in result.ranks)
    return f" across {result.nodes} nodes ({human_bytes(crossed)} crossed nodes)"


def write_rate(result: MergeResult) -> float:
    """Bytes per second this run wrote: files --resume kept took no time and count for nothing."""
    return result.bytes_written / max(result.seconds, 1e-9)


def summary_json(result: MergeResult) -> str:
    data = asdict(result)
    data["gb_per_s"] = write_rate(result) / 1e9
    data["files"] = [{"name": n, "bytes": b} for n, b in result.files]
    return json.dumps(data, indent=2) + "\n"

"""What a watch shows (rank 0, unless quiet): a line before each merge, a table after each pass that has news
(step, status, size, time), and one line at the end. rich is imported only to draw the table."""

from __future__ import annotations

from collections import Counter

from distmerge.report import human_bytes
from distmerge.watcher.outcome import DONE, INTERRUPTED, MERGED, RESUMED, Outcome, WatchResult

SIZED = (MERGED, RESUMED, DONE)
SHORT = 48  # a detail longer than this (an error's line) is printed under the table, whole, not wrapped in a cell


def say_merging(name: str, output: str) -> None:
    print(f"watch: merging {name} -> {output}", flush=True)


def print_pass(number: int, outcomes: list[Outcome]) -> None:
    """The pass's table, the long details (`NAME: failed: the error`), then one line of counts."""
    from rich.console import Console
    from rich.table import Table

    table = Table()
    for column, justify in (("step", "left"), ("status", "left"), ("size", "right"), ("time", "right")):
        table.add_column(column, justify=justify)
    for o in outcomes:
        status = f"{o.status}: {o.detail}" if o.detail and len(o.detail) <= SHORT else o.status
        size = human_bytes(o.nbytes) if o.status in SIZED else ""
        took = f"{o.seconds:.2f} s" if o.status in (MERGED, RESUMED, INTERRUPTED) else ""
        table.add_row(o.name, status, size, took)
    console = Console(width=max(120, Console().width))
    console.print(table)
    for o in outcomes:
        if len(o.detail) > SHORT:
            console.print(f"{o.name}: {o.status}: {o.detail}", markup=False, soft_wrap=True)
    console.print(f"watch: pass {number}: {counts(outcomes)}", markup=False, soft_wrap=True)


def counts(outcomes: list[Outcome]) -> str:
    found = Counter(o.status for o in outcomes)
    return ", ".join(f"{n} {status}" for status, n in found.items()) or "no steps found"


def print_end(result: WatchResult, why: str) -> None:
    """The last line: what this watch merged, and how it ended."""
    merged, failed = result.merged, result.failed
    line = f"distmerge watch: {len(merged)} step(s) merged in {result.passes} pass(es)"
    if failed:
        line += f"; failed: {', '.join(failed)}"
    print(f"{line}{why}", flush=True)

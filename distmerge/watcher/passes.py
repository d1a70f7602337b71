"""The watch, pass after pass. Each pass: rank 0 finds the run's steps (steps.py), keeps those --steps chooses
(choose.py) and decides what each needs; the list is broadcast, and every rank takes part in the merge of each step
in it (step.py), in order; rank 0 shows the pass (summary.py). Then the watch ends (`once`) or every rank sleeps
--poll seconds on its own (no collective waits through a poll: the watchdog would take rank 0 for silent).

Collective calls of a pass, every rank alike:
    root_only   rank 0: the pass's list (Planned lines)
    per step to merge: step.merge's (root_only, the merge's own, root_only for an upload)

A SIGTERM (the command turns it into a KeyboardInterrupt) or Ctrl-C ends a watch without `once` cleanly: a merge in
flight stops as `merge` stops on Ctrl-C (its finished files kept for the next watch's --resume, its lock released),
and the watch returns what it did, `stopped`. With `once` the interrupt goes on to the caller (the command exits
130), with the step it stopped in.

Rank 0 remembers across passes (Memory): the steps whose merge failed, with their files as they were then (such a
step is tried again once its files change: DeepSpeed's `latest` can name a tag a moment before its last file is
written), and what it last showed of each step (a live watch shows only news).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from distmerge.distributed.comm import Comm
from distmerge.engine import nodes
from distmerge.engine.run import MergeOptions
from distmerge.errors import DistmergeError, InputError
from distmerge.formats import registry
from distmerge.watcher import average, steps, summary
from distmerge.watcher.choose import Choice, chosen
from distmerge.watcher.outcome import (
    AS_HF,
    DONE,
    FAILED,
    MERGED,
    NOTHING,
    RESUMED,
    WAITING,
    Outcome,
    Status,
    WatchResult,
)
from distmerge.watcher.step import StepInterrupted, Target, merge, target

SETTLED = (MERGED, RESUMED, DONE)  # a live watch shows a step's merge once, not again as "merged earlier"


@dataclass(frozen=True, kw_only=True)
class WatchOptions:
    run: Path  # the run folder (local)
    output: Path | str  # OUT: a folder or s3://bucket/prefix; RUN/<rel> is merged into OUT/<rel>
    template: MergeOptions  # the merge of every step (its input, output and resume set per step)
    once: bool = False
    poll: float = 30.0
    steps: Choice = Choice("all")
    upload: str | None = None  # --hf_upload_path: a hub repository, a branch per step (step.branch)
    average_last: int | None = None  # --average-last K: the last K finished steps averaged (average.py)


@dataclass(frozen=True, kw_only=True)
class Planned:
    """A line of a pass: a checkpoint to merge, or what a step is without a merge."""

    target: Target | None = None
    outcome: Outcome | None = None


@dataclass
class Memory:
    """Rank 0's, across passes."""

    failed: dict[str, tuple[tuple, Outcome]] = field(default_factory=dict)  # name -> its files then, the outcome
    shown: dict[str, tuple[str, str]] = field(default_factory=dict)  # name -> what was last shown of it


def watch(opts: WatchOptions, comm: Comm, show: bool) -> WatchResult:
    """Collective: pass after pass until `once` is done or an interrupt; the same result on every rank."""
    memory, outcomes, passes = Memory(), [], 0
    try:
        while True:
            passes += 1
            one_pass(opts, comm, memory, show, passes, outcomes)
            if opts.once:
                return WatchResult(passes=passes, outcomes=tuple(outcomes))
            time.sleep(opts.poll)
    except KeyboardInterrupt:
        if opts.once:
            raise
        return WatchResult(passes=passes, outcomes=tuple(outcomes), stopped=True)


def one_pass(opts: WatchOptions, comm: Comm, memory: Memory, show: bool, number: int,
             outcomes: list[Outcome]) -> None:
    comm.phase(f"watch: pass {number}: finding the finished steps")
    skip = opts.output if isinstance(opts.output, Path) else None
    # on the nodes' own disks, each node sees the steps' files it holds: its view of the run, joined on rank 0
    views = nodes.each_node(comm, lambda: steps.find(opts.run, skip=skip))
    planned = comm.root_only(lambda: decide(opts, memory, steps.joined(views) if views else None))
    mine: list[Outcome] = []
    try:
        for line in planned:
            if line.target is None:
                mine.append(line.outcome)
                continue
            comm.phase(f"watch: pass {number}: {line.target.name}")
            outcome = merge(line.target, comm, show, opts.upload)
            if outcome.status == FAILED and comm.rank == 0:
                memory.failed[outcome.name] = (steps.signature(opts.run / outcome.name), outcome)
            mine.append(outcome)
    except StepInterrupted as stop:
        mine.append(stop.outcome)
        raise
    finally:
        outcomes.extend(mine)
        if show and comm.rank == 0:
            _show(number, mine, memory, everything=opts.once)


def decide(opts: WatchOptions, memory: Memory, found: list[steps.Step] | None = None) -> list[Planned]:
    """Rank 0: the pass's lines, step by step in the run's order. `found`: the steps as every node sees them
    together (steps.joined), when the ranks run on several; else this node's."""
    skip = opts.output if isinstance(opts.output, Path) else None
    found = found if found is not None else steps.find(opts.run, skip=skip)
    planned = [line for s in chosen(opts.steps, found) for line in _lines(opts, memory, s)]
    if opts.average_last:
        made = average.lines(opts.average_last, found, opts.template, opts.run, opts.output)
        planned += [Planned(outcome=m) if isinstance(m, Outcome) else Planned(target=m) for m in made]
    return planned


def _lines(opts: WatchOptions, memory: Memory, s: steps.Step) -> list[Planned]:
    def said(name: str, status: Status, detail: str = "") -> Planned:
        return Planned(outcome=Outcome(name=name, number=s.number, status=status, detail=detail))

    if not s.finished:
        return [said(name, WAITING) for name in s.names()]
    if s.as_hf:
        return [said(s.rel, AS_HF, "nothing to merge")]
    if not s.checkpoints:
        return [said(s.rel, NOTHING, _why(opts.run / s.rel))]
    out = []
    for name in s.checkpoints:
        failed = memory.failed.get(name)
        if failed is not None and failed[0] == steps.signature(opts.run / name):
            out.append(Planned(outcome=failed[1]))  # the same files: the same error, not tried again
        else:
            out.append(Planned(target=target(opts.template, opts.run, opts.output, name, s.number)))
    return out


def _why(folder: Path) -> str:
    try:
        registry.pick(folder)
    except DistmergeError as err:
        return str(err)
    except OSError as err:
        return f"{folder}: {err.strerror}"
    return ""


def _show(number: int, outcomes: list[Outcome], memory: Memory, everything: bool) -> None:
    """Rank 0: the pass's table; a live watch shows only what changed since it last showed each step."""
    news = []
    for o in outcomes:
        said = ("settled", "") if o.status in SETTLED else (o.status, o.detail)
        if everything or memory.shown.get(o.name) != said:
            news.append(o)
        memory.shown[o.name] = said
    if news:
        summary.print_pass(number, news)


def check_places(run: Path, output: Path | str, upload: str | None) -> None:
    """Before any group (every rank finds the same): RUN is a local folder, OUT is not RUN, and an upload sends a
    local OUT. OUT may lie inside RUN: the walk leaves it out."""
    if not run.is_dir():
        _refuse(f"--input {run} is not a folder: pass the run folder your trainer saves its checkpoints in")
    if isinstance(output, Path) and output.resolve() == run.resolve():
        _refuse(f"--output {output} is the run folder: choose another folder (each step goes to OUT/<step>)")
    if upload is not None and not isinstance(output, Path):
        _refuse("--hf_upload_path sends the merged folders: with an s3:// --output, upload them from a local copy")


def _refuse(line: str) -> None:
    err = InputError(line)
    err.before_group = True  # every rank refuses alike: rank 0 says it (cli._report_error)
    raise err

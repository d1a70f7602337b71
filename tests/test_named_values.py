"""Watch statuses and option kinds are Enums whose members print as the plain strings they replaced, so the watch's
table, its JSON-free summary and the options' messages read the same; a row of an unknown kind fails when written."""

from __future__ import annotations

import pytest

from distmerge.option_kinds import Kind
from distmerge.options import Opt
from distmerge.watcher.outcome import Outcome, Status, WatchResult
from distmerge.watcher.summary import counts

# The statuses as the watch printed them before they were an Enum (docs/watch.md's table).
PRINTED = {"MERGED": "merged", "RESUMED": "resumed", "DONE": "merged earlier", "WAITING": "still being written",
           "TOO_FEW": "waiting for steps", "ELSEWHERE": "being merged by another watcher", "FAILED": "failed",
           "UPLOAD_FAILED": "upload failed", "AS_HF": "saved as a Hugging Face model",
           "NOTHING": "no checkpoint found", "INTERRUPTED": "interrupted"}


def test_each_status_prints_as_its_old_string():
    assert {s.name: f"{s}" for s in Status} == PRINTED
    assert {s.name: str(s) for s in Status} == PRINTED
    assert Status("merged earlier") is Status.DONE and Status.FAILED == "failed"


def test_the_summary_line_counts_by_the_printed_status():
    outcomes = [Outcome(name="a", status=Status.MERGED), Outcome(name="b", status=Status.MERGED),
                Outcome(name="c", status=Status.DONE)]
    assert counts(outcomes) == "2 merged, 1 merged earlier"
    assert WatchResult(passes=1, outcomes=tuple(outcomes)).merged == ["a", "b"]


def test_an_option_kind_is_a_kind_and_an_unknown_one_fails_when_written():
    row = Opt(name="x", flags=("--x",), commands=("merge",), kind="size")
    assert row.kind is Kind.SIZE and f"not a {row.kind}" == "not a size"
    with pytest.raises(ValueError, match="sizes"):
        Opt(name="x", flags=("--x",), commands=("merge",), kind="sizes")

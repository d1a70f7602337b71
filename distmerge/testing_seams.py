"""The test seams: the one module of distmerge that reads the tests' `DISTMERGE_TEST_*` variables.

The fault tests run real torchrun jobs, so a fault must reach every process of the job: the test sets one of these
variables in the job's environment, and production code calls the seam of that fault at the point where it would
happen (a round's work, an S3 upload's part size, a rank's error message). Each seam does nothing, or returns the
production value, when its variable is unset. The variables are read at each call, not at import, so a test in
its own process can set one with `monkeypatch.setenv` after distmerge is imported.

The rule: production modules read no test variable themselves; they call a seam here, named for what it does where
it is called (tests/test_structure.py checks that no other module names `DISTMERGE_TEST_`). A new fault is a new
function here, documented with the test that uses it. docs/dev/testing.md lists them.
"""

from __future__ import annotations

import os
import sys
import time

from distmerge.errors import CorruptInputError

ROUND_DELAY = "DISTMERGE_TEST_ROUND_DELAY"
FAIL_AT = "DISTMERGE_TEST_FAIL_AT"
STALL = "DISTMERGE_TEST_STALL"
S3_PART = "DISTMERGE_TEST_S3_PART"
S3_BODY_BACKOFF = "DISTMERGE_TEST_S3_BODY_BACKOFF"
SIDE_GROUP = "DISTMERGE_TEST_SIDE_GROUP"
RANK0_ERROR_DELAY = "DISTMERGE_TEST_RANK0_ERROR_DELAY"


def _set(name: str) -> str:
    return os.environ.get(name, "")


def _say(what: str) -> None:
    """Tell the test on stderr that a fault it can see no other way happened (a pause: the run's time alone would
    not show it): its test checks the line, so a seam no longer reached fails the test instead of passing it."""
    print(f"distmerge test seam: {what}", file=sys.stderr, flush=True)


def pause_after_round() -> None:
    """ROUND_DELAY=SECONDS: sleep that long after every round of the merge, so that a test can kill a rank, send
    SIGTERM or start a second merge while this one is mid-way (tests/test_resume.py, test_output_lock.py,
    test_watch.py, test_silent_rank.py)."""
    seconds = float(_set(ROUND_DELAY) or 0)
    if seconds > 0:
        time.sleep(seconds)


def fail_in_round(rank: int, k: int) -> None:
    """FAIL_AT=RANK:ROUND (ROUND 0-based): raise on that rank in that round's work, as a read error would, so that
    a test sees one rank's error raised by every rank (tests/test_promises.py, test_spread.py)."""
    if _set(FAIL_AT) == f"{rank}:{k}":
        raise CorruptInputError(f"test fault ({FAIL_AT}) on rank {rank} in round {k}")


def stall_in_round(rank: int, k: int) -> None:
    """STALL=RANK:ROUNDS:SECONDS (ROUNDS: K or K-L, 0-based): sleep that long on that rank in each of those rounds,
    before its reads, as a hung file system holds a process whose threads live (tests/test_silent_rank.py). It says
    so on stderr."""
    stall = _set(STALL)
    if not stall:
        return
    who, rounds, seconds = stall.split(":")
    first, _, last = rounds.partition("-")
    if int(who) == rank and int(first) <= k <= int(last or first):
        _say(f"rank {rank} stalls {float(seconds):g} s in round {k}")
        time.sleep(float(seconds))


def s3_part_size(default: int) -> int:
    """S3_PART=BYTES: the output's S3 part size instead of `default`, so that a tiny model's files are uploaded in
    several parts, some shared by ranks (tests/helpers/s3.py, test_s3.py, test_faults_s3.py)."""
    return int(_set(S3_PART) or default)


def s3_body_backoff(default: float) -> float:
    """S3_BODY_BACKOFF=SECONDS: the first wait before a broken S3 body is asked again, instead of `default`: the
    fault tests count the retries, not the waits between (tests/test_faults_s3.py)."""
    return float(_set(S3_BODY_BACKOFF) or default)


def side_group_on_gloo() -> bool:
    """SIDE_GROUP=1: a borrowed gloo group gets a gloo side group for the small messages, as an NCCL group does, so
    that the side group's making and destroying run on a CPU (tests/jobs/api_in_job.py)."""
    return _set(SIDE_GROUP) == "1"


def pause_before_rank_0_error() -> None:
    """RANK0_ERROR_DELAY=SECONDS: rank 0 sleeps that long before it prints an error, as a loaded machine may make
    it, so that a test sees the other ranks wait for it (tests/test_errors_fsdp.py). It says so on stderr."""
    seconds = float(_set(RANK0_ERROR_DELAY) or 0)
    if seconds > 0:
        _say(f"rank 0 waits {seconds:g} s before its error")
        time.sleep(seconds)

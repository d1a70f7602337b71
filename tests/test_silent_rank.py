"""A silent rank is named (issue #34): a rank that stops answering for --timeout seconds, stopped (SIGSTOP: a
stalled node) or alive but stuck (a read that does not return: a hung filesystem), is named by the lowest live
rank in one line, with its host, the phase the job was in and --timeout; every live rank ends within --timeout
+ 30 s, non-zero, and no index is written (distributed/watchdog/). Real torchrun jobs of 2 processes on the W=4
FSDP fixture, 9 rounds (--budget 16KB, 10 files), with --timeout 6."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from distmerge.distributed.watchdog import dog as watchdog
from distmerge.distributed.watchdog.dog import Watchdog
from distmerge.distributed.watchdog.pulse import Pulse
from distmerge.distributed.watchdog.verdict import Reading, Record, Verdict, judge, verdict_line
from tests.conftest import REPO, free_port

TIMEOUT = 6
SPLIT = ["--max-shard-size", "60KB", "--budget", "16KB"]  # 10 files, 9 rounds


def start(ckpt: Path, out: Path, env: dict[str, str]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--nnodes", "1",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "--log-dir", str(out.parent / "logs"),
           "-m", "distmerge", "merge", "--quiet", "--input", str(ckpt), "--output", str(out), *SPLIT,
           "--timeout", str(TIMEOUT)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", **env}
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def rank_pids(job: subprocess.Popen) -> dict[int, int]:
    """{rank: pid} of the workers under a torchrun launcher (their environment says RANK=r)."""
    pids = {}
    for child in Path(f"/proc/{job.pid}/task/{job.pid}/children").read_text().split():
        environ = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
        pids.update({r: int(child) for r in (0, 1) if f"RANK={r}".encode() in environ})
    return pids


def mid_merge(job: subprocess.Popen, out: Path) -> dict[int, int]:
    """Wait until the merge has written a file (rounds under way), then give both workers' pids."""
    deadline = time.monotonic() + 120
    while not list(out.glob("model-*.safetensors")) and time.monotonic() < deadline and job.poll() is None:
        time.sleep(0.05)
    assert list(out.glob("model-*.safetensors")), "the merge wrote no file before the deadline"
    return rank_pids(job)


def ended(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in "ZX"
    except FileNotFoundError:
        return True


def seconds_until_ended(pid: int, since: float, limit: float) -> float:
    while not ended(pid) and time.monotonic() - since < limit:
        time.sleep(0.1)
    return time.monotonic() - since


def finish(job: subprocess.Popen, stopped: int | None = None) -> str:
    """End the job (the stopped worker killed, as torchrun does 30 s after its SIGTERM) and give its stderr."""
    try:
        if stopped is not None and not ended(stopped):
            os.kill(stopped, signal.SIGKILL)
        _, err = job.communicate(timeout=90)
        return err
    finally:
        if job.poll() is None:
            job.kill()
            job.communicate()


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("distmerge: error:")]


def recorded(out: Path, rank: int) -> str:
    """What that rank wrote to torchrun's error file (cli.tell_torchrun)."""
    files = list((out.parent / "logs").glob(f"*/attempt_0/{rank}/error.json"))
    return json.loads(files[0].read_text())["message"] if files else ""


def check_named(stderr: str, out: Path, silent: int, live: int, words: str) -> None:
    lines = error_lines(stderr)
    assert len(lines) == 1, stderr[-3000:]
    line = lines[0]
    host = socket.gethostname()
    assert f"rank {silent} ({host}" in line and f"(--timeout {TIMEOUT})" in line, line
    assert re.search(r"during round \d+ of 9", line) and words in line, line
    assert recorded(out, live) == line, recorded(out, live)
    assert not (out / "model.safetensors.index.json").exists()


def stop_one(ckpt: Path, out: Path, victim: int) -> tuple[float, str]:
    """SIGSTOP `victim` mid-merge; the seconds until the other rank ended, and the job's stderr."""
    job = start(ckpt, out, {"DISTMERGE_TEST_ROUND_DELAY": "0.5"})
    pids = {}
    try:
        pids = mid_merge(job, out)
        os.kill(pids[victim], signal.SIGSTOP)
        live_for = seconds_until_ended(pids[1 - victim], time.monotonic(), TIMEOUT + 60)
    finally:
        stderr = finish(job, pids.get(victim))
    assert job.returncode != 0
    return live_for, stderr


@pytest.mark.torchrun
def test_a_stopped_rank_is_named_whichever_it_is(fsdp_ckpts, tmp_path):
    """Rank 1 SIGSTOPped mid-merge: rank 0 names it; rank 0 SIGSTOPped: rank 1 names it (the two jobs side by
    side). The live rank ends within --timeout + 30 s (torchrun then ends the stopped one 30 s after its
    SIGTERM, which a stopped process cannot act on: the test kills it at once instead)."""
    ckpt = fsdp_ckpts["fsdp2_llama_w4"]
    with ThreadPoolExecutor(2) as pool:
        runs = list(pool.map(lambda v: stop_one(ckpt, tmp_path / f"stop{v}" / "out", v), (1, 0)))
    for victim, (live_for, stderr) in zip((1, 0), runs, strict=True):
        assert live_for < TIMEOUT + 30, (victim, live_for, stderr[-3000:])
        check_named(stderr, tmp_path / f"stop{victim}" / "out", victim, 1 - victim, "does not answer")
    # rank 0, alive, released the output's lock before the watchdog ended it (comm.on_abort); a stopped rank 0's
    # lock stays, its holder gone, for --resume to take over (tests/test_output_lock.py)
    assert not (tmp_path / "stop1" / "out" / ".distmerge.lock").exists()
    assert (tmp_path / "stop0" / "out" / ".distmerge.lock").exists()


@pytest.mark.torchrun
def test_without_torchrun_a_stopped_rank_0_is_named_by_its_silent_store(fsdp_ckpts, tmp_path):
    """Two processes as srun starts them (RANK, WORLD_SIZE, MASTER_ADDR/PORT; no torchrun agent): rank 0's process
    serves the rendezvous store, so when it is SIGSTOPped the store is silent too. Rank 1 names rank 0 and the
    store, and ends within --timeout + 30 s."""
    out, port, procs = tmp_path / "out", str(free_port()), []
    for rank in (0, 1):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
               "DISTMERGE_TEST_ROUND_DELAY": "0.5"}
        cmd = [sys.executable, "-m", "distmerge", "merge", "--quiet", "--input", str(fsdp_ckpts["fsdp2_llama_w4"]),
               "--output", str(out), *SPLIT, "--timeout", str(TIMEOUT)]
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    try:
        deadline = time.monotonic() + 120
        while not list(out.glob("model-*.safetensors")) and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(procs[0].pid, signal.SIGSTOP)
        stopped_at = time.monotonic()
        _, stderr = procs[1].communicate(timeout=TIMEOUT + 60)
        took = time.monotonic() - stopped_at
    finally:
        for proc in procs:
            proc.kill()
            proc.communicate()
    assert procs[1].returncode == 1 and took < TIMEOUT + 30, (took, stderr[-3000:])
    lines = error_lines(stderr)
    assert len(lines) == 1 and lines[0].startswith("distmerge: error: rank 0 (127.0.0.1) sent nothing for "), stderr
    assert f"(--timeout {TIMEOUT}), and the rendezvous store its process serves (127.0.0.1:{port}) does not answer" \
        in lines[0], lines[0]
    assert not (out / "model.safetensors.index.json").exists()


@pytest.mark.torchrun
def test_a_rank_stuck_in_a_read_is_named(fsdp_ckpts, tmp_path):
    """Rank 1 sleeps 60 s inside round 2's reads (DISTMERGE_TEST_STALL: a hung filesystem, its threads alive):
    rank 0 names it as alive but stuck, within --timeout + 30 s."""
    out = tmp_path / "out"
    job = start(fsdp_ckpts["fsdp2_llama_w4"], out, {"DISTMERGE_TEST_STALL": "1:2:60"})
    began = time.monotonic()
    try:
        _, stderr = job.communicate(timeout=120)
    finally:
        finish(job) if job.poll() is None else None
    took = time.monotonic() - began
    check_named(stderr, out, 1, 0, "is alive but still working on its own part of round 3 of 9")
    assert took < 60, took  # startup, two rounds, then the timeout and the verdict: not the 60 s stall


@pytest.mark.torchrun
def test_a_slow_rank_that_progresses_is_no_alarm(fsdp_ckpts, tmp_path):
    """Rank 1 takes 4 s over each of the first 2 rounds (8 s in all, over --timeout 6), rank 0 waiting for it
    each time less than --timeout: the merge succeeds. The stalls are checked to happen (the seam's lines)."""
    out = tmp_path / "out"
    job = start(fsdp_ckpts["fsdp2_llama_w4"], out, {"DISTMERGE_TEST_STALL": "1:0-1:4"})
    try:
        _, stderr = job.communicate(timeout=120)
    finally:
        finish(job) if job.poll() is None else None
    assert job.returncode == 0, stderr[-3000:]
    assert re.findall(r"^distmerge test seam: rank 1 stalls 4 s in round (\d)$", stderr, re.MULTILINE) == ["0", "1"], \
        stderr[-3000:]
    assert (out / "model.safetensors.index.json").exists()


# --- the judgement and the end, in this process ---------------------------------------------------------------

def rec(rank: int, beat: int, step: int, waiting: bool = False, phase: str = "round 3 of 9") -> Record:
    return Record(rank=rank, beat=beat, step=step, waiting=waiting, phase=phase, host=f"node-{rank}", pid=100 + rank)


def test_judge_names_the_stopped_and_the_stuck_not_their_victims():
    """Rank 0 waits at step 7. Rank 1: heartbeat still (stopped). Rank 2: no record at all (stopped). Rank 3:
    alive, at step 6, not waiting, step unchanged (stuck). Rank 4: at step 6 but waiting itself (a victim of a
    third). Rank 5: at step 6, moving (on its way). Rank 6: at step 7, waiting too. Only 1, 2 and 3 are named."""
    wait = (7, 0.0)
    first = Reading(wait=wait, at=0.0, records={0: rec(0, 1, 7, True), 1: rec(1, 5, 7), 2: None, 3: rec(3, 1, 6),
                                                 4: rec(4, 1, 6, True), 5: rec(5, 1, 5), 6: rec(6, 1, 7, True)})
    second = Reading(wait=wait, at=4.0, records={0: rec(0, 3, 7, True), 1: rec(1, 5, 7), 2: None, 3: rec(3, 3, 6),
                                                  4: rec(4, 3, 6, True), 5: rec(5, 3, 6), 6: rec(6, 3, 7, True)})
    stopped, stuck = judge(first, second, me=0)
    assert stopped == [1, 2] and [s.rank for s in stuck] == [3]
    line = verdict_line(stopped, stuck, second, phase="round 3 of 9", waited=6.4, timeout=6)
    assert line == ("ranks 1 (node-1, pid 101), 2, 3 (node-3, pid 103) sent nothing for 6 s during round 3 of 9 "
                    "(--timeout 6): ranks 1, 2 do not answer at all (stopped, or a stalled node); rank 3 is alive but "
                    "still working on its own part of round 3 of 9 (a read or write that does not return?)")


def test_the_end_runs_the_abort_callbacks_and_says_it_once(monkeypatch):
    """A verdict under a command: the on_abort callbacks run (one that raises and one that hangs do not stop the
    others, nor the end), the lowest live rank claims the line in the store, gives it to on_silence to print, marks
    it said, and the process ends (os._exit, here an exception)."""
    import torch.distributed as dist

    class Ended(Exception):
        pass

    def exit_(code: int):
        raise Ended(code)

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ran, said = [], []
    hang = __import__("threading").Event()
    aborts = [lambda: 1 / 0, hang.wait, lambda: ran.append("released")]
    monkeypatch.setattr(watchdog, "CLEANUP_WAIT_S", 0.5)
    monkeypatch.setattr(os, "_exit", exit_)
    dog = Watchdog(pulse=Pulse(), rank=0, world=2, timeout_s=6, address=("127.0.0.1", server.port),
                   namespace="t", served_by_rank_0=True, aborts=aborts,
                   on_silence=lambda line, speak: said.append((line, speak)))
    try:
        with pytest.raises(Ended):
            dog._fire(Verdict(line="rank 1 (node-1) sent nothing", silent=frozenset({1})))
    finally:
        hang.set()
    assert ran == ["released"] and said == [("rank 1 (node-1) sent nothing", True)]
    assert server.check(["t/said"]) and server.get("t/said") == b"1" and server.add("t/claimed", 0) == 1


def test_a_silent_rank_is_named_at_the_first_look_past_the_timeout(monkeypatch):
    """The watchdog's thread looks every period; its first reading is taken a window before --timeout runs out, so
    the second, a window later, can name the silent rank at the first look past --timeout: with --timeout 6 (a
    period of 1.5 s, a window of 4 s), at most --timeout + one period after the wait began, and the line says so.
    The thread's looks are made here, on a clock of the test's own (the store is real). Seen failing with the
    first reading moved to --timeout: the rank named at 10.5 s ("sent nothing for 10 s"), not 7.5 s."""
    clock = [1000.0]
    monkeypatch.setattr(watchdog, "time", type("Clock", (), {"monotonic": staticmethod(lambda: clock[0])}))
    server = dist_store()
    pulse = Pulse()
    dog = Watchdog(pulse=pulse, rank=0, world=2, timeout_s=TIMEOUT, address=("127.0.0.1", server.port),
                   namespace="named", served_by_rank_0=True, aborts=[], on_silence=None)
    assert (dog.period, dog.window) == (1.5, 4.0)  # the thread's cadence at --timeout 6 (dog.py)
    dog._publish()  # rank 0's record; rank 1 never publishes (stopped before its first beat)
    pulse.wait = (7, clock[0])  # rank 0 waits at its 7th collective from now on
    looks = 0
    while dog.verdict is None and looks < 20:
        clock[0] += dog.period
        looks += 1
        dog._watch()
    waited = looks * dog.period
    assert dog.verdict is not None and dog.verdict.silent == {1}
    assert TIMEOUT <= waited <= TIMEOUT + dog.period, waited
    said = re.search(r"sent nothing for (\d+) s", dog.verdict.line)
    assert said and int(said[1]) == round(waited), dog.verdict.line


def dist_store():
    """A TCPStore served by this process (the job's rendezvous store, as the watchdog reads it)."""
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)

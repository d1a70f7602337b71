"""The fork server the fixtures' jobs and loaders run on (tests/helpers/forkserver.py, tests/fixtures/build.py): each
child is `python ARGV` as an interpreter would run it (its argv, sys.path[0], environment, working folder, exit
status, atexit handlers, output), and a forked job stops its other workers when one fails, as torchrun does."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

from tests.fixtures.build import ForkedJob
from tests.helpers import forkserver

PROBE = """import atexit, os, sys
print("argv", sys.argv[1:], "path0", sys.path[0], "cwd", os.getcwd(), "env", os.environ.get("PROBE"))
print("to stderr", file=sys.stderr)
atexit.register(lambda: print("atexit ran"))
sys.exit(int(sys.argv[1]))
"""


def test_a_child_runs_a_script_as_the_interpreter_would(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    done = forkserver.run([str(script), "3"], env={**os.environ, "PROBE": "given"}, cwd=tmp_path)
    assert done.returncode == 3
    assert done.stdout.splitlines() == [
        f"argv ['3'] path0 {tmp_path} cwd {tmp_path} env given", "atexit ran"], done.stdout
    assert done.stderr == "to stderr\n"


def test_a_child_runs_a_module_and_its_errors_are_an_interpreters(tmp_path):
    done = forkserver.run(["-m", "distmerge", "merge", "--input", str(tmp_path / "nope"), "--output",
                           str(tmp_path / "out")], cwd=tmp_path)
    assert done.returncode == 1 and "does not exist" in done.stderr, done.stderr
    crash = tmp_path / "crash.py"
    crash.write_text("raise ValueError('boom')\n")
    done = forkserver.run([str(crash)], cwd=tmp_path)
    assert done.returncode == 1 and done.stderr.rstrip().endswith("ValueError: boom"), done.stderr


def test_each_child_is_a_process_of_its_own(tmp_path):
    script = tmp_path / "ids.py"
    script.write_text("import os\nprint(os.getpid(), os.getsid(0))\n")
    pids = {forkserver.run([str(script)], cwd=tmp_path).stdout.split()[0] for _ in range(2)}
    assert len(pids) == 2
    out = forkserver.run([str(script)], cwd=tmp_path).stdout.split()
    assert out[0] == out[1]  # a session of its own: its pid is its session's id
    assert int(out[0]) != os.getpid()


def test_a_forked_job_stops_its_other_workers_when_one_fails(tmp_path):
    """Rank 1 fails at once, rank 0 would sleep a minute: the job ends with rank 1's status within seconds."""
    script = tmp_path / "job.py"
    script.write_text("import os, sys, time\nif os.environ['RANK'] == '1':\n    sys.exit(7)\ntime.sleep(60)\n")
    logs = tmp_path / "logs"
    logs.mkdir()
    start = time.monotonic()
    job = ForkedJob(script, 2, 1, [], dict(os.environ), logs)
    assert job.wait(30) == 7
    assert time.monotonic() - start < 30
    rank0 = job.workers[0]
    assert rank0.wait(10) == -signal.SIGKILL


def test_real_processes_when_asked(tmp_path, monkeypatch):
    monkeypatch.setenv("DISTMERGE_REAL_PROCESSES", "1")
    script = tmp_path / "exe.py"
    script.write_text("import sys\nprint(sys.executable, 'torch' in sys.modules)\n")
    done = forkserver.run([str(script)], cwd=tmp_path)
    assert done.stdout.split() == [sys.executable, "False"]  # a fresh interpreter: nothing imported before
    monkeypatch.delenv("DISTMERGE_REAL_PROCESSES")
    assert forkserver.run([str(script)], cwd=tmp_path).stdout.split() == [sys.executable, "True"]
    assert Path(sys.executable).exists()

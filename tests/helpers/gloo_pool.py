"""N processes kept for the whole test session, each running `distmerge` commands on request: what a
`torchrun --nproc-per-node N -m distmerge ...` job does once its processes are up, without starting them again.

Why: the suite runs on 2 cores, and a torchrun job spends about 5 s of CPU before distmerge's first line (the agent
and each process import torch). The exactness tests run the same kind of merge hundreds of times; there the
processes matter (N ranks, each its own process, a real gloo group made by distmerge from the environment torchrun
gives), the launcher does not. Tests of what torchrun itself does (its exit status and failure summary, signals,
a killed rank, silent ranks, several nodes) launch real torchrun: `conftest.torchrun` with `real=True`, a launcher
option or an environment of their own.

Each command gets a fresh rendezvous (a new MASTER_PORT): distmerge makes and destroys its process group per
command, as in a job that merges several times (tests/test_api.py runs five merges in one job). A command that does
not exit 0 on every rank is run again under real torchrun, after the pool's processes are replaced, so a failure's
output (torchrun's summary, every rank's line) is exactly torchrun's; the first attempt wrote nothing an exit-0
test could mistake for success, since distmerge leaves no finished output behind a failure.

    python -m tests.helpers.gloo_pool RANK WORLD     one process of a pool (started by Pool)
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

# What torchrun gives each process, less the port (per command) and the rank (per process). No TORCHELASTIC_RUN_ID:
# distmerge's silent ranks then exit at once on an error instead of waiting for torchrun to stop them (cli.py).
LAUNCH_ENV = {"MASTER_ADDR": "127.0.0.1", "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1", "ROLE_NAME": "default",
              "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0", "OMP_NUM_THREADS": "1",
              "PYTHONWARNINGS": "ignore"}
COMMAND_TIMEOUT_S = 240


class Pool:
    """`world` processes that run commands together; started on first use, replaced after a failure."""

    def __init__(self, world: int, repo: Path) -> None:
        self.world, self.repo = world, repo
        self.procs: list[subprocess.Popen] = []
        self.lock = threading.Lock()

    def run(self, argv: list[str], env: dict[str, str], port: int) -> subprocess.CompletedProcess | None:
        """The command on every process; None when some rank did not exit 0 (or the pool broke)."""
        with self.lock:
            if not self._alive():
                self._start()
            with tempfile.TemporaryDirectory(prefix="gloo-pool-") as tmp:
                outs = [(Path(tmp) / f"{r}.out", Path(tmp) / f"{r}.err") for r in range(self.world)]
                # the caller's environment as it is now, as a subprocess would inherit it (a test's monkeypatched
                # endpoint or token included)
                request = {"argv": argv, "env": {**os.environ, **env, "MASTER_PORT": str(port)}}
                try:
                    for proc, (out, err) in zip(self.procs, outs, strict=True):
                        proc.stdin.write(json.dumps({**request, "out": str(out), "err": str(err)}) + "\n")
                        proc.stdin.flush()
                    codes = [self._answer(proc) for proc in self.procs]
                except (OSError, ValueError, subprocess.TimeoutExpired):
                    codes = [None]
                if any(code != 0 for code in codes):
                    self.close()  # a failed command may leave a rank in a broken state: new processes next time
                    return None
                return subprocess.CompletedProcess(
                    ["gloo-pool", str(self.world), *argv], 0, "".join(o.read_text() for o, _ in outs),
                    "".join(e.read_text() for _, e in outs))

    def _answer(self, proc: subprocess.Popen) -> int | None:
        line = _readline(proc, COMMAND_TIMEOUT_S)
        return json.loads(line)["code"] if line else None

    def _alive(self) -> bool:
        return bool(self.procs) and all(p.poll() is None for p in self.procs)

    def _start(self) -> None:
        self.close()
        env = {**os.environ, **LAUNCH_ENV, "PYTHONPATH": os.pathsep.join(
            [str(self.repo), *filter(None, [os.environ.get("PYTHONPATH")])])}
        self.procs = [subprocess.Popen([sys.executable, "-m", "tests.helpers.gloo_pool", str(r), str(self.world)],
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                       text=True, cwd=self.repo, env=env) for r in range(self.world)]

    def close(self) -> None:
        for proc in self.procs:
            with contextlib.suppress(OSError):
                proc.stdin.close()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs = []


_POOLS: dict[int, Pool] = {}


def pool(world: int, repo: Path) -> Pool:
    """This test process's pool of `world` processes (closed when the session ends: atexit)."""
    if not _POOLS:
        import atexit

        atexit.register(lambda: [p.close() for p in _POOLS.values()])
    return _POOLS.setdefault(world, Pool(world, repo))


def _readline(proc: subprocess.Popen, timeout: float) -> str:
    """A line of the process's answer, or "" when it died or took longer than `timeout`."""
    got: list[str] = []
    reader = threading.Thread(target=lambda: got.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    if reader.is_alive():
        proc.kill()
        raise subprocess.TimeoutExpired(proc.args, timeout)
    return got[0] if got else ""


# -- one process of a pool ---------------------------------------------------------------------------------------
def serve(rank: int, world: int) -> None:
    """Answer each request line on stdin with {"code": exit status} on the stdout it was started with; the command's
    own output goes to the request's files (fd 1 and 2 redirected, as a torchrun worker's go to its log)."""
    own = {**LAUNCH_ENV, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
           "LOCAL_WORLD_SIZE": str(world), "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(world)}
    os.environ.update(own)
    from distmerge.front.cli import main  # imported once: torch, the formats, the families

    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # between commands, a stray print must not read as an answer
    for line in sys.stdin:
        request = json.loads(line)
        with _environment({**request["env"], **own}), _output_to(request["out"], request["err"]):
            code = _run(main, request["argv"])
        answers.write(json.dumps({"code": code}) + "\n")
        answers.flush()


def _run(main, argv: list[str]) -> int:
    try:
        return int(main(argv) or 0)
    except SystemExit as stop:  # argparse's usage errors
        return stop.code if isinstance(stop.code, int) else 1
    except BaseException:  # noqa: BLE001 - a bug of the command: reported as a failure, the pool replaced
        import traceback

        traceback.print_exc()
        return 1


@contextlib.contextmanager
def _environment(env: dict[str, str]):
    """Exactly `env` while the command runs (a subprocess's), then the process's own again."""
    before = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(before)


@contextlib.contextmanager
def _output_to(out: str, err: str):
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(out, "w") as o, open(err, "w") as e:
        os.dup2(o.fileno(), 1)
        os.dup2(e.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])


if __name__ == "__main__":
    serve(int(sys.argv[1]), int(sys.argv[2]))

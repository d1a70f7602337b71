"""Two nodes on one machine: two torchrun agents (`--nnodes 2`, c10d rendezvous on 127.0.0.1), each in a mount
namespace of its own (`unshare -m`) where one path (`at`) shows that node's own folder (a bind mount), as each
node of a cluster without a shared file system sees its own disk at the checkpoint's path. Needs root (CI is)."""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from tests.conftest import REPO, free_port


def can_simulate() -> bool:
    return os.geteuid() == 0 and shutil.which("unshare") is not None


@dataclass(frozen=True)
class NodeRun:
    """One node's agent: its exit status and its log (the agent's and its processes' output)."""

    returncode: int
    log: str


def split_files(ckpt: Path, nodes: list[Path], node_of: Callable[[str], Iterable[int]]) -> None:
    """Each file of `ckpt` (relative path) copied to the node folders `node_of(path)` names; folders as needed."""
    for path in sorted(p for p in ckpt.rglob("*") if p.is_file()):
        rel = path.relative_to(ckpt)
        for n in node_of(str(rel)):
            dest = nodes[n] / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, dest)


def run_two_nodes(disks: list[Path | None], at: Path, args: list[str], nproc: tuple[int, int] = (2, 2),
                  timeout: float = 240, env: dict[str, str] | None = None,
                  before: tuple[str, str] = ("", ""), kill: tuple[int, Callable[[], bool]] | None = None
                  ) -> list[NodeRun]:
    """`python -m distmerge ARGS` as one job over two simulated nodes: node k's processes see `disks[k]` at `at`
    (None: nothing there). `before[k]`: a shell line node k runs first, inside its namespace. The paths outside
    `at` are the machine's, shared by both (the output, unless a test says otherwise). `kill=(k, when)`: node k's
    agent and processes are killed (SIGKILL) once `when()` holds, as a node that fails."""
    port = free_port()
    at.mkdir(parents=True, exist_ok=True)
    procs = []
    for k in (0, 1):
        mount = f"mount --bind {shlex.quote(str(disks[k]))} {shlex.quote(str(at))}" if disks[k] else \
            f"mount -t tmpfs none {shlex.quote(str(at))}"
        # static rendezvous: node k's ranks follow node k-1's, so a test knows whose node rank 0 is on (c10d
        # numbers the agents as they arrive)
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(k),
                    "--nproc-per-node", str(nproc[k]), "--rdzv-backend", "static", "--master-addr", "127.0.0.1",
                    "--master-port", str(port), "-m", "distmerge", *map(str, args)]
        script = f"{mount} && {before[k] or 'true'} && exec {shlex.join(torchrun)}"
        procs.append(subprocess.Popen(["unshare", "-m", "--propagation", "private", "sh", "-c", script],
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
                                      start_new_session=True,
                                      env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
                                           **(env or {})}))
    if kill is not None:
        _kill_when(procs[kill[0]], kill[1], timeout)
    runs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        runs.append(NodeRun(p.returncode, out))
    return runs


def _kill_when(proc: subprocess.Popen, when: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not when():
        if time.monotonic() > deadline or proc.poll() is not None:
            raise AssertionError("the moment to kill the node never came")
        time.sleep(0.05)
    for pid in _tree(proc.pid):  # torchrun starts its processes in sessions of their own: each one by its pid
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _tree(top: int) -> list[int]:
    """`top` and every process below it."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [top]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, ()))
    return out


def error_lines(log: str) -> list[str]:
    return [line for line in log.splitlines() if line.startswith("distmerge: error:")]


def last_error(log: str) -> str:
    """A node's one line: the last `distmerge: error:` it printed."""
    lines = error_lines(log)
    return lines[-1] if lines else ""

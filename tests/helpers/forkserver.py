"""A warm process that forks the tests' Python subprocesses: each one a fresh process of its own (its pid, its
session, its environment, its exit status), started without paying for the interpreter and the imports again.

Why: the suite runs on two cores, and most of its CPU went to starting Python. Each fixture worker imported torch
and transformers (about 4.5 CPU-seconds), each `python -m distmerge` torch (about 1.7 s), hundreds of times. A
forked child shares the modules its parent imported, and imports the rest itself, as any process would.

What a child is not: a new interpreter. So this serves the processes whose start is not what a test checks: the
fixture makers' workers (tests/fixtures/build.py, torchrun's environment given without torchrun) and single
`python -m distmerge` runs (`run`). Tests of start-up itself (which modules a command imports, torchrun's own
behaviour, signals to a launcher) start real processes. DISTMERGE_REAL_PROCESSES=1 starts every one for real.

    python -m tests.helpers.forkserver MODULE...     the server: imports MODULEs, then forks on request
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# What each kind of child would import first: the server imports it once (no module that reads the environment at
# import in a way a child could change: those run with the environment the server was started with).
PRELOADS = {
    "torch": ("torch", "torch.distributed", "torch.distributed.checkpoint"),
    "trainers": ("torch", "torch.distributed", "torch.distributed.checkpoint", "torch.distributed.fsdp",
                 "transformers.modeling_utils", "transformers.models.llama.modeling_llama"),
}
PRELOADS["megatron"] = (*PRELOADS["trainers"], "megatron.core", "megatron.core.models.gpt")
# The server's own environment: what the tests give every fixture worker and distmerge run anyway.
SERVER_ENV = {"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "TRANSFORMERS_VERBOSITY": "error"}


def real_processes() -> bool:
    """DISTMERGE_REAL_PROCESSES=1 (or DISTMERGE_REAL_TORCHRUN=1, which also turns off the gloo pool)."""
    return "1" in (os.environ.get("DISTMERGE_REAL_PROCESSES"), os.environ.get("DISTMERGE_REAL_TORCHRUN"))


class Child:
    """A forked child as the tests use a subprocess.Popen: pid, poll, wait, signals."""

    def __init__(self, server: Server, pid: int, args: list[str]) -> None:
        self.server, self.pid, self.args = server, pid, args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.server.exit_code(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.server.changed:
            while self.poll() is None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise subprocess.TimeoutExpired(self.args, timeout)
                if self.server.dead:
                    raise RuntimeError("the fork server died: its children's exit statuses are lost")
                self.server.changed.wait(left if left is not None else 1.0)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Server:
    """The client's end: requests on the server's stdin, pids and exit statuses read back by a thread."""

    def __init__(self, preload: str) -> None:
        env = {**os.environ, **SERVER_ENV, "PYTHONPATH": os.pathsep.join(
            [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.helpers.forkserver", *PRELOADS[preload]],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO, env=env)
        self.changed = threading.Condition()
        self.pids: dict[int, int] = {}  # request id -> pid
        self.codes: dict[int, int] = {}  # pid -> exit status
        self.dead = False
        self.owner = os.getpid()
        self.next_id = 0
        self.send_lock = threading.Lock()
        threading.Thread(target=self._read_answers, daemon=True).start()

    def spawn(self, argv: list[str], *, env: dict[str, str], cwd: Path | str, out: Path, err: Path) -> Child:
        """Fork a child that runs `argv` (["-m", MODULE, ...] or [SCRIPT, ...]) as `python ARGV` would."""
        with self.send_lock:
            self.next_id += 1
            rid = self.next_id
            line = json.dumps({"id": rid, "argv": argv, "env": env, "cwd": str(cwd), "out": str(out),
                               "err": str(err)})
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()
        with self.changed:
            while rid not in self.pids:
                if self.dead:
                    raise RuntimeError("the fork server died before it forked")
                self.changed.wait(1.0)
            return Child(self, self.pids.pop(rid), argv)

    def exit_code(self, pid: int) -> int | None:
        with self.changed:
            return self.codes.get(pid)

    def _read_answers(self) -> None:
        for line in self.proc.stdout:
            answer = json.loads(line)
            with self.changed:
                if "pid" in answer:
                    self.pids[answer["id"]] = answer["pid"]
                else:
                    self.codes[answer["exited"]] = answer["code"]
                self.changed.notify_all()
        with self.changed:
            self.dead = True
            self.changed.notify_all()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


_SERVERS: dict[str, Server] = {}
_SERVERS_LOCK = threading.Lock()


def server(preload: str) -> Server:
    """This process's server for `preload` (a key of PRELOADS), started on first use, closed at exit; a new one if
    the process forked since (a fixture builder run under another test process)."""
    with _SERVERS_LOCK:
        running = _SERVERS.get(preload)
        if running is None or running.dead or running.owner != os.getpid():
            if not _SERVERS:
                import atexit

                atexit.register(lambda: [s.close() for s in _SERVERS.values() if s.owner == os.getpid()])
            running = _SERVERS[preload] = Server(preload)
        return running


def run(argv: list[str], *, env: dict[str, str] | None = None, cwd: Path | str | None = None,
        timeout: float = 240) -> subprocess.CompletedProcess:
    """`subprocess.run([sys.executable, *argv], capture_output=True, text=True, ...)`, forked from the torch server
    (a real process when DISTMERGE_REAL_PROCESSES=1)."""
    env = dict(os.environ if env is None else env)
    cwd = cwd or os.getcwd()
    if real_processes():
        return subprocess.run([sys.executable, *argv], env=env, cwd=cwd, capture_output=True, text=True,
                              timeout=timeout)
    with tempfile.TemporaryDirectory(prefix="forked-") as tmp:
        out, err = Path(tmp) / "out", Path(tmp) / "err"
        child = server("torch").spawn(argv, env=env, cwd=cwd, out=out, err=err)
        try:
            code = child.wait(timeout)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait(10)
            raise
        return subprocess.CompletedProcess([sys.executable, *argv], code, out.read_text(errors="replace"),
                                           err.read_text(errors="replace"))


# -- the server ---------------------------------------------------------------------------------------------------
def serve(preload: list[str]) -> None:
    """Import `preload`, then fork a child for each request line on stdin; answer its pid, then its exit status."""
    import importlib

    for name in preload:
        importlib.import_module(name)
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # a stray print of an import must not read as an answer
    requests, buffered, children = sys.stdin.fileno(), b"", set()
    open_ = True
    while open_ or children:
        # children to reap: look for their exits every 20 ms; none: sleep until a request comes
        ready, _, _ = select.select([requests] if open_ else [], [], [], 0.02 if children else None)
        if ready:
            chunk = os.read(requests, 65536)
            open_ = bool(chunk)
            buffered += chunk
            while b"\n" in buffered:
                line, buffered = buffered.split(b"\n", 1)
                request = json.loads(line)
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    answers.close()
                    _child(request)  # never returns
                children.add(pid)
                _answer(answers, {"id": request["id"], "pid": pid})
        for pid in list(children):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                children.discard(pid)
                _answer(answers, {"exited": pid, "code": os.waitstatus_to_exitcode(status)})


def _answer(answers, message: dict) -> None:
    answers.write(json.dumps(message) + "\n")
    answers.flush()


def _child(request: dict) -> None:
    """In the forked child: become a process of its own running `python ARGV`, then exit with its status."""
    code = 1
    try:
        os.setsid()  # a session of its own, as torchrun gives its workers
        write = os.O_WRONLY | os.O_CREAT | os.O_APPEND  # appended: out and err may name one file
        for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, request["out"], write), (2, request["err"], write)):
            opened = os.open(path, flags, 0o644)
            os.dup2(opened, fd)
            os.close(opened)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        code = _run_main(request["argv"])
    except BaseException:  # noqa: BLE001 - reported as the child's failure, as an interpreter would
        import traceback

        traceback.print_exc()
    finally:
        with contextlib.suppress(BaseException):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _run_main(argv: list[str]) -> int:
    """`python ARGV` from here on: sys.argv and sys.path[0] as the interpreter sets them, then what an interpreter
    does at exit (non-daemon threads joined, atexit handlers)."""
    import atexit
    import runpy

    try:
        try:
            if argv[0] == "-m":
                sys.argv = [argv[1], *argv[2:]]
                sys.path[0] = os.getcwd()
                runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
            else:
                sys.argv = list(argv)
                sys.path[0] = str(Path(argv[0]).resolve().parent)
                runpy.run_path(argv[0], run_name="__main__")
            code = 0
        except SystemExit as stop:
            code = _exit_status(stop.code)
        threading._shutdown()  # noqa: SLF001 - what the interpreter does before atexit
    finally:
        atexit._run_exitfuncs()  # noqa: SLF001
    return code


def _exit_status(code) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


if __name__ == "__main__":
    serve(sys.argv[1:])

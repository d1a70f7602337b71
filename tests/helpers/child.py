"""Reading a hostile file in a child process under CPU and memory limits (test_hostile_pickles.py,
test_dcp_fast_metadata.py)."""

from __future__ import annotations

import json
import os
import resource
import signal
import time
from collections.abc import Callable
from pathlib import Path

CPU_LIMIT_S = 10


MEMORY_LIMIT = 2 * 2**30  # the subprocess's whole address space


RSS_LIMIT = 2**30


# Words each refusal must contain: the limit or the global it names.
EXPECTED = {
    "os.system": ("posix.system",), "eval": ("builtins.eval",), "getattr chain": ("getattr",),
    "deep nesting": ("max_depth", "max_bytes"), "huge memo": ("memo index",), "shared tuple key": ("nodes_per_byte",),
    "shared tuple device": ("nodes_per_byte", "torch.device is not allowed"),
    "shared tuple path": ("nodes_per_byte", "pathlib.PosixPath is not allowed"),
    "bytearray 2 GiB": ("builtins.bytearray",), "torch lazy attribute": ("torch._inductor",),
    "deflate bomb": ("stored records only",), "overlapping records": ("disjoint",),
    "storage cut short": ("fit their record", "inside their record"),
    "storage offset past its record": ("inside their record",),
}


def in_child(fn: Callable[[], object], wall_s: float = 60) -> dict:
    """fn() in a forked child under RLIMIT_CPU and an address-space limit 2 GiB above pytest's own; what it
    raised, how it ended, and its peak RSS above pytest's."""
    vm, rss = _status("VmSize"), _status("VmRSS")
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        try:
            os.close(r)
            resource.setrlimit(resource.RLIMIT_CPU, (CPU_LIMIT_S, CPU_LIMIT_S))
            resource.setrlimit(resource.RLIMIT_AS, (vm + MEMORY_LIMIT, vm + MEMORY_LIMIT))
            try:
                fn()
                result = {"raised": None, "message": ""}
            except BaseException as err:  # noqa: BLE001 - report whatever the reader raised
                result = {"raised": type(err).__name__, "message": str(err)[:4000]}
            os.write(w, json.dumps(result).encode())
        finally:
            os._exit(0)
    os.close(w)
    deadline = time.monotonic() + wall_s
    while (waited := os.wait4(pid, os.WNOHANG))[0] == 0:
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            waited = os.wait4(pid, 0)
            break
        time.sleep(0.01)
    with os.fdopen(r, "rb") as f:
        raw = f.read()
    _, status, usage = waited
    result = json.loads(raw) if raw else {"raised": "no result", "message": ""}
    result["signal"] = os.WTERMSIG(status) if os.WIFSIGNALED(status) else 0
    result["cpu_s"] = usage.ru_utime + usage.ru_stime
    result["rss_above"] = usage.ru_maxrss * 1024 - rss
    return result


def _status(field: str) -> int:
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(field + ":"))
    return int(line.split()[1]) * 1024

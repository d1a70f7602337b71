"""Ports for the servers the tests start (torchrun's rendezvous, the gloo pool's, moto, a local hub) that nothing
else on the machine is handed meanwhile.

A port found free by binding port 0 and closing the socket is an ephemeral port: the kernel hands the same range to
every connect(), and with the suite's two test processes starting hundreds of stores and clients, one such port was
taken by another connection before its server listened (EADDRINUSE). So ports come from below the ephemeral range
(/proc/sys/net/ipv4/ip_local_port_range), each test process from a slice of its own (PYTEST_XDIST_WORKER), in turn,
each checked free by a bind before it is handed out."""

from __future__ import annotations

import itertools
import os
import socket

SLICE = 1500  # ports per test process: far more than one process has listening at once
SLICES = 8  # test processes provided for (pytest -n 8)


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _slice() -> range:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    index = (int(worker) if worker.isdigit() else 0) % SLICES
    start = _ephemeral_low() - SLICES * SLICE + index * SLICE
    return range(start, start + SLICE)


_NEXT = itertools.cycle(_slice())


def free_port() -> int:
    """The next port of this process's slice that a bind finds free."""
    for _ in range(SLICE):
        port = next(_NEXT)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise OSError(f"no free port in {_slice()}")


def free_ports(n: int) -> list[int]:
    """`n` distinct free ports."""
    return [free_port() for _ in range(n)]

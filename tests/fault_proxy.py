"""A fault-injecting HTTP proxy on 127.0.0.1 in front of the S3 test server (tests/s3_server.py), for the tests of
what a cluster's object store does to a merge (tests/test_faults_s3.py): 503 SlowDown answers, connections dropped
without an answer, bodies cut midway (the real headers, the full Content-Length, half the bytes, then the socket
closes) and bodies dribbled slowly.

Deterministic and transient: each kind of fault strikes every Nth request it may strike (counted per kind, in
arrival order; a turn that falls on a request another kind already strikes passes to the next request this kind may
strike, so how many faults of each kind a run gets does not depend on how two ranks' requests interleave), and the
request that follows a fault on the same operation (method, path and query: a retry, or
the GET that continues a cut body) always passes. `cut_always` makes one fault permanent instead: every GET of an
object whose key holds that text is cut. The counters (`faults`, and `injected`: each fault's kind, path and
range) say what was injected, so a test can check that the faults it asked for happened.

Standard library only. A faulted request is never forwarded (the server never sees it, as with a real
SlowDown or a connection lost before the request arrived), so a retry is never a second copy of one. Request
bodies are relayed as they came (Content-Length or chunked, aws-chunked inside); `Expect: 100-continue` is
answered here. Loopback only, a timeout on every socket, stopped when its `with` block ends.
"""

from __future__ import annotations

import http.client
import socket
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import BinaryIO
from urllib.parse import urlsplit

TIMEOUT = 60  # seconds a socket may wait: nothing outlives a test by more
SLOWDOWN = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code><Message>Please reduce your '
            b"request rate.</Message><RequestId>fault-proxy</RequestId></Error>")


@dataclass(frozen=True, kw_only=True)
class FaultPlan:
    """Which requests fail: every Nth of those each kind may strike (0: never); `only`: a text the request's path
    must hold for any fault (e.g. "/models/": the output bucket's requests only)."""

    fail_503_every: int = 0  # any request: 503 SlowDown, S3's XML error body
    drop_every: int = 0  # any request: the connection closed, no answer
    cut_body_every: int = 0  # object GETs: the real headers, half the body, then the connection closed
    slow_body_every: int = 0  # object GETs: the body in pieces of SLOW_PIECE, SLOW_DELAY apart
    cut_always: str = ""  # object GETs of a key holding this: cut every time (a permanent fault)
    only: str = ""


SLOW_PIECE = 8 << 10
SLOW_DELAY = 0.002


@dataclass(frozen=True)
class Request:
    method: str
    target: str
    headers: list[tuple[str, str]]
    body: bytes  # as it came on the wire (chunked framing kept)

    def header(self, name: str) -> str:
        return next((v for k, v in self.headers if k.lower() == name), "")

    @property
    def path(self) -> str:
        return urlsplit(self.target).path

    @property
    def object_get(self) -> bool:
        """A GetObject: a GET of a key (not a bucket listing, no sub-resource query)."""
        return self.method == "GET" and self.path.count("/") >= 2 and not urlsplit(self.target).query


class FaultProxy:
    """The proxy's state: its plan, its counters, the operations whose last request was faulted."""

    def __init__(self, upstream: str, plan: FaultPlan) -> None:
        split = urlsplit(upstream)
        self.upstream = (split.hostname, split.port)
        self.plan = plan
        self.seen: Counter[str] = Counter()  # requests each kind could strike
        self.due: set[str] = set()  # kinds whose turn came on a request another kind struck: the next one is theirs
        self.faults: Counter[str] = Counter()  # faults injected, by kind: slowdown, dropped, cut, slow
        self.requests = 0
        self.injected: list[tuple[str, str, str]] = []  # (kind, path, range) of each fault, in order
        self.after_fault: set[tuple[str, str]] = set()
        self.open: set[socket.socket] = set()  # client connections being served
        self.lock = threading.Lock()

    def fault_for(self, req: Request) -> str:
        """The fault this request gets ("" for none), decided in arrival order."""
        op = (req.method, req.target)  # a continued body asks another range of the same operation
        with self.lock:
            self.requests += 1
            if self.plan.cut_always and req.object_get and self.plan.cut_always in req.path:
                kind = "cut"  # permanent: retries too
            elif op in self.after_fault:  # the retry of a faulted request: it passes
                self.after_fault.discard(op)
                return ""
            else:
                kind = self._kind(req)
            if kind:
                self.faults[kind] += 1
                self.injected.append((kind, req.path, req.header("range")))
                if kind != "slow":  # slow is no failure: nothing is retried
                    self.after_fault.add(op)
            return kind

    def _kind(self, req: Request) -> str:
        plan = self.plan
        if plan.only not in req.path:
            return ""
        chosen = ""
        kinds = [("dropped", plan.drop_every), ("slowdown", plan.fail_503_every)]
        if req.object_get:
            kinds += [("cut", plan.cut_body_every), ("slow", plan.slow_body_every)]
        for kind, every in kinds:
            if every:
                self.seen[kind] += 1
                if self.seen[kind] % every == 0:
                    self.due.add(kind)
                if not chosen and kind in self.due:
                    self.due.discard(kind)
                    chosen = kind
        return chosen

    # --- one client connection: requests in turn, each relayed or faulted -------------------------------------

    def serve(self, conn: socket.socket) -> None:
        conn.settimeout(TIMEOUT)
        with self.lock:
            self.open.add(conn)
        try:
            with conn, conn.makefile("rb") as rfile:
                while self._one(conn, rfile):
                    pass
        except (OSError, ValueError):
            pass  # the client went away, or the proxy stopped: nothing to answer
        finally:
            with self.lock:
                self.open.discard(conn)

    def close_all(self) -> None:
        """End every client connection (a client's pool keeps them open): their threads return."""
        with self.lock:
            for conn in self.open:
                with suppress(OSError):  # already closed by its client
                    conn.shutdown(socket.SHUT_RDWR)

    def _one(self, conn: socket.socket, rfile: BinaryIO) -> bool:
        """Serve one request; False when the connection is to be closed."""
        head = read_head(rfile)
        if head is None:
            return False
        method, target, headers = head
        waits = Request(method, target, headers, b"").header("expect").lower() == "100-continue"
        body = b"" if waits else read_body(rfile, headers)  # a client that waits is answered before it sends
        fault = self.fault_for(Request(method, target, headers, body))
        if fault == "dropped":
            return False
        if fault == "slowdown":
            conn.sendall(response_head(503, "Slow Down", [("Content-Type", "application/xml")], len(SLOWDOWN),
                                       close=True) + SLOWDOWN)
            return False  # a waiting client's body was never read: this connection is done
        if waits:
            conn.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
            headers = [(k, v) for k, v in headers if k.lower() != "expect"]
            body = read_body(rfile, headers)
        req = Request(method, target, headers, body)
        status, reason, answer, body = self.forward(req)
        if fault == "cut" and body:  # half of it (none of one byte)
            conn.sendall(response_head(status, reason, answer, len(body)) + body[: len(body) // 2])
            return False
        conn.sendall(response_head(status, reason, answer, len(body)))
        if method != "HEAD":
            self._send_body(conn, body, slow=fault == "slow")
        return True

    def _send_body(self, conn: socket.socket, body: bytes, slow: bool) -> None:
        if not slow:
            conn.sendall(body)
            return
        for at in range(0, len(body), SLOW_PIECE):
            conn.sendall(body[at : at + SLOW_PIECE])
            time.sleep(SLOW_DELAY)

    def forward(self, req: Request) -> tuple[int, str, list[tuple[str, str]], bytes]:
        """The server's answer to the request, relayed as it came; its body read whole (tests' objects are small)."""
        upstream = http.client.HTTPConnection(*self.upstream, timeout=TIMEOUT)
        try:
            upstream.putrequest(req.method, req.target, skip_host=True, skip_accept_encoding=True)
            for name, value in req.headers:
                upstream.putheader(name, value)
            upstream.endheaders(req.body or None)
            resp = upstream.getresponse()
            body = resp.read()
            kept = [(k, v) for k, v in resp.getheaders() if k.lower() not in ("transfer-encoding", "connection")]
            if req.method == "HEAD":
                return resp.status, resp.reason, kept, b""
            kept = [(k, v) for k, v in kept if k.lower() != "content-length"]
            return resp.status, resp.reason, kept, body
        finally:
            upstream.close()


def read_head(rfile: BinaryIO) -> tuple[str, str, list[tuple[str, str]]] | None:
    """The request line and headers; None at the end of the connection."""
    line = rfile.readline(65537)
    if not line.strip():
        return None
    method, target, _ = line.decode("latin-1").split(" ", 2)
    headers = []
    while (line := rfile.readline(65537)) not in (b"\r\n", b"\n", b""):
        name, _, value = line.decode("latin-1").partition(":")
        headers.append((name.strip(), value.strip()))
    return method, target, headers


def read_body(rfile: BinaryIO, headers: list[tuple[str, str]]) -> bytes:
    """The request's body as it came on the wire: Content-Length bytes, or chunks with their framing and trailer."""
    fields = {k.lower(): v for k, v in headers}
    if "chunked" in fields.get("transfer-encoding", "").lower():
        raw = bytearray()
        while True:
            size_line = rfile.readline(65537)
            raw += size_line
            size = int(size_line.split(b";")[0].strip(), 16)
            if size == 0:
                while (line := rfile.readline(65537)) not in (b"\r\n", b"\n", b""):  # trailers
                    raw += line
                return bytes(raw + b"\r\n")
            raw += rfile.read(size + 2)
    return rfile.read(int(fields.get("content-length", 0)))


def response_head(status: int, reason: str, headers: list[tuple[str, str]], length: int,
                  close: bool = False) -> bytes:
    """The status line and headers; Content-Length `length` unless the headers have one (a HEAD's, relayed)."""
    lines = [f"HTTP/1.1 {status} {reason}", *(f"{k}: {v}" for k, v in headers)]
    if not any(k.lower() == "content-length" for k, _ in headers):
        lines.append(f"Content-Length: {length}")
    if close:
        lines.append("Connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


@contextmanager
def fault_proxy(upstream: str, plan: FaultPlan) -> Iterator[tuple[str, FaultProxy]]:
    """Run the proxy for the block: yields its endpoint (for AWS_ENDPOINT_URL_S3) and its state (counters)."""
    proxy = FaultProxy(upstream, plan)
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.2)
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=proxy.serve, args=(conn,), daemon=True).start()

    acceptor = threading.Thread(target=accept, daemon=True)
    acceptor.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}", proxy
    finally:
        stop.set()
        acceptor.join(timeout=5)
        listener.close()
        proxy.close_all()

"""Rank 0 working alone while other ranks answer its requests: discovery and finalize of an input spread over the
nodes' own disks, where rank 0 reads a file another node holds (a marker, DCP's `.metadata`, the config folder)
by asking that node's first rank for its bytes (input/nodes.py).

    who              what                                               messages (the Comm's gloo group)
    rank 0           work(ask): each ask(server, request) is answered   send_object_list, recv_object_list
    servers          answer each request until rank 0 says it is done   recv_object_list, send_object_list
    every rank       rank 0's result, or its error, as Comm.root_only   broadcast

A server's failure to answer (a file changed since it was listed) is rank 0's error, raised on every rank with
the others of root_only; rank 0 tells every server it is done whatever happened, so none waits on.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from distmerge import errors
from distmerge.distributed.comm import Comm
from distmerge.errors import DistmergeError
from distmerge.input import source as input_source

T = TypeVar("T")
Ask = Callable[[int, Any], Any]  # (server rank, request) -> its answer
DONE = None  # what rank 0 sends a server when it needs no more


def root_only_serving(comm: Comm, work: Callable[[Ask | None], T], answer: Callable[[Any], Any] | None,
                      servers: tuple[int, ...]) -> T:
    """Collective: `work(ask)` on rank 0 while each rank of `servers` answers its requests with `answer(request)`
    (`answer` is that rank's own: None elsewhere); then the result, or rank 0's error, on every rank."""
    if comm.world == 1 or not servers:
        return comm.root_only(lambda: work(None))
    if comm.rank in servers:
        _serve(comm, answer)
    return comm.root_only(lambda: _asking(comm, work, servers))


def _asking(comm: Comm, work: Callable[[Ask], T], servers: tuple[int, ...]) -> T:
    try:
        return work(lambda server, request: _ask(comm, server, request))
    finally:
        for server in servers:
            _send(comm, DONE, server)


def _ask(comm: Comm, server: int, request: Any) -> Any:
    _send(comm, request, server)
    ok, value = _receive(comm, server)
    if ok:
        return value
    kind, message = value
    raise getattr(errors, kind, DistmergeError)(message)


def _serve(comm: Comm, answer: Callable[[Any], Any] | None) -> None:
    """Answer rank 0's requests until it is done: each answer (True, value) or (False, (error class, message))."""
    assert answer is not None, "a server rank answers with its own function"
    while (request := _receive(comm, 0)) is not DONE:
        try:
            reply = (True, answer(request))
        except DistmergeError as err:
            reply = (False, (type(err).__name__, input_source.shown(str(err))))
        except Exception as err:  # noqa: BLE001  (a bug or a fault: one line on rank 0, which raises it everywhere)
            reply = (False, ("DistmergeError", f"internal error on rank {comm.rank} answering rank 0: "
                                               f"{type(err).__name__}: {err} (rerun with --debug)"))
        _send(comm, reply, 0)


def _send(comm: Comm, obj: Any, to: int) -> None:
    import torch.distributed as dist

    dist.send_object_list([obj], dst=dist.get_global_rank(comm.control, to), group=comm.control)


def _receive(comm: Comm, frm: int) -> Any:
    import torch.distributed as dist

    box = [None]
    dist.recv_object_list(box, src=dist.get_global_rank(comm.control, frm), group=comm.control)
    return box[0]

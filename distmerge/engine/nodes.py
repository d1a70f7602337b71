"""A merge whose ranks run on several nodes, each node's disk holding what the training job left there: the nodes
found, every node's listing of each input joined into one, rank 0's reads of other nodes' files answered by them.

    who                       what                                                    collective
    every rank                its node (tree.node_key)                                all_gather (find)
    the first rank of a node  walks each local input as its node sees it              all_gather (spread_inputs)
    rank 0                    one NodesSource per local input over the joined walks
    rank 0, others serving    discovery and finalize (`Spread.root_only`): a file     send/recv per read, then
                              another node holds is read by asking that node          broadcast (requests.py)
    every rank                the plan reads each file on a node that holds it        (placement.Placement)
                              (`placement`) and owns each output file near its reads

With one node none of this runs: the merge is the one-node merge, byte for byte and call for call.
"""

from __future__ import annotations

import os
import secrets
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

from distmerge.distributed import requests
from distmerge.distributed.comm import Comm
from distmerge.engine.inputs import InputSpec
from distmerge.engine.placement import Placement
from distmerge.errors import OutputError
from distmerge.formats.base import Scan
from distmerge.input import source
from distmerge.input.nodes import Answers, NodesSource, list_here, same_files
from distmerge.input.tree import node_key
from distmerge.output.names import NODES_PROBE
from distmerge.output.store import Store

T = TypeVar("T")


@dataclass(frozen=True, kw_only=True)
class Nodes:
    """The nodes of this merge: node 0 is rank 0's, the others numbered by their lowest rank."""

    keys: tuple[str, ...]  # node -> node_key
    of_rank: tuple[int, ...]  # rank -> node
    hosts: tuple[str, ...] = ()  # node -> its host name, as messages name it

    def named(self, which: list[int]) -> str:
        """Nodes as a person finds them: "node 1 (host a, ranks 2-3)"."""
        def one(n: int) -> str:
            ranks = [str(r) for r, m in enumerate(self.of_rank) if m == n]
            host = f"host {self.hosts[n]}, " if self.hosts else ""
            return f"node {n} ({host}rank{'s' if len(ranks) > 1 else ''} {', '.join(ranks)})"
        return "; ".join(one(n) for n in which)

    @property
    def many(self) -> bool:
        return len(self.keys) > 1

    def first_rank(self, node: int) -> int:
        return self.of_rank.index(node)

    @property
    def servers(self) -> tuple[int, ...]:
        """The ranks that answer rank 0's reads: the first of each node but rank 0's."""
        return tuple(self.first_rank(n) for n in range(1, len(self.keys)))


def find(comm: Comm) -> Nodes:
    """Collective: every rank's node."""
    found = comm.gather(lambda: (node_key(), socket.gethostname()))
    order = list(dict.fromkeys(key for key, _ in found))
    hosts = {key: host for key, host in found}
    return Nodes(keys=tuple(order), of_rank=tuple(order.index(key) for key, _ in found),
                 hosts=tuple(hosts[key] for key in order))


@dataclass(kw_only=True)
class Spread:
    """This rank's part in a merge over several nodes: the nodes, the sources rank 0 discovers by, the answers this
    rank gives when it is its node's first."""

    nodes: Nodes
    sources: dict[str, NodesSource] = field(default_factory=dict)  # rank 0: location as given -> its source
    answers: Answers | None = None  # the first rank of a node but rank 0's
    asking: list[requests.Ask] = field(default_factory=list)  # rank 0, while others serve: how to ask

    def input_of(self, spec: InputSpec) -> InputSpec:
        """What rank 0 discovers by: each input that is a local folder as its joined source (a joined --hf-config or
        --base-model folder is looked up by its path: spread_inputs)."""
        return replace(spec, locations=tuple(self.sources.get(str(where), where) for where in spec.locations))

    def root_only(self, comm: Comm, work: Callable[[], T]) -> T:
        """Collective: `work` on rank 0 while the other nodes answer its reads of their files (requests.py)."""
        def served(ask: requests.Ask | None) -> T:
            self.asking[:] = [ask] if ask is not None else []
            try:
                return work()
            finally:
                self.asking.clear()

        answer = self.answers.answer if self.answers is not None else None
        return requests.root_only_serving(comm, served, answer, self.nodes.servers)

    def fetch(self, location: str) -> Callable[[int, str, int, int], bytes]:
        """Rank 0's read of `location`'s file `rel` on `node`: a request to that node's first rank."""
        def read(node: int, rel: str, offset: int, nbytes: int) -> bytes:
            assert self.asking, "another node's file is read only while the nodes answer (Spread.root_only)"
            return self.asking[0](self.nodes.first_rank(node), (location, rel, offset, nbytes))

        return read

    def close(self) -> None:
        if self.answers is not None:
            self.answers.close()

    def comm(self, comm: Comm) -> NodesComm:
        return NodesComm(comm, self)


class NodesComm:
    """A Comm whose root_only lets the other nodes answer rank 0's reads of their files (Spread.root_only): what
    merge and verify hand their phases, so that discovery, the pairing of verify's sides and finalize read the
    joined folder; every other call is the Comm's own."""

    def __init__(self, comm: Comm, spread: Spread) -> None:
        self.base, self.spread = comm, spread

    def root_only(self, work: Callable[[], T]) -> T:
        return self.spread.root_only(self.base, work)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.base, name)


def nodes_of(comm: Comm | NodesComm) -> Nodes | None:
    """The nodes of a merge over several (a NodesComm), else None."""
    return comm.spread.nodes if isinstance(comm, NodesComm) else None


def placement_of(comm: Comm | NodesComm, scan: Scan, may_own: tuple[int, ...] = ()) -> Placement | None:
    """The placement of a scan's files when the ranks are on several nodes (a NodesComm), else None. `may_own`: the
    nodes whose ranks may own output files (() any)."""
    return replace(placement(scan, comm.spread.nodes), may_own=may_own) if isinstance(comm, NodesComm) else None


def each_node(comm: Comm, work: Callable[[], T]) -> list[T] | None:
    """Collective: `work()` on the first rank of each node, every node's result on every rank (node order); None
    when every rank is on one node (nothing is run then)."""
    nodes = find(comm) if comm.world > 1 else None
    if nodes is None or not nodes.many:
        return None
    first = comm.rank == nodes.first_rank(nodes.of_rank[comm.rank])
    found = comm.gather(lambda: work() if first else None)
    return [found[nodes.first_rank(n)] for n in range(len(nodes.keys))]


def spread_inputs(comm: Comm, locations: list[Any]) -> Spread | None:
    """Collective: the local folders among `locations` (the inputs, --hf-config, --base-model) listed by each node
    and joined on rank 0; None when every rank is on one node (the one-node merge, unchanged)."""
    nodes = find(comm) if comm.world > 1 else None
    if nodes is None or not nodes.many:
        return None
    local = [str(where) for where in locations if _local_folder(where)]
    first = comm.rank == nodes.first_rank(nodes.of_rank[comm.rank])
    listed = comm.gather(lambda: {where: list_here(where) for where in local} if first else None)
    spread = Spread(nodes=nodes)
    if first and comm.rank != 0:
        spread.answers = Answers({w: lst.tree for w, lst in listed[comm.rank].items() if lst.tree is not None})
    by_node = [listed[nodes.first_rank(n)] for n in range(len(nodes.keys))]
    # a folder every node lists alike is shared (or copied alike): read as on one node; the others are joined on
    # rank 0 (a folder no node holds is refused there), and every rank learns of a refusal
    apart = [where for where in local if not same_files([b[where] for b in by_node])]
    spread.sources = comm.agree(lambda: {where: NodesSource(where, [b[where] for b in by_node], list(nodes.keys), 0,
                                                            spread.fetch(where)) for where in apart}
                                if comm.rank == 0 else {})
    # every joined folder stands in this merge's session on rank 0: discovery and finalize look a --hf-config folder
    # up by its path, verify a finished model's files
    source.session().standing = list(spread.sources.values())
    return spread


def _local_folder(where: Any) -> bool:
    return where is not None and not source.is_source(where) and not source.is_url(str(where))


def placement(scan: Scan, nodes: Nodes) -> Placement:
    """Each input file's possible readers: the ranks of the nodes that hold it, by the scan's records (local.Walked:
    an average's inputs each by their own); any rank for a file no record places (an object store's, a shared
    --base-model folder's)."""
    ranks_of = {key: tuple(r for r, n in enumerate(nodes.of_rank) if nodes.keys[n] == key) for key in nodes.keys}
    walked_of = {str(s.root): s.walked for s in (scan, *(p.scan for p in scan.parts))}
    if scan.base_walked is not None:
        walked_of[scan.base_walked.root] = scan.base_walked
    may_read = []
    for f in scan.files:
        root = f.root or str(scan.root)
        walked = walked_of.get(root)
        path = os.path.abspath(Path(root) / f.path)
        holders = [key for key, files in (walked.nodes.items() if walked is not None else ()) if path in files.files]
        may_read.append(tuple(sorted(r for key in holders for r in ranks_of[key])))
    return Placement(node_of_rank=nodes.of_rank, may_read=tuple(may_read))


def check_output_shared(comm: NodesComm, store: Store, nodes: Nodes) -> None:
    """Collective, before anything but the lock is written: rank 0 writes a probe into the output and the first
    rank of every node reads it back. An output some nodes do not see (a node-local disk) is refused on every rank
    in one line naming them."""
    token = comm.root_only(lambda: _write_probe(store))
    first = comm.rank == nodes.first_rank(nodes.of_rank[comm.rank])
    try:
        seen = comm.gather(lambda: store.read(NODES_PROBE) == token if first else True)
    finally:
        comm.root_only(lambda: store.remove(NODES_PROBE))
    blind = [n for n in range(len(nodes.keys)) if not seen[nodes.first_rank(n)]]
    comm.root_only(lambda: _refuse_blind(store, nodes, blind))  # rank 0 says it, every rank raises it as one


def _refuse_blind(store: Store, nodes: Nodes, blind: list[int]) -> None:
    if blind:
        raise OutputError(f"output {store.url} is not shared: {nodes.named(blind)} cannot see what rank 0 writes "
                          "there (a node-local disk); write the output to a folder every node shares, or a bucket")


def _write_probe(store: Store) -> bytes:
    token = f"{os.getpid()}-{time.time_ns()}-{secrets.token_hex(8)}".encode()
    store.write_small(NODES_PROBE, token)
    return token

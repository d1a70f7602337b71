"""The import's files, written by several processes: each file created at its full size by its owner (the plan's
`owners`), each tensor's chunks written by the one process that makes that tensor, at the places the plan gave
their blobs (place.py), and each file committed by its owner once every process has written its part.

Call order, every rank (write_files runs it):

    hosts    every rank the output's machine as this rank sees it        all_gather (store.host): one, or refused
    create   owners     each file it owns made at its size through the store (output/store.py: a shared file),
                        its objects' blobs written, and its tensors made of no source (zeros: a torchtitan
                        buffer Hugging Face has no place for)            all_gather of the files' tokens
    write    makers     `write_mine(out)`: each chunk's blob at its place (Output.put), the file joined on first use;
                        a folder's tensors by their makers (tensor_makers), a checkpoint's by the merge engine's
                        owners (sink.py)
    finish   every rank what it wrote made durable                         all_gather of the receipts
    commit   owners     each file visible under its name                   all_gather (errors)

A tensor's chunks are made by one process: the chunks of a column split share their rows, read once (read.py).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from typing import Any

import torch

from distmerge import dtypes
from distmerge.distributed.comm import Comm
from distmerge.errors import ConfigError
from distmerge.formats.megatron.dist_layout import Chunk
from distmerge.formats.torch_private.dcp import write as dcp
from distmerge.importer.discover import Model
from distmerge.importer.place import Placed, object_bytes, place
from distmerge.importer.plan import ImportPlan
from distmerge.importer.read import Files, RowReader, chunk_tensors
from distmerge.output.store import FileLayout, OutFile, Store
from distmerge.threads import one_thread


class Output:
    """This rank's handles on the import's files: the ones it owns (created) and the ones it joined to write in."""

    def __init__(self, plan: ImportPlan, store: Store, folder: str, rank: int) -> None:
        self.plan, self.store, self.folder, self.rank = plan, store, folder, rank
        dtype_of = {name: t.dtype for name, t in plan.tensors.items()}
        self.placed = [place(f, dtype_of) for f in plan.files]
        self.file_of = {(c.key, c.offsets): i for i, f in enumerate(plan.files) for c in f.chunks}
        self.at = {k: e for p in self.placed for k, e in p.chunk_at().items()}
        self.chunks_of: dict[str, list[Chunk]] = {}  # Megatron tensor -> its chunks, in file order
        for f in plan.files:
            for chunk in f.chunks:
                self.chunks_of.setdefault(chunk.tensor, []).append(chunk)
        self.tokens: dict[int, Any] = {}
        self.handles: dict[int, OutFile] = {}

    def entries(self) -> list[dcp.Entry]:
        return [e for p in self.placed for e in p.entries]

    def create_owned(self) -> dict[int, Any]:
        """Owners: their files at full size, objects and source-less tensors written; returns each one's token
        for the other writers."""
        blob = memoryview(object_bytes())
        for i, (p, owner) in enumerate(zip(self.placed, self.plan.owners, strict=True)):
            if owner == self.rank:
                self.handles[i] = handle = self.store.create(self._layout(p), self.rank)
                for e in p.entries:
                    if e.dtype is None:
                        handle.pwrite(blob, e.offset)
                for chunk in self.plan.files[i].chunks:
                    if not self.plan.tensors[chunk.tensor].sources:
                        self.put(chunk, zeros(self.plan.tensors[chunk.tensor].dtype, chunk.lengths))
        return {i: h.token for i, h in self.handles.items()}

    def put(self, chunk: Chunk, tensor: torch.Tensor) -> None:
        """The chunk's blob at its planned place."""
        i, entry = self.file_of[(chunk.key, chunk.offsets)], self.at[(chunk.key, chunk.offsets)]
        blob = dcp.tensor_blob(tensor)
        assert len(blob) == entry.length, f"{chunk.key}: blob of {len(blob)} bytes, placed {entry.length}"
        if i not in self.handles:
            self.handles[i] = self.store.join(self._layout(self.placed[i]), self.rank, self.tokens.get(i))
        self.handles[i].pwrite(memoryview(blob), entry.offset)

    def finish(self) -> dict[int, Any]:
        """Every file this rank wrote in, durable; returns the receipts its owners commit with."""
        return {i: h.finish() for i, h in self.handles.items()}

    def commit_owned(self, receipts: list[dict[int, Any]]) -> None:
        for i, handle in self.handles.items():
            if self.plan.owners[i] == self.rank:
                handle.commit([r[i] for r in receipts if i in r])

    def abort(self) -> None:
        for handle in self.handles.values():
            handle.abort()

    def _layout(self, p: Placed) -> FileLayout:
        return FileLayout(name=f"{self.folder}/{p.name}", header=b"", size=p.size, runs=(), shared=True)


def write_files(plan: ImportPlan, store: Store, folder: str, comm: Comm,
                write_mine: Callable[[Output], None]) -> list[dcp.Entry]:
    """Collective: the plan's files written into `folder` of the output (the call order above); returns the
    entries `.metadata` needs, the same on every rank."""
    if len(set(comm.gather(store.host))) > 1:
        raise ConfigError("distmerge import writes each file of its output from several processes, which needs "
                          "them on one machine: run it with the processes of one node")
    out = Output(plan, store, folder, comm.rank)
    try:
        for made in comm.gather(out.create_owned):
            out.tokens.update(made)
        write_mine(out)
        receipts = comm.gather(out.finish)
        comm.gather(lambda: out.commit_owned(receipts))
    except BaseException:
        out.abort()
        raise
    return out.entries()


def zeros(dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor made of no source: zeros (the one value a table declares, tables.Row.init)."""
    return torch.zeros(shape, dtype=dtypes.torch_dtype(dtype))


def write_tensors(plan: ImportPlan, names: list[str], rows: RowReader, out: Output) -> None:
    """Each Megatron tensor of `names`, every chunk of it, into its place. Copies of a few MB each (rows joined,
    a blob's own storage): on one thread, as a second only waits beside other busy processes (threads.py)."""
    with one_thread():
        for name in names:
            for chunk, tensor in chunk_tensors(plan.tensors[name], out.chunks_of[name], rows):
                out.put(chunk, tensor)


def tensor_makers(plan: ImportPlan, world: int) -> dict[str, int]:
    """The process that makes each Megatron tensor's chunks from a folder: the least loaded, largest first (ties:
    the name, the lower rank). A tensor's chunks go to one process, so each byte is read once; a tensor of no
    source is its file owner's (Output.create_owned)."""
    size = {n: math.prod(t.shape) * dtypes.itemsize(t.dtype) for n, t in plan.tensors.items() if t.sources}
    heap = [(0, rank) for rank in range(world)]
    out = {}
    for name in sorted(size, key=lambda n: (-size[n], n)):
        load, rank = heapq.heappop(heap)
        out[name] = rank
        heapq.heappush(heap, (load + size[name], rank))
    return out


def from_folder(plan: ImportPlan, files: Files, comm: Comm) -> Callable[[Output], None]:
    """write_files' `write_mine` for a Hugging Face folder: this rank's tensors (tensor_makers), read by rows."""
    makers = tensor_makers(plan, comm.world)
    mine = sorted(n for n, r in makers.items() if r == comm.rank)
    return lambda out: comm.gather(lambda: write_tensors(plan, mine, files.rows, out))


def write_folder(plan: ImportPlan, model: Model, store: Store, folder: str, comm: Comm) -> list[dcp.Entry]:
    """Collective: write_files for a Hugging Face folder `model`, its files opened and closed here."""
    files = Files(model)
    try:
        return write_files(plan, store, folder, comm, from_folder(plan, files, comm))
    finally:
        files.close()

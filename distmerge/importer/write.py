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

A store that takes any byte from any process (a folder: pwrite at any offset; its `sharing`, output/store.py) is
written by the makers, as above. An object store takes each part of an upload from the one writer the layout's
runs name, in parts of at least `sharing.min_run` bytes, which the makers' blobs (any size, any process) are not:
there each file is written by its owner alone (`owners_alone`), its chunks in file order (`write_owned`), so that
its parts fill one after another and are sent as they fill (memory: a few parts, not the file). The files' bytes
are the plan's either way (place.py): the same objects as the folder's files.
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
from distmerge.importer.place import object_bytes, place
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
        self.owners_alone = owners_alone(store)

    def entries(self) -> list[dcp.Entry]:
        return [e for p in self.placed for e in p.entries]

    def create_owned(self) -> dict[int, Any]:
        """Owners: their files at full size, objects and source-less tensors written; returns each one's token
        for the other writers."""
        blob = memoryview(object_bytes())
        for i, (p, owner) in enumerate(zip(self.placed, self.plan.owners, strict=True)):
            if owner == self.rank:
                self.handles[i] = handle = self.store.create(self._layout(i), self.rank)
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
            self.handles[i] = self.store.join(self._layout(i), self.rank, self.tokens.get(i))
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

    def _layout(self, i: int) -> FileLayout:
        p = self.placed[i]
        name = f"{self.folder}/{p.name}"
        if self.owners_alone:  # one run, its owner's: the store sends the file as that one writer's parts
            return FileLayout(name=name, header=b"", size=p.size, runs=((0, p.size, self.plan.owners[i]),),
                              shared=False)
        return FileLayout(name=name, header=b"", size=p.size, runs=(), shared=True)


def owners_alone(store: Store) -> bool:
    """Whether each file must be written by its owner alone: the store takes a file's bytes only as runs planned
    ahead, each at least `min_run` long (an object store's parts), or never from several processes."""
    return store.sharing.within == "none" or store.sharing.min_run > 0


def write_files(plan: ImportPlan, store: Store, folder: str, comm: Comm,
                write_mine: Callable[[Output], None]) -> list[dcp.Entry]:
    """Collective: the plan's files written into `folder` of the output (the call order above); returns the
    entries `.metadata` needs, the same on every rank."""
    if not owners_alone(store) and len(set(comm.gather(store.host))) > 1:
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


def write_owned(plan: ImportPlan, rows: RowReader, out: Output) -> None:
    """Every chunk of the files this rank owns, in file order (Output.owners_alone): each chunk's rows read for it
    alone (a row split's TP chunks, in the files of several owners, each read their rows at full width)."""
    with one_thread():
        for i, f in enumerate(plan.files):
            if plan.owners[i] != out.rank:
                continue
            for chunk in f.chunks:  # the file's order: place.py lays the blobs out in this order
                made = plan.tensors[chunk.tensor]
                if made.sources:  # a tensor of no source is written at the file's creation (create_owned)
                    for cut, tensor in chunk_tensors(made, [chunk], rows):
                        out.put(cut, tensor)


def from_folder(plan: ImportPlan, files: Files, comm: Comm) -> Callable[[Output], None]:
    """write_files' `write_mine` for a Hugging Face folder, read by rows: this rank's tensors (tensor_makers), or
    where the store takes each file from its owner alone, the chunks of the files it owns."""
    makers = tensor_makers(plan, comm.world)
    mine = sorted(n for n, r in makers.items() if r == comm.rank)

    def write_mine(out: Output) -> None:
        if out.owners_alone:
            comm.gather(lambda: write_owned(plan, files.rows, out))
        else:
            comm.gather(lambda: write_tensors(plan, mine, files.rows, out))
    return write_mine


def write_folder(plan: ImportPlan, model: Model, store: Store, folder: str, comm: Comm) -> list[dcp.Entry]:
    """Collective: write_files for a Hugging Face folder `model`, its files opened and closed here."""
    files = Files(model)
    try:
        return write_files(plan, store, folder, comm, from_folder(plan, files, comm))
    finally:
        files.close()

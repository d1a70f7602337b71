"""Owners: each file of the plan a process owns, written blob after blob through the output store, and the
entries `.metadata` needs (where each blob lies) handed back to rank 0."""

from __future__ import annotations

from distmerge import dtypes
from distmerge.formats.megatron.dist_layout import EXTRA_STATE_OBJECT
from distmerge.formats.torch_private.dcp import write as dcp
from distmerge.importer.discover import Model
from distmerge.importer.plan import DistFile, ImportPlan
from distmerge.importer.read import Files, chunk_tensor
from distmerge.output.store import FileLayout, Store


def write_owned(plan: ImportPlan, model: Model, store: Store, folder: str, rank: int) -> list[dcp.Entry]:
    """Write the files `rank` owns into `folder` of the output; returns their entries."""
    files = Files(model.root)
    try:
        out: list[dcp.Entry] = []
        for f, owner in zip(plan.files, plan.owners, strict=True):
            if owner == rank:
                out += _write_file(plan, model, store, f"{folder}/{f.name}", f, files, rank)
        return out
    finally:
        files.close()


def _write_file(plan: ImportPlan, model: Model, store: Store, name: str, f: DistFile, files: Files,
                rank: int) -> list[dcp.Entry]:
    handle = store.create(FileLayout(name=name, header=b"", size=0, runs=()), rank)
    entries, at = [], 0
    try:
        for obj in f.objects:
            blob = dcp.object_blob(EXTRA_STATE_OBJECT)
            handle.pwrite(memoryview(blob), at)
            entries.append(dcp.Entry(key=obj.key, file=f.name, offset=at, length=len(blob)))
            at += len(blob)
        for chunk in f.chunks:
            made = plan.tensors[chunk.tensor]
            blob = dcp.tensor_blob(chunk_tensor(chunk, made, model, files))
            handle.pwrite(memoryview(blob), at)
            entries.append(dcp.Entry(key=chunk.key, file=f.name, offset=at, length=len(blob),
                                     dtype=dtypes.torch_dtype(made.dtype), global_shape=chunk.global_shape,
                                     offsets=chunk.offsets, lengths=chunk.lengths))
            at += len(blob)
        handle.finish()
        handle.commit([])
    except BaseException:
        handle.abort()
        raise
    return entries

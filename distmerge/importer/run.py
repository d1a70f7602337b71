"""The import's phases in order (the package docstring), on every rank of a Comm, under the output's lock.

    rank 0       discover, plan (every refusal: nothing written yet), lock, check and prepare the output
                 broadcast of the model found
    every rank   the plan (the same everywhere), the files it owns written
                 all_gather of the entries
    rank 0       finalize: .metadata, metadata.json, common.pt, the tracker last
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from distmerge.distributed.comm import Comm
from distmerge.importer import finalize as fin
from distmerge.importer.discover import Model, discover_config
from distmerge.importer.megatron_args import common_state, megatron_args
from distmerge.importer.plan import ImportPlan, Layout, check_layout, make_plan
from distmerge.importer.source import open_input
from distmerge.importer.write import write_files
from distmerge.output import lock, open_store
from distmerge.output.lock import Lease
from distmerge.output.store import Store


@dataclass(frozen=True, kw_only=True)
class ImportOptions:
    input: Path
    output: Path
    layout: Layout
    overwrite: bool = False
    hf_config: Path | None = None  # config.json's folder, for an input that is a training checkpoint (source.py)


@dataclass(frozen=True, kw_only=True)
class ImportResult:
    files: int  # .distcp files written
    tensors: int  # Megatron tensors
    chunks: int
    nbytes: int  # tensor bytes written
    padded_vocab: int
    seconds: float
    processes: int


def run_import(opts: ImportOptions, comm: Comm) -> ImportResult:
    """Collective: the import of a Hugging Face folder, or of a training checkpoint read in one pass (source.py)."""
    start = time.perf_counter()
    store = open_store(opts.output)
    held: list[Lease] = []
    unregister = comm.on_abort(lambda: _release(held))
    source = None
    try:
        comm.phase("discovery")
        source = open_input(opts.input, opts.hf_config, comm, lambda: _refuse_early(opts),
                            lambda model: make_plan(model, opts.layout, 1))
        model = source.open(comm)
        comm.root_only(lambda: _discover(opts, store, held, model))
        plan = make_plan(model, opts.layout, comm.world)  # rank 0 made it already: it cannot fail here
        comm.phase("writing")
        entries = write_files(plan, store, fin.RELEASE, comm, source.writer(plan, comm))
        comm.phase("finalize")
        comm.agree(lambda: _finalize(opts, store, model, plan, entries, held) if comm.rank == 0 else None)
    finally:
        if source is not None:
            source.close()
        unregister()
        _release(held)
    return ImportResult(files=len(plan.files), tensors=len(plan.tensors), chunks=sum(len(f.chunks) for f in plan.files),
                        nbytes=sum(f.nbytes for f in plan.files), padded_vocab=plan.sizes.padded_vocab,
                        seconds=time.perf_counter() - start, processes=comm.world)


def _refuse_early(opts: ImportOptions) -> None:
    """Rank 0, before a checkpoint input is opened (source.py): an output the import may not write, and with
    --hf-config, a TP, PP or EP its config.json does not allow; the rest is judged on the checkpoint's tensors."""
    store = open_store(opts.output)
    store.check(str(opts.input), opts.overwrite)
    if opts.hf_config is not None:
        check_layout(discover_config(opts.hf_config), opts.layout)


def _discover(opts: ImportOptions, store: Store, held: list[Lease], model: Model) -> None:
    """Rank 0, the model found: the plan made (each refusal here, before the output is touched), then the
    output's lock, the output checked under it and made ready (a stale tracker removed first)."""
    make_plan(model, opts.layout, 1)
    store.check_place(model.root)
    held.append(lock.take(store.lock(), lock.this_process(model.root), store.url, take_over=opts.overwrite,
                          say=lambda line: None))
    store.check(model.root, opts.overwrite)
    store.prepare(keep_finished=False)
    store.remove(fin.TRACKER)
    for name in store.list(f"{fin.RELEASE}/*"):
        store.remove(name)


def _finalize(opts: ImportOptions, store: Store, model: Model, plan: ImportPlan, entries: list, held: list[Lease]
              ) -> None:
    for lease in held:
        lease.check(store.url)  # the output is still this import's
    dtype = next(iter(plan.tensors.values())).dtype
    fin.finalize(store, entries, common_state(megatron_args(model.config, plan, opts.layout, dtype)))


def _release(held: list[Lease]) -> None:
    while held:
        held.pop().release()

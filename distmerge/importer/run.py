"""The import's phases in order (the package docstring), on every rank of a Comm, under the output's lock, for
any training layout (targets.py: what differs between them is declared there, never tested for here).

    rank 0       discover, plan (every refusal: nothing written yet), lock, check and prepare the output
                 broadcast of the model found
    every rank   the plan (the same everywhere), the files it owns written
                 all_gather of the entries
    rank 0       finalize: the target's last files, its marker of a finished import last
"""

from __future__ import annotations

import time

from distmerge.distributed.comm import Comm
from distmerge.importer.discover import Model, discover_config
from distmerge.importer.request import ImportOptions, ImportResult
from distmerge.importer.source import open_input
from distmerge.importer.targets import TARGETS, Target
from distmerge.importer.write import write_files
from distmerge.output import lock, open_store
from distmerge.output.lock import Lease
from distmerge.output.store import Store


def run_import(opts: ImportOptions, comm: Comm) -> ImportResult:
    """Collective: the import of a Hugging Face folder, or of a training checkpoint read in one pass (source.py), in
    the layout opts.to names. Every refusal is raised on every rank, before anything is written."""
    start = time.perf_counter()
    target = TARGETS[opts.to]
    target.check_options(opts)
    store = open_store(opts.output)
    held: list[Lease] = []
    unregister = comm.on_abort(lambda: _release(held))
    source = None
    try:
        comm.phase("discovery")
        source = open_input(opts.input, opts.hf_config, comm, lambda: _refuse_early(target, opts),
                            lambda model: target.plan(model, opts.layout, 1))
        model = source.open(comm)
        comm.root_only(lambda: _discover(target, opts, store, held, model))
        plan = target.plan(model, opts.layout, comm.world)  # rank 0 made it already: it cannot fail here
        comm.phase("writing")
        entries = write_files(plan, store, target.folder, comm, source.writer(plan, comm))
        comm.phase("finalize")
        comm.agree(lambda: _finalize(target, opts, store, model, plan, entries, held) if comm.rank == 0 else None)
    finally:
        if source is not None:
            source.close()
        unregister()
        _release(held)
    return ImportResult(files=len(plan.files), tensors=len(plan.tensors), chunks=sum(len(f.chunks) for f in plan.files),
                        nbytes=sum(f.nbytes for f in plan.files), padded_vocab=target.padded_vocab(plan),
                        seconds=time.perf_counter() - start, processes=comm.world)


def summary(result: ImportResult, opts: ImportOptions) -> str:
    """The line rank 0 prints after the import."""
    return TARGETS[opts.to].summary(result, opts)


def _refuse_early(target: Target, opts: ImportOptions) -> None:
    """Rank 0, before a checkpoint input is opened (source.py): an output the import may not write, and with
    --hf-config, a layout its config.json does not allow; the rest is judged on the checkpoint's tensors."""
    store = open_store(opts.output)
    store.check(str(opts.input), opts.overwrite)
    if opts.hf_config is not None:
        target.check_config(discover_config(opts.hf_config), opts.layout)


def _discover(target: Target, opts: ImportOptions, store: Store, held: list[Lease], model: Model) -> None:
    """Rank 0, the model found: the plan made (each refusal here, before the output is touched), then the
    output's lock, the output checked under it and made ready (a stale marker removed first, then the files)."""
    target.plan(model, opts.layout, 1)
    store.check_place(model.root)
    held.append(lock.take(store.lock(), lock.this_process(model.root), store.url, take_over=opts.overwrite,
                          say=lambda line: None))
    store.check(model.root, opts.overwrite)
    store.prepare(keep_finished=False)
    store.remove(target.marker)
    for name in store.list(f"{target.folder}/*"):
        store.remove(name)


def _finalize(target: Target, opts: ImportOptions, store: Store, model: Model, plan, entries: list,
              held: list[Lease]) -> None:
    for lease in held:
        lease.check(store.url)  # the output is still this import's
    target.finalize(store, model, plan, entries, opts.layout)


def _release(held: list[Lease]) -> None:
    while held:
        held.pop().release()

"""The import's phases in order (the package docstring), on every rank of a Comm, under the output's lock, for
any training layout (targets.py: what differs between them is declared there, never tested for here).

    rank 0       walk the input (a folder or an object store: input/source.py), discover, plan (every refusal:
                 nothing written yet), lock, check and prepare the output (a folder or an object store:
                 output/store.py)
                 broadcast of the model found
    every rank   the plan (the same everywhere), the files it owns written
                 all_gather of the entries
    rank 0       finalize: the target's last files, its marker of a finished import last
"""

from __future__ import annotations

import time

from distmerge.distributed.comm import Comm
from distmerge.errors import ConfigError
from distmerge.importer.discover import Model, discover_config
from distmerge.importer.request import ImportOptions, ImportResult
from distmerge.importer.source import ImportInput, open_input
from distmerge.importer.targets import TARGETS, Target
from distmerge.importer.write import owners_alone, write_files
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
        refuse_unordered(source, store)
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


def refuse_unordered(source: ImportInput, store: Store) -> None:
    """Every rank, before the input is read: a store that takes each file from its owner alone, in order (an object
    store's parts: write.owners_alone) is written from an input whose tensors the import hands out itself (a
    Hugging Face folder), not from a checkpoint, whose tensors the merge engine hands to the processes and in the
    order its plan gives (the parts would wait in memory, up to the whole file, for their last bytes)."""
    if owners_alone(store) and not source.chooses_makers:
        raise ConfigError(f"distmerge import writes a training checkpoint into a folder, not into {store.url}: "
                          "merge the checkpoint into a Hugging Face folder (an s3:// one too) and import that, or "
                          "import into a folder and upload it")


def summary(result: ImportResult, opts: ImportOptions) -> str:
    """The line rank 0 prints after the import."""
    return TARGETS[opts.to].summary(result, opts)


def _refuse_early(target: Target, opts: ImportOptions) -> None:
    """Rank 0, before a checkpoint input is opened (source.py): an output the import may not write, and with
    --hf-config, a layout its config.json does not allow; the rest is judged on the checkpoint's tensors."""
    store = open_store(opts.output)
    store.check(str(opts.input), opts.overwrite, resumable=False)
    if opts.hf_config is not None:
        target.check_config(discover_config(opts.hf_config), opts.layout)


def _discover(target: Target, opts: ImportOptions, store: Store, held: list[Lease], model: Model) -> None:
    """Rank 0, the model found: the plan made (each refusal here, before the output is touched), then the
    output's lock, the output checked under it and made ready (a stale marker removed first, then the files)."""
    target.plan(model, opts.layout, 1)
    store.check_place(model.root)
    held.append(lock.take(store.lock(), lock.this_process(model.root), store.url, take_over=opts.overwrite,
                          say=lambda line: None, resumable=False))
    store.check(model.root, opts.overwrite, resumable=False)
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

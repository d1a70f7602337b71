"""`distmerge import --to torchtitan`: the import's phases (the package docstring) for torchtitan's layout, on every
rank of a Comm, under the output's lock.

    rank 0       discover, plan (every refusal: nothing written yet), lock, check and prepare the output
    every rank   the plan (the same everywhere), the files it owns written into OUT/step-0 (write.py)
    rank 0       OUT/step-0/.metadata, last: torchtitan counts a step folder as a checkpoint only once it has one

OUT is a torchtitan checkpoint folder: `--checkpoint.initial_load_path OUT/step-0` starts a job from it (model
only, the default of initial_load_model_only), and so does OUT as the job's checkpoint folder (a step-0 save is
loaded as model weights only).
"""

from __future__ import annotations

import time
from pathlib import Path

from distmerge.distributed.comm import Comm
from distmerge.formats.torch_private.dcp import write as dcp
from distmerge.importer.discover import Model, discover
from distmerge.importer.run import ImportOptions, ImportResult, _release
from distmerge.importer.torchtitan_plan import STEP, make_titan_plan
from distmerge.importer.write import write_folder
from distmerge.output import lock, open_store
from distmerge.output.lock import Lease
from distmerge.output.store import Store


def run_torchtitan_import(opts: ImportOptions, comm: Comm) -> ImportResult:
    start = time.perf_counter()
    store = open_store(opts.output)
    held: list[Lease] = []
    unregister = comm.on_abort(lambda: _release(held))
    try:
        comm.phase("discovery")
        model = comm.root_only(lambda: _discover(opts, store, held))
        plan = make_titan_plan(model, comm.world)  # rank 0 made it already: it cannot fail here
        comm.phase("writing")
        entries = write_folder(plan, model, store, STEP, comm)  # type: ignore[arg-type]
        comm.phase("finalize")
        comm.agree(lambda: _finalize(store, entries, held) if comm.rank == 0 else None)
    finally:
        unregister()
        _release(held)
    return ImportResult(files=len(plan.files), tensors=len(plan.tensors), chunks=sum(len(f.chunks) for f in plan.files),
                        nbytes=sum(f.nbytes for f in plan.files), padded_vocab=0,
                        seconds=time.perf_counter() - start, processes=comm.world)


def _discover(opts: ImportOptions, store: Store, held: list[Lease]) -> Model:
    """Rank 0: the model read and the plan made (each refusal here, before the output is touched), then the
    output's lock, the output checked under it and made ready (a stale step-0 removed, its .metadata first)."""
    model = discover(opts.input)
    make_titan_plan(model, 1)
    store.check_place(model.root)
    held.append(lock.take(store.lock(), lock.this_process(model.root), store.url, take_over=opts.overwrite,
                          say=lambda line: None))
    store.check(model.root, opts.overwrite)
    store.prepare(keep_finished=False)
    store.remove(f"{STEP}/.metadata")
    for name in store.list(f"{STEP}/*"):
        store.remove(name)
    return model


def _finalize(store: Store, entries: list[dcp.Entry], held: list[Lease]) -> None:
    for lease in held:
        lease.check(store.url)  # the output is still this import's
    store.write_small(f"{STEP}/.metadata", dcp.metadata_bytes(entries))


def describe(result: ImportResult, output: Path) -> str:
    """The summary line rank 0 prints."""
    return (f"distmerge import: wrote {output}/{STEP} (torchtitan DCP, loads at any world size): {result.tensors} "
            f"tensors in {result.files} files, {result.nbytes / 1e6:.1f} MB; {result.seconds:.1f} s with "
            f"{result.processes} process(es)")


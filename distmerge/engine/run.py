"""The merge, phase by phase. Every rank runs `merge` and makes the same collective calls in order:

    phase      who works                          collective
    discover   rank 0 checks, lists, reads config broadcast            (comm.root_only)
               each rank opens its input files    all_gather of inventories (comm.gather)
    plan       every rank, identically, no I/O    all_gather of status (comm.agree)
    checks     each rank hashes its copies of     all_gather of figures (replicas, unwritten: only when
               small replicas and of the sources  there is something to check)
               the family did not write
    resume     each rank checks the output files  all_gather of the checks (always; empty without --resume),
               it owns; rank 0 decides            then broadcast of rank 0's decision (resume.start)
    shared     owners create the files several    all_gather of their tokens (only when the plan has shared
               ranks write (output/writer.py)     files)
    per round: exchange  readers pack round k+1   all_to_all_single, asynchronous (errors travel with
                                                  the round's gather)
               assemble + write  owners            all_gather of bytes written (progress)
    commit     owners commit their shared files   all_gather of the writers' receipts (only when the store needs
                                                  them and the plan has shared files), then all_gather of the
                                                  ranks' figures (always)
    finalize   rank 0: config, tokenizer, index   broadcast (comm.root_only); none when --resume found the
                                                  merge already complete

discover (less the output checks), plan, checks and the rounds are shared with `verify` of a checkpoint
(verifier/checkpoint.py), through `plan_checkpoint` and `run_rounds`: the rounds hand each assembled target to a
sink (sink.py), which for merge writes it into its output file (sink.FileSink) and for verify compares it with
the reference. The engine knows neither formats and families nor what verify compares, nor where the output
lives: every byte it writes goes through the output store (output/store.py documents its calls).
"""

from __future__ import annotations

import gc
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from distmerge import testing_seams as seams
from distmerge.average import units as average
from distmerge.distributed.comm import Comm
from distmerge.engine import discover as disc
from distmerge.engine import expect, inventory, nodes, replicas, resume, unwritten
from distmerge.engine import plan as planning
from distmerge.engine.assemble import UnitBuild
from distmerge.engine.exchange import Exchanger, Pending
from distmerge.engine.expect import Claim
from distmerge.engine.finalize import finalize
from distmerge.engine.fold import FoldBuild, unit_build
from distmerge.engine.inputs import InputSpec, check_inputs, discover_inputs
from distmerge.engine.placement import Placement
from distmerge.engine.plan import Plan
from distmerge.engine.prepare import OutputSettings, Together, prepare_merge
from distmerge.engine.reader import Reader
from distmerge.engine.sink import FileSink, Sink
from distmerge.errors import Interrupted
from distmerge.formats import registry
from distmerge.formats.base import Fragment
from distmerge.input.source import name_of
from distmerge.output import lock, open_store, store_name
from distmerge.output.lock import Lease
from distmerge.output.names import RECORDS, record_name
from distmerge.output.store import Sharing, Store
from distmerge.output.writer import ShardWriter
from distmerge.report import Progress
from distmerge.results import Laps, MergeResult, RankStats


@dataclass(frozen=True, kw_only=True)
class MergeOptions:
    input: InputSpec  # the checkpoint (several: an average's, in the order given) and how to read it
    output: Path | str
    settings: OutputSettings = field(default_factory=OutputSettings)
    overwrite: bool = False
    resume: bool = False
    checksum: bool = False
    claims: tuple[Claim, ...] = ()  # what the user says the checkpoint is, checked with the plan (expect.py)


def merge(opts: MergeOptions, comm: Comm, progress: Progress) -> MergeResult:
    start = time.perf_counter()
    store = open_store(opts.output)
    held: list[Lease] = []  # rank 0's lock on the output (output/lock.py), from discovery to the exit
    unregister = comm.on_abort(lambda: _release(held))  # the watchdog ends the process without unwinding
    try:
        return _merge(opts, comm, progress, store, held, start)
    finally:
        unregister()
        _release(held)


def _release(held: list[Lease]) -> None:
    while held:
        held.pop().release()


def _merge(opts: MergeOptions, comm: Comm, progress: Progress, store: Store, held: list[Lease],
           start: float) -> MergeResult:
    comm.phase("discovery")
    spread = nodes.spread_inputs(comm, [*opts.input.locations, opts.input.hf_config, opts.input.base_model])
    try:
        return _merge_on(spread, opts, comm, progress, store, held, start)
    finally:
        if spread is not None:
            spread.close()


def _merge_on(spread: nodes.Spread | None, opts: MergeOptions, comm: Comm, progress: Progress, store: Store,
              held: list[Lease], start: float) -> MergeResult:
    """The merge, its input on one node or `spread` over several (engine/nodes.py: rank 0's work alone then
    reads other nodes' files through them, and each file is read on a node that holds it)."""
    laps = Laps()
    said: list[str] = []
    if spread is not None:
        comm, opts = spread.comm(comm), replace(opts, input=spread.input_of(opts.input))
    found = comm.root_only(lambda: _discover(opts, store, held, said.append))
    for line in said:
        progress.say(line)
    if spread is not None:
        nodes.check_output_shared(comm, store, spread.nodes)
    placement = nodes.placement_of(comm, found.scan)
    laps.lap("discover")
    scan = found.scan
    reader = Reader(scan, registry.get(scan.format))
    sink = plan = None
    collecting = gc.isenabled()  # the cyclic GC rests while the inventories, the plan and the rounds run:
    gc.disable()  # millions of long-lived fragments walked in every full collection (W=256: 30% of the CPU)
    try:
        plan = plan_checkpoint(found, reader, comm, opts.settings, host=store.host, claims=opts.claims,
                               sharing=store.sharing, laps=laps, placement=placement)
        run = resume.describe(plan, scan.files, resume.output_options(opts.settings, scan.format,
                                                                      opts.input.format_options, found.config))
        comm.phase("the start of the output (its checks for --resume)")
        begun = resume.start(store, plan, run, comm, resuming=opts.resume, checksum=opts.checksum)
        progress.say(begun.line)
        todo = planning.without_files(plan, list(begun.kept))
        if not begun.complete:  # progress counts only what this run writes
            progress.start(plan.total_bytes - _kept_bytes(plan, begun), len(plan.files), kept=len(begun.kept))
        sink = FileSink(plan, store, run, comm.rank, checksum=opts.checksum)
        sink.create_shared(begun.kept, comm)
        run_rounds(todo, comm, reader, sink, progress)
        progress.stop()
        laps.lap("rounds")
        comm.phase("the commit of the output files")
        receipts = comm.gather(sink.receipts) if sink.needs_receipts else None
        crossed = todo.crossing(placement, comm.rank) if placement is not None else 0
        node = placement.node_of_rank[comm.rank] if placement is not None else 0
        ranks = comm.gather(lambda: sink.commit_shared(receipts) or replace(
            _stats(comm.rank, reader, sink.writers, laps), node=node, bytes_from_other_nodes=crossed))
        comm.phase("finalize (rank 0 writes config.json and the index)")
        copied = [] if begun.complete else comm.root_only(
            lambda: _still_ours(held, store) or finalize(store, plan, found.config, disc.config_source(found.hf_dir),
                                                          scan.not_model_files))
    except BaseException as err:
        if sink is not None:
            sink.abort()
        progress.stop()
        if isinstance(err, KeyboardInterrupt) and comm.rank == 0 and plan is not None:
            raise Interrupted(finished=_finished(store, plan), planned=len(plan.files)) from err
        raise
    finally:
        reader.close()
        if collecting:
            gc.enable()
    return MergeResult(
        output=store_name(opts.output),
        format=scan.format,
        input_world_size=scan.world_size,
        processes=comm.world,
        device=str(comm.device),
        tensors=sum(len(f.targets) for f in plan.files),
        files=[(f.name, f.nbytes) for f in plan.files],
        total_bytes=plan.total_bytes,
        seconds=time.perf_counter() - start,
        ranks=ranks,
        notes=[*scan.notes, *plan.notes],
        copied=copied,
        resumed_files=len(begun.kept),
        bytes_written=sum(r.bytes_written for r in ranks),
        resume=begun.line,
        already_complete=begun.complete,
        nodes=len(spread.nodes.keys) if spread is not None else 1,
    )


def plan_checkpoint(found: disc.Discovery, reader: Reader, comm: Comm, settings: OutputSettings,
                    host: Callable[[], str], claims: tuple[Claim, ...] = (), sharing: Sharing | None = None,
                    laps: Laps | None = None, placement: Placement | None = None,
                    together: Together | None = None) -> Plan:
    """Collective, after discovery, before any round (merge, and verify of a checkpoint): each rank opens the input
    files it reads and the inventories are gathered; every rank plans the same; the checks of small replicas and
    of the sources the family wrote into no unit run. Returns the plan with their notes, the same on every rank.
    `host()`: this rank's machine, as spread.py groups ranks that may write one file; `claims`: what the user
    says the checkpoint is, checked against the plan (expect.py); `sharing`: what the output store lets several
    ranks do with one file (None: what a local folder allows); `laps`: the phases' times, when kept;
    `placement`: the input on the nodes' own disks (engine/nodes.py), each file read on a node that holds it;
    `together`: the caller's joining of units whose targets it needs on one owner (prepare.Together)."""
    laps = laps if laps is not None else Laps()
    readers = planning.assign_readers(found.scan.files, comm.world, placement)
    mine = [i for i, r in enumerate(readers) if r == comm.rank]
    comm.phase("the opening of the input files")
    # inventories travel as columns (inventory.py says why), with the host of each rank (spread.py)
    gathered = comm.gather(lambda: (host(), inventory.pack(reader.open(mine))))
    laps.lap("open")
    hosts = _host_numbers([name for name, _ in gathered])
    comm.phase("planning")
    prepared = comm.agree(lambda: _prepare(found, inventory.unpack([part for _, part in gathered]), comm.world,
                                           settings, hosts, claims, sharing, placement, together))
    laps.lap("plan")
    plan = prepared.plan
    checked = unwritten.check(plan, prepared.left_out, prepared.must_equal, comm, reader)
    return replace(plan, notes=(*plan.notes, *replicas.check(plan, comm, reader), *checked))


def _prepare(found: disc.Discovery, fragments, world: int, settings: OutputSettings, hosts: tuple[int, ...],
             claims: tuple[Claim, ...], sharing: Sharing | None, placement: Placement | None = None,
             together: Together | None = None):
    prepared = prepare_merge(found, fragments, world, settings, hosts=hosts, sharing=sharing, placement=placement,
                             together=together)
    expect.check(claims, found.config, prepared.plan)
    return prepared


def run_rounds(todo: Plan, comm: Comm, reader: Reader, sink: Sink, progress: Progress, send_sets: int = 2) -> None:
    """Collective: the rounds of `todo`, each unit's targets into `sink` on its owner. Exchange one round ahead:
    round k+1 travels (its readers pack it) while round k is assembled. `send_sets`: exchange.Exchanger's."""
    run_in_lockstep((Work(todo=todo, reader=reader, sink=sink, send_sets=send_sets),), comm, progress)


@dataclass(frozen=True, kw_only=True)
class Work:
    """One input's rounds: its plan (owners and rounds), the reader of its files, where its targets go."""

    todo: Plan
    reader: Reader
    sink: Sink
    send_sets: int = 2  # exchange.Exchanger's: 1 for verify, whose rounds take longer to assemble than to travel
    carrying: dict[int, FoldBuild] = field(default_factory=dict)  # this rank's units carried over several rounds


def run_in_lockstep(works: tuple[Work, ...], comm: Comm, progress: Progress) -> None:
    """Collective: round k of every work, in order, inside one gather (verify of two checkpoints: round k of one
    side, then round k of the other, so that an owner holds both sides' targets of a round together). Each
    work's exchange of round k+1 travels while round k is assembled; a work with fewer rounds idles."""
    exchangers = [Exchanger(w.todo, comm, w.reader, w.send_sets) for w in works]
    for w in works:  # the source's read policy may read a later round's fragments in passing (reads.py)
        w.reader.plan_reads(w.todo, comm.rank)
    depth = max((len(w.todo.rounds) for w in works), default=0)

    def start(k: int) -> list[Pending]:
        return [x.start(w.todo.brings(k), k % 2) for x, w in zip(exchangers, works, strict=True)]

    comm.phase(f"round 1 of {depth}")
    pending, ahead = start(0) if depth else [], []
    try:
        for k in range(depth):
            comm.phase(f"round {k + 1} of {depth}")
            ahead = start(k + 1) if k + 1 < depth else []
            done = comm.gather(lambda p=pending, k=k: _round_work(works, p, k, comm))
            progress.advance(sum(done))
            pending, ahead = ahead, []
            seams.pause_after_round()
    except BaseException as err:
        if hasattr(err, "origin_rank"):  # every rank agreed on the error, so in-flight exchanges complete
            for work in (*pending, *ahead):
                work.drain()
        raise


def _round_work(works: tuple[Work, ...], pending: list[Pending], k: int, comm: Comm) -> int:
    """This rank's share of round k: its targets built and handed to their sinks; the bytes it wrote. The test seams
    of a fault in a round (testing_seams.py) sit here, inside the round's gather, where a read error would be."""
    seams.fail_in_round(comm.rank, k)
    seams.stall_in_round(comm.rank, k)
    return sum(_build(w, k, pk, comm) for w, pk in zip(works, pending, strict=True))


def _discover(opts: MergeOptions, store: Store, held: list[Lease], say: Callable[[str], None]) -> disc.Discovery:
    """Rank 0: the input checked (an average's inputs each, and against its options: engine/inputs.py), the
    output's lock taken (before anything is written there: output/lock.py), the output checked again under the
    lock (a merge that ended meanwhile may have filled it), discovery, and the output prepared."""
    spec = opts.input
    notes = average.check(opts.settings.average, len(spec.locations))
    roots = check_inputs(spec.locations)
    named = name_of(spec.location)
    for each in spec.locations:
        store.check_place(name_of(each))
    held.append(lock.take(store.lock(), lock.this_process(named), store.url,
                          take_over=opts.overwrite or opts.resume, say=say))
    store.check(named, opts.overwrite or opts.resume)
    found = discover_inputs(roots, spec.format, spec.hf_config, spec.format_options, spec.base_model)
    store.prepare(keep_finished=opts.resume)
    return replace(found, scan=replace(found.scan, notes=(*found.scan.notes, *notes))) if notes else found


def _finished(store: Store, plan: Plan) -> int | None:
    """Rank 0, interrupted: the planned files whose completion record is in the output (what --resume keeps)."""
    try:
        recorded = set(store.list(f"{RECORDS}/*.json"))
    except Exception:  # noqa: BLE001  (the count is a courtesy: the interrupt goes on without it)
        return None
    return sum(record_name(f.name) in recorded for f in plan.files)


def _still_ours(held: list[Lease], store: Store) -> None:
    """Rank 0, right before finalize writes the index: the output is still this merge's (output/lock.py)."""
    for lease in held:
        lease.check(store.url)


def _host_numbers(names: list[str]) -> tuple[int, ...]:
    """Each rank's host as the lowest rank on it: the same numbers on every rank."""
    first: dict[str, int] = {}
    return tuple(first.setdefault(name, rank) for rank, name in enumerate(names))


def _kept_bytes(plan: Plan, begun: resume.Resumption) -> int:
    return sum(plan.files[i].nbytes for i in begun.kept)


def _build(work: Work, k: int, pending: Pending, comm: Comm) -> int:
    """Place this rank's fragments for round k's units (local ones while the exchange is in flight), hand the
    targets of the units that end in this round to the sink, let it complete what it can. A unit carried over
    several rounds (Plan.carried) folds what this round brought and waits in `work.carrying`. Returns the bytes of
    target built."""
    plan, reader, sink, me = work.todo, work.reader, work.sink, comm.rank
    builds = []
    for i, names in plan.brings(k):
        if plan.owner_of_unit[i] == me:
            build = work.carrying.pop(i, None) or unit_build(plan.units[i], plan, lambda i=i: sink.output(i),
                                                             comm.device, reader)
            builds.append((i, names, build, [(name, f) for name in names for f in plan.sources[name].fragments]))
    try:
        _place_local(builds, plan, me, reader, pending.held)
    finally:
        received = pending.wait()  # the collective completes even when local work failed
    held, built = pending.held, 0
    for i, names, build, fragments in builds:
        for source, frag in fragments:
            if (reader_of := plan.readers[frag.file_index]) != me:
                build.place_received(source, frag, received.take(reader_of, frag))
            elif held and frag in held:  # read from an object store with the packing (exchange.held_back)
                build.place_received(source, frag, held[frag])
        if plan.last_round_of(i, k):
            build.finish()
            built += sum(t.nbytes for t in build.unit.targets)
        else:
            build.advance(names)
            work.carrying[i] = build
    sink.round_done()
    return built


def _place_local(builds: list[tuple[int, tuple[str, ...], UnitBuild | FoldBuild, list[tuple[str, Fragment]]]],
                 plan: Plan, me: int, reader: Reader, held: dict) -> None:
    """The fragments this rank reads for its own units, less those read with the packing (`held`), handed to one
    batch of the source's read policy (input/reads.py: a folder's small fragments that lie close in one read, an
    object's neighbours in one GET), straight into their place where they have one (UnitBuild.take_local)."""
    reads, rest = reader.batch(), []
    for _, _, build, fragments in builds:
        for source, frag in fragments:
            if plan.readers[frag.file_index] == me and frag not in held:
                dest = build.take_local(source, frag) if reads.can_copy(frag) else None
                (rest.append((build, source, frag)) if dest is None else reads.fill(frag, dest))
    for build, source, frag in rest:
        build.place_local(source, frag, reads)
    reads.run()


def _stats(rank: int, reader: Reader, writers: dict[int, ShardWriter], laps: Laps) -> RankStats:
    """What this rank did in this run: the files it wrote (or its part of shared ones), not the ones --resume
    kept."""
    return RankStats(
        rank=rank,
        bytes_read=reader.bytes_read,
        bytes_written=sum(w.own_bytes for w in writers.values()),
        files_written=len(writers),
        peak_rss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        phases=dict(laps),
        phases_cpu=dict(laps.cpu),
        phases_rss=dict(laps.rss),
    )


"""`verify --merged CHECKPOINT`: merge a training checkpoint in memory and compare each tensor with the reference.
Nothing is written but the report: no output folder, no temporary file. The check to run before spending the disk
and the hours of a large merge. `verify --merged MODEL --reference CHECKPOINT` runs the same with the checkpoint as
the side merged in memory (role "reference"): its targets are compared with the model's tensors; the report keeps
the user's sides (merged minus reference, the model's file names).

Every rank makes the same calls in this order (run.py decides, on rank 0, which side is a checkpoint: kinds.py):

    phase     who works                                                     collective
    discover  rank 0: format, files, config, as merge (no output folder)    broadcast (comm.root_only)
    plan      every rank, as merge (engine.run.plan_checkpoint):            all_gathers, as merge's
              inventories, the plan, the checks of replicas and of
              unwritten sources
    pair      rank 0: the plan's targets (names, shapes and dtypes are      broadcast (comm.root_only)
              known before any byte is read) with the reference's headers
              (listing.pair_sides): missing, extra, shape settled there
    rounds    merge's rounds (engine.run.run_rounds) over the units that    per round: all_to_all_single,
              have a tensor to compare; each owner compares the targets it  all_gather
              assembles with the reference's tensors of the same names,
              block by block (stream.StreamSink)
    collect   every rank's records                                          all_gather (comm.gather)

Memory per rank is merge's, bounded by --budget, less one round's outgoing bytes: the exchange keeps one send buffer
(exchange.Exchanger, send_sets=1: a round's figures take longer to compute than its bytes to travel). On the CPU a
target that merge would copy into its file as its bytes arrive is compared as they arrive, against the reference
read a block at a time (a few MB beside merge's); a unit merge builds (a QKV split, a cast) is built as merge
builds it. The records are verify's own
(blocks.Running), so the report is the one `verify` of the merged folder gives: the same checks, figures and
file names (the files merge would write with the same --max-shard-size).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from distmerge import dtypes
from distmerge.distributed.comm import Comm
from distmerge.engine import nodes
from distmerge.engine import plan as planning
from distmerge.engine.finalize import main_dtype
from distmerge.engine.inputs import scans
from distmerge.engine.nodes import Nodes
from distmerge.engine.plan import Plan
from distmerge.engine.reader import Reader
from distmerge.engine.run import plan_checkpoint, run_rounds
from distmerge.errors import InputError
from distmerge.formats import registry
from distmerge.report import Progress
from distmerge.verifier.kinds import checkpoint_side
from distmerge.verifier.listing import Listing, VerifyOptions, beside, merged_config, pair_sides
from distmerge.verifier.report import Check
from distmerge.verifier.sides import Loc, Side, TensorFiles, open_side
from distmerge.verifier.stream import StreamSink


@dataclass(frozen=True, kw_only=True)
class Compared:
    """What every rank gets from verify_checkpoint and verify_two_checkpoints."""

    checks: list[Check]  # the settled ones and every rank's, unsorted
    per_rank: list[int]  # tensors each rank compared
    format: str | None  # --merged's format when it is a checkpoint
    notes: tuple[str, ...]  # its merge's notes (scan and plan): what a merge would have said
    reference_format: str | None = None  # --reference's format when it is a checkpoint
    reference_notes: tuple[str, ...] = ()  # what the reference's merge would have said


def verify_checkpoint(opts: VerifyOptions, comm: Comm, role: str = "merged") -> Compared:
    """Collective (see the module docstring): every rank calls it and gets the same records. `role`: the side
    that is the checkpoint ("merged", or "reference" when --merged is the finished model); the records keep the
    user's sides either way (merged minus reference, the merged side's file names)."""
    side = checkpoint_side(opts, role)
    found = comm.root_only(side.discover)
    finished: list[Side] = []  # rank 0: the finished model's side, opened once
    where = comm.root_only(lambda: _finished_on(opts, role, nodes.nodes_of(comm), finished))
    reader = Reader(found.scan, registry.get(found.scan.format))
    try:
        # No file is written, so none is shared by the ranks of one host: the ranks count as one host, and any
        # rank may take any unit when whole files cannot balance the work (spread.py).
        plan = plan_checkpoint(found, reader, comm, opts.settings, host=lambda: "",
                               placement=nodes.placement_of(comm, found.scan, may_own=where))
        listing = comm.root_only(lambda: _pair(plan, {**found.config, **plan.config_updates}, opts, role,
                                               finished[0]))
        todo = _compared_units(plan, listing, role)
        other = TensorFiles(listing.reference if role == "merged" else listing.merged)
        sink = StreamSink(todo, listing, other, streamed=role, crit=opts.criteria, device=comm.device)
        try:
            run_rounds(todo, comm, reader, sink, Progress(enabled=False), send_sets=1)
        finally:
            other.close()
        comm.phase("the collection of the figures")
        per_rank = comm.gather(lambda: sink.checks)
    finally:
        reader.close()
    # an average's formats, in the order given ("fsdp + dcp")
    said = (" + ".join(s.format for s in scans(found.scan)), (*found.scan.notes, *plan.notes))
    mine = dict(format=said[0], notes=said[1]) if role == "merged" else dict(
        format=None, notes=(), reference_format=said[0], reference_notes=said[1])
    return Compared(checks=[*listing.settled, *(c for mine in per_rank for c in mine)],
                    per_rank=[len(c) for c in per_rank], **mine)


def _finished_on(opts: VerifyOptions, role: str, nodes_: Nodes | None, opened: list[Side]) -> tuple[int, ...]:
    """Rank 0: the finished model's side (into `opened`), and the nodes that hold all its files when it lies on the
    nodes' own disks (() when every rank opens it: one node, or a shared folder). Each target is compared on a node
    that holds the reference; a model no node holds whole is refused."""
    # the other side is a finished model: a local path (kinds.py)
    path = Path((opts.reference if role == "merged" else opts.merged).location)
    side = open_side(path, role="reference" if role == "merged" else "merged model", allow_torch=True)
    opened.append(side)
    if nodes_ is None or not side.held:
        return ()
    whole = tuple(sorted(set(range(len(nodes_.keys))).intersection(*side.held)))
    if not whole:
        flag = "--reference" if role == "merged" else "--merged"
        raise InputError(f"{flag} {path} lies split over the nodes' disks, and no node holds all its files: put the "
                         "model whole on one node's disk (or every node's, or a shared folder) and verify again")
    return whole


def _pair(plan: Plan, config: dict, opts: VerifyOptions, role: str, finished: Side) -> Listing:
    """Rank 0: the checkpoint's side as the plan describes it, paired with the finished model's (`finished`: its
    headers). The merged side's config.json says which heads are tied: the checkpoint's, or the finished model's own
    when it has one."""
    named = (opts.merged if role == "merged" else opts.reference).named
    if not plan.model_files:
        raise InputError(f"{named} holds a LoRA adapter only: verify compares model weights; pass --base-model DIR "
                         "(the base model's folder) with it as --merged so that the model is made")
    planned = planned_side(plan, named)
    if role == "merged":
        # config.json as merge would write it: its dtype (what encoded weights, compared decoded, were encoded from)
        # and the values it makes late (a quantization_config's record: how the weights are encoded)
        config = {**config, "torch_dtype": dtypes.hf_dtype_name(main_dtype(plan) or "F32")}
        return pair_sides(planned, finished, config, later=plan.config_later)
    own = merged_config(beside(Path(opts.merged.location)))
    return pair_sides(finished, planned, own if own is not None else config)


def planned_side(plan: Plan, named: str) -> Side:
    """The model files merge would write, listed as verify lists a merged folder (the adapter is not in it)."""
    files = plan.model_files
    tensors = {t.name: Loc(file=i, dtype=t.dtype, shape=t.shape) for i, f in enumerate(files) for t in f.targets}
    return Side(path=named, kind="safetensors", files=tuple(f.name for f in files),
                sizes=tuple(f.nbytes for f in files), tensors=tensors)


def _compared_units(plan: Plan, listing: Listing, role: str) -> Plan:
    """The plan's rounds less the units with nothing to compare (settled from the headers, or the adapter's)."""
    wanted = {p.merged_name if role == "merged" else p.reference_name for p in listing.pairs}
    keep = {i for i, u in enumerate(plan.units) if any(t.name in wanted for t in u.targets)}
    return planning.only_units(plan, keep)

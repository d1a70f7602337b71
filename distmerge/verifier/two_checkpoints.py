"""`verify --merged CHECKPOINT --reference CHECKPOINT`: two training checkpoints of one model (say an FSDP save
and a Megatron save, trained under two strategies) merged in memory side by side and compared, nothing written.

Every rank makes the same calls in this order (run.py decides, on rank 0, that both sides are checkpoints):

    phase     who works                                                     collective
    discover  rank 0: each side's format, files and config, as merge        broadcast, twice (comm.root_only)
              (--merged with the input options, --reference with their
              --reference- twins: kinds.py)
    plan      every rank, each side as merge would                          all_gathers, as merge's, per side
              (engine.run.plan_checkpoint) with the same --dtype, --lora,
              --budget: both plans' targets carry Hugging Face names
    pair      rank 0: both plans' targets paired as verify pairs two         broadcast (comm.root_only)
              folders (listing.pair_sides: hub names, tied heads; missing,
              extra and shape settled from the plans)
    group     every rank: units joined by the pairs into components, one    all_gather of status (comm.agree)
              owner and round each (components.py), imposed on both plans
    rounds    both plans' rounds in lockstep (engine.run.run_in_lockstep):   per round: two all_to_all_single,
              round k of --merged, held by its owner (HoldSink), then        one all_gather
              round k of --reference, each target compared with the held
              ones of the same names (PairedSink); both dropped at the
              round's end
    collect   every rank's records                                          all_gather (comm.gather)

Memory per rank: the two rounds in flight of each side, bounded by --budget together (a component's source bytes
count both sides), each side's outgoing bytes in one send buffer (exchange.Exchanger, send_sets=1, as checkpoint.py),
plus the held --merged targets of one round; the --reference side's targets are compared with them as their bytes
arrive (stream.StreamSink), a block at a time.
"""

from __future__ import annotations

import torch

from distmerge.distributed.comm import Comm
from distmerge.engine import nodes
from distmerge.engine.plan import Plan
from distmerge.engine.reader import Reader
from distmerge.engine.run import Work, plan_checkpoint, run_in_lockstep
from distmerge.errors import InputError
from distmerge.formats import registry
from distmerge.report import Progress
from distmerge.verifier.checkpoint import Compared, planned_side
from distmerge.verifier.components import comparison_plans
from distmerge.verifier.kinds import checkpoint_side
from distmerge.verifier.listing import Listing, VerifyOptions, pair_sides
from distmerge.verifier.report import Criteria
from distmerge.verifier.stream import StreamSink


def verify_two_checkpoints(opts: VerifyOptions, comm: Comm) -> Compared:
    """Collective (see the module docstring): every rank calls it and gets the same records."""
    found_a = comm.root_only(checkpoint_side(opts, "merged").discover)
    found_b = comm.root_only(checkpoint_side(opts, "reference").discover)
    reader_a = Reader(found_a.scan, registry.get(found_a.scan.format))
    reader_b = Reader(found_b.scan, registry.get(found_b.scan.format), second=True)
    try:
        plan_a = plan_checkpoint(found_a, reader_a, comm, opts.settings, host=lambda: "",
                                 placement=nodes.placement_of(comm, found_a.scan))
        plan_b = plan_checkpoint(found_b, reader_b, comm, opts.settings, host=lambda: "",
                                 placement=nodes.placement_of(comm, found_b.scan))
        listing = comm.root_only(lambda: _pair(plan_a, plan_b, {**found_a.config, **plan_a.config_updates}, opts))
        pairs = [(p.merged_name, p.reference_name) for p in listing.pairs]
        todo_a, todo_b = comm.agree(lambda: comparison_plans(plan_a, plan_b, pairs, comm.world,
                                                             opts.settings.budget_bytes))
        held = HoldSink()
        sink = PairedSink(todo_b, listing, opts.criteria, comm.device, held)
        run_in_lockstep((Work(todo=todo_a, reader=reader_a, sink=held, send_sets=1),
                         Work(todo=todo_b, reader=reader_b, sink=sink, send_sets=1)), comm, Progress(enabled=False))
        comm.phase("the collection of the figures")
        per_rank = comm.gather(lambda: sink.checks)
    finally:
        reader_b.close()
        reader_a.close()
    return Compared(checks=[*listing.settled, *(c for mine in per_rank for c in mine)],
                    per_rank=[len(c) for c in per_rank], format=found_a.scan.format,
                    notes=(*found_a.scan.notes, *plan_a.notes), reference_format=found_b.scan.format,
                    reference_notes=(*found_b.scan.notes, *plan_b.notes))


def _pair(plan_a: Plan, plan_b: Plan, config: dict, opts: VerifyOptions) -> Listing:
    """Rank 0: both sides as their plans describe them (the files merge would write), paired by name."""
    for plan, spec in ((plan_a, opts.merged), (plan_b, opts.reference)):
        if not plan.model_files:
            raise InputError(f"{spec.named} holds a LoRA adapter only: verify compares model weights; compare a save "
                             "that holds the model (or merge it with --base-model first)")
    return pair_sides(planned_side(plan_a, opts.merged.named), planned_side(plan_b, opts.reference.named), config)


class HoldSink:
    """The --merged side's sink (sink.Sink): each target its owner builds is kept until the reference's targets of
    the same round arrive (PairedSink drops them at the round's end); read a block at a time (stream.Blocks)."""

    takes_bytes = False  # every target is built as a tensor (assemble.TargetOut)

    def __init__(self) -> None:
        self.held: dict[str, torch.Tensor] = {}

    def output(self, unit: int) -> HoldSink:
        return self

    def round_done(self) -> None:
        """Nothing yet: the reference's half of the round follows."""

    def write(self, name: str, tensor: torch.Tensor) -> int:
        self.held[name] = tensor.reshape(-1)
        return tensor.numel() * tensor.element_size()

    def read(self, name: str, start: int, count: int) -> torch.Tensor:
        return self.held[name][start : start + count]


class PairedSink(StreamSink):
    """The --reference side's sink: each target, as its bytes arrive or once built, compared block by block with
    the held merged targets paired with it (two when one side ties its head to the embedding); the held ones are
    dropped at the round's end."""

    def __init__(self, plan: Plan, listing: Listing, crit: Criteria, device: torch.device, held: HoldSink) -> None:
        super().__init__(plan, listing, held, streamed="reference", crit=crit, device=device)
        self.held = held

    def round_done(self) -> None:
        super().round_done()
        self.held.held.clear()

"""`verify --merged CHECKPOINT`: merge a training checkpoint in memory and compare each tensor with the reference.
Nothing is written but the report: no output folder, no temporary file. The check to run before spending the disk
and the hours of a large merge.

Every rank makes the same calls in this order (run.py decides, on rank 0, that `merged` is a checkpoint):

    phase     who works                                                     collective
    discover  rank 0: format, files, config, as merge (no output folder)    broadcast (comm.root_only)
    plan      every rank, as merge (engine.plan_checkpoint): inventories,   all_gathers, as merge's
              the plan, the checks of replicas and of unwritten sources
    pair      rank 0: the plan's targets (names, shapes and dtypes are      broadcast (comm.root_only)
              known before any byte is read) with the reference's headers
              (listing.pair_sides): missing, extra, shape settled there
    rounds    merge's rounds (engine.run_rounds) over the units that have   per round: all_to_all_single,
              a tensor to compare; each owner compares the targets it       all_gather
              assembles with the reference's tensors of the same names
              (CompareSink), reading those one at a time
    collect   every rank's records                                          all_gather (comm.gather)

Memory per rank is merge's, bounded by --budget: two rounds of source tensors, plus the one reference tensor
being compared. The records are verify's own (compare.compare_tensors), so the report is the one `verify` of the
merged folder gives: the same checks, figures and file names (the files merge would write with the same
--max-shard-size).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path

from distmerge import discover as disc
from distmerge import plan as planning
from distmerge.comm import Comm
from distmerge.engine import plan_checkpoint, run_rounds
from distmerge.errors import InputError
from distmerge.formats import registry
from distmerge.plan import Plan
from distmerge.prepare import OutputSettings
from distmerge.reader import Reader
from distmerge.report import Progress
from distmerge.verify.listing import Listing, VerifyOptions, pair_sides
from distmerge.verify.report import Check
from distmerge.verify.sides import LAYOUTS, Loc, Side, TensorFiles, open_side
from distmerge.verify.stream import StreamSink

# What marks a finished model (save_pretrained's or a merge's), and the model files of a merge that did not finish
# (verify refuses that folder by name, as before, instead of trying it as a checkpoint).
MODEL_MARKS = (*(name for _, index, single in LAYOUTS for name in (index, single)), "model-*-of-*.safetensors")
# VerifyOptions fields that shape a merge, by the flags that set them: given with a finished model, a mistake.
MERGE_FLAGS = {"format": "--format", "hf_config": "--hf-config", "format_options": "the format's own options",
               "base_model": "--base-model"}
SETTING_FLAGS = {"dtype": "--dtype", "max_shard_bytes": "--max-shard-size", "budget_bytes": "--budget",
                 "lora": "--lora, --lora-alpha or --base-model"}


@dataclass(frozen=True, kw_only=True)
class Compared:
    """What every rank gets from verify_checkpoint."""

    checks: list[Check]  # the settled ones and every rank's, unsorted
    per_rank: list[int]  # tensors each rank compared
    format: str
    notes: tuple[str, ...]  # the merge's notes (scan and plan): what a merge would have said
    reference_format: str | None = None  # the reference's format when it is a checkpoint too (two_checkpoints.py)
    reference_notes: tuple[str, ...] = ()  # what the reference's merge would have said


def merges_in_memory(opts: VerifyOptions) -> bool:
    """Rank 0: is `merged` a checkpoint (merged in memory) rather than a finished model? A folder a format detects,
    or one without a model's files, is a checkpoint; `--format` given says so too. Refuses options that cannot
    apply to the kind found."""
    path = Path(opts.merged)
    checkpoint = path.is_dir() and (opts.format != "auto" or any(f.detect(path) for f in registry.all_formats())
                                    or not any(any(path.glob(mark)) for mark in MODEL_MARKS))
    if checkpoint and opts.logits:
        raise InputError(f"--logits runs the merged model, and {path} is a checkpoint: merge it first (merge "
                         "--verify-against runs verify after the merge), then verify the merged folder with --logits")
    given = _merge_options_given(opts)
    if given and not checkpoint:
        raise InputError(f"{path} is a merged model; {', '.join(given)}: options of the merge of a training "
                         "checkpoint, leave them out (or pass the checkpoint as --merged)")
    return checkpoint


def _merge_options_given(opts: VerifyOptions) -> list[str]:
    default = VerifyOptions(merged=opts.merged, reference=opts.reference, reference_hf_config=opts.reference_hf_config)
    given = [flag for name, flag in MERGE_FLAGS.items() if getattr(opts, name) != getattr(default, name)]
    return given + [flag for f in fields(OutputSettings) if (flag := SETTING_FLAGS.get(f.name))
                    and getattr(opts.settings, f.name) != getattr(default.settings, f.name)]


def verify_checkpoint(opts: VerifyOptions, comm: Comm) -> Compared:
    """Collective (see the module docstring): every rank calls it and gets the same records."""
    found = comm.root_only(lambda: disc.discover(disc.check_input(opts.merged), opts.format, opts.hf_config,
                                                 opts.format_options, opts.base_model))
    reader = Reader(found.scan, registry.get(found.scan.format))
    try:
        # No file is written, so none is shared by the ranks of one host: the ranks count as one host, and any
        # rank may take any unit when whole files cannot balance the work (spread.py).
        plan = plan_checkpoint(found, reader, comm, opts.settings, host=lambda: "")
        listing = comm.root_only(lambda: _pair(plan, {**found.config, **plan.config_updates}, opts))
        todo = _compared_units(plan, listing)
        reference = TensorFiles(listing.reference)
        sink = StreamSink(todo, listing, reference, streamed="merged", crit=opts.criteria, device=comm.device)
        try:
            run_rounds(todo, comm, reader, sink, Progress(enabled=False))
        finally:
            reference.close()
        per_rank = comm.gather(lambda: sink.checks)
    finally:
        reader.close()
    return Compared(checks=[*listing.settled, *(c for mine in per_rank for c in mine)],
                    per_rank=[len(c) for c in per_rank], format=found.scan.format,
                    notes=(*found.scan.notes, *plan.notes))


def _pair(plan: Plan, config: dict, opts: VerifyOptions) -> Listing:
    """Rank 0: the merged side as the plan describes it, paired with the reference's headers."""
    if not plan.model_files:
        raise InputError(f"{opts.merged} holds a LoRA adapter only: verify compares model weights; pass --base-model "
                         "DIR (the base model's folder) so that the model is made")
    reference = open_side(Path(opts.reference), role="reference", allow_torch=True)
    return pair_sides(planned_side(plan, Path(opts.merged)), reference, config)


def planned_side(plan: Plan, path: Path) -> Side:
    """The model files merge would write, listed as verify lists a merged folder (the adapter is not in it)."""
    files = plan.model_files
    tensors = {t.name: Loc(file=i, dtype=t.dtype, shape=t.shape) for i, f in enumerate(files) for t in f.targets}
    return Side(path=str(path), kind="safetensors", files=tuple(f.name for f in files),
                sizes=tuple(f.nbytes for f in files), tensors=tensors)


def _compared_units(plan: Plan, listing: Listing) -> Plan:
    """The plan's rounds less the units with nothing to compare (settled from the headers, or the adapter's)."""
    wanted = {p.merged_name for p in listing.pairs}
    keep = {i for i, u in enumerate(plan.units) if any(t.name in wanted for t in u.targets)}
    return planning.only_units(plan, keep)

"""`distmerge verify`: compare a merged model with a reference state dict, tensor by tensor.

Every rank makes the same calls in this order (with one process the collectives are no-ops):

    phase    who works                                                  collective
    kind     rank 0: each side a finished model, or a checkpoint to     broadcast   (comm.root_only)
             merge in memory (kinds.py; then checkpoint.py's or
             two_checkpoints.py's phases instead of list and compare)
    list     rank 0 reads both sides' indexes and (validated) headers,  broadcast   (comm.root_only)
             pairs the names, settles missing / extra / shape
    compare  each rank reads both sides of the tensors in the merged    all_gather  (comm.gather)
             files it owns (plan.assign_owners over file sizes), a
             block at a time, and computes figures on comm.device
             (blocks.py); sends small records
    logits   --logits only: rank 0 loads both models with transformers  broadcast   (comm.root_only)
    memory   each rank's peak RSS                                       all_gather  (comm.gather)
    report   rank 0 prints the table, the totals and the verdict,       broadcast   (comm.root_only)
             writes --json and --plot

Neither side is ever loaded whole by one process: safetensors tensors are read a block of elements at a time with
`pread`, pytorch_model*.bin through one mapping of the file (sides.TensorFiles).
"""

from __future__ import annotations

import resource
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from distmerge.distributed.comm import Comm
from distmerge.engine import nodes
from distmerge.engine.inputs import InputSpec
from distmerge.errors import InputError
from distmerge.natural_order import natural_key
from distmerge.threads import one_thread
from distmerge.verifier.checkpoint import verify_checkpoint
from distmerge.verifier.compare import assign_comparers, check_mine
from distmerge.verifier.kinds import kinds
from distmerge.verifier.listing import Listing, VerifyOptions, make_listing
from distmerge.verifier.report import Check, LogitsCheck, print_report, report_json, write_json
from distmerge.verifier.totals import totals, totals_json, totals_lines
from distmerge.verifier.two_checkpoints import verify_two_checkpoints


@dataclass(frozen=True, kw_only=True)
class VerifyResult:
    checks: list[Check]
    logits: LogitsCheck | None
    processes: int
    per_rank: list[int]  # tensors each rank compared
    device: str
    seconds: float
    peak_rss: tuple[int, ...] = ()  # bytes, per rank, at the end
    format: str | None = None  # the checkpoint's format when `merged` was one, merged in memory
    notes: tuple[str, ...] = ()  # what its merge said (a tied head's copy checked, tensors left out)
    reference_format: str | None = None  # the reference's format when it was a checkpoint too
    reference_notes: tuple[str, ...] = ()

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks) and (self.logits is None or self.logits.passed)


def verify(opts: VerifyOptions, comm: Comm) -> VerifyResult:
    """Collective: every rank calls it and gets the same result.

    `opts.merged` a finished model: its files are compared with the reference. A checkpoint (anything `merge`
    reads; several with settings.average: their average): merged in memory as its InputSpec and `opts.settings`
    say and compared, nothing written (verifier/checkpoint.py); `opts.reference` likewise (kinds.py). The records
    are the same either way."""
    with one_thread():
        return _verify(opts, comm)


def _verify(opts: VerifyOptions, comm: Comm) -> VerifyResult:
    comm.phase("discovery")
    # a checkpoint side on the nodes' own disks (engine/nodes.py): read where it lies, as merge reads it
    spread = nodes.spread_inputs(comm, [*opts.merged.locations, opts.merged.hf_config, opts.merged.base_model,
                                        *opts.reference.locations, opts.reference.hf_config,
                                        opts.reference.base_model])
    if spread is None:
        return _verify_on(opts, comm)
    try:
        return _verify_on(opts, spread.comm(comm), joined=spread.input_of)
    finally:
        spread.close()


def _verify_on(opts: VerifyOptions, comm: Comm | nodes.NodesComm,
               joined: Callable[[InputSpec], InputSpec] | None = None) -> VerifyResult:
    """`joined`: a side's spec with its folder as the nodes joined it, for a checkpoint side to be merged from (a
    finished model's files are looked up by their paths, in the folders the nodes joined: sides.open_side)."""
    start = time.perf_counter()
    merged_ckpt, reference_ckpt = comm.root_only(lambda: kinds(opts))
    if joined is not None:
        opts = replace(opts, merged=joined(opts.merged) if merged_ckpt else opts.merged,
                       reference=joined(opts.reference) if reference_ckpt else opts.reference)
    if merged_ckpt or reference_ckpt:
        got = verify_two_checkpoints(opts, comm) if merged_ckpt and reference_ckpt else verify_checkpoint(
            opts, comm, role="merged" if merged_ckpt else "reference")
        return VerifyResult(checks=sorted(got.checks, key=lambda c: natural_key(c.name)), logits=None,
                            processes=comm.world, per_rank=got.per_rank, device=str(comm.device),
                            seconds=time.perf_counter() - start, peak_rss=_peak_rss(comm), format=got.format,
                            notes=got.notes, reference_format=got.reference_format,
                            reference_notes=got.reference_notes)
    comm.phase("the listing of the tensors (rank 0)")
    listing = comm.root_only(lambda: make_listing(opts))
    comm.phase("the comparison of the tensors")
    comparers = assign_comparers(listing, nodes.nodes_of(comm), comm.world)
    per_rank = comm.gather(lambda: check_mine(listing, opts.criteria, comm, comparers))
    if None in comparers:
        # the files of a pair on different nodes only: rank 0 compares them, reading what other nodes hold through
        # them, while they answer (engine/nodes.py)
        comm.phase("the comparison of the tensors whose files lie on different nodes (rank 0)")
        crossed = comm.root_only(lambda: check_mine(listing, opts.criteria, comm, comparers, crossing=True))
        per_rank[0] = [*per_rank[0], *crossed]
    checks = sorted([*listing.settled, *(c for mine in per_rank for c in mine)],
                    key=lambda c: natural_key(c.name))
    logits = None
    if opts.logits:
        from distmerge.verifier.logits import compare_logits

        comm.phase("the comparison of the logits (rank 0)")
        logits = comm.root_only(lambda: compare_logits(_on_rank_0s_node(listing), opts, comm.device))
    return VerifyResult(checks=checks, logits=logits, processes=comm.world, per_rank=[len(c) for c in per_rank],
                        device=str(comm.device), seconds=time.perf_counter() - start, peak_rss=_peak_rss(comm))


def _on_rank_0s_node(listing: Listing) -> Listing:
    """The listing, when rank 0's node holds both models' files (--logits loads them there with transformers)."""
    away = [f for side in (listing.merged, listing.reference) for f, held in zip(side.files, side.held, strict=False)
            if 0 not in held]
    if away:
        raise InputError(f"--logits loads both models on rank 0's node, and {away[0]} is not on its disk: verify "
                         "without --logits, or run it where one node holds both models")
    return listing


def _peak_rss(comm: Comm) -> tuple[int, ...]:
    """Collective: each rank's peak resident memory so far, in bytes (what --budget bounds)."""
    return tuple(comm.gather(lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024))


def verify_and_report(opts: VerifyOptions, comm: Comm, *, plot: Path | None = None) -> int:
    """Collective: verify, then rank 0 prints and writes the report. Returns the exit status (same on all).

    The entry point for other commands and programs (e.g. a verl-style `test` command): build VerifyOptions
    (listing.py: `merged` a finished model or any checkpoint `merge` reads, `reference` a Hugging Face folder or
    file, plus the merge options a checkpoint needs) and call it inside comm.process_group. Exit status 0 when
    every tensor passes, else 1; errors are raised as DistmergeError on every rank. `plot`: a PNG of the
    figures by layer and kind (verifier/plot.py; matplotlib, checked for before the comparison)."""
    return 0 if verify_and_write(opts, comm, plot=plot, show=True).passed else 1


def verify_and_write(opts: VerifyOptions, comm: Comm, *, plot: Path | None, show: bool) -> VerifyResult:
    """Collective: verify; rank 0 writes opts.json and `plot` and, when `show`, prints the report (distmerge.verify
    of the API: show only with progress=True). The result on every rank."""
    if plot is not None:
        from distmerge.verifier.plot import require_matplotlib, write_plot

        comm.root_only(require_matplotlib)
    result = verify(opts, comm)

    def report() -> None:
        summary = totals(result.checks, opts.criteria)
        if show:
            print_report(result.checks, result.logits, quiet=opts.quiet, merged_from=result.format,
                         notes=result.notes, reference_from=result.reference_format,
                         reference_notes=result.reference_notes, totals=tuple(totals_lines(summary)))
        if opts.json is not None:
            write_json(opts.json, report_json(merged=opts.merged.named, reference=opts.reference.named,
                                              crit=opts.criteria, checks=result.checks, logits=result.logits,
                                              run=_run_record(result), totals=totals_json(summary)))
        if plot is not None:
            write_plot(plot, result.checks, opts.criteria, title=f"distmerge verify: {_short(opts.merged)} vs "
                       f"{_short(opts.reference)}")
        sys.stdout.flush()  # before the other ranks go on: torchrun stops rank 0 when another rank exits 1

    comm.phase("the report (rank 0)")
    comm.root_only(report)
    return result


def _short(spec: InputSpec) -> str:
    """A side in a plot's title: a local folder by its name."""
    return spec.named if len(spec.locations) > 1 or not isinstance(spec.location, Path) else (
        spec.location.name or str(spec.location))


def _run_record(result: VerifyResult) -> dict:
    run = {"processes": result.processes, "compared_per_rank": result.per_rank, "device": result.device,
           "seconds": round(result.seconds, 3), "peak_rss_per_rank": list(result.peak_rss)}
    if result.format is not None:  # merged in memory: from which format, and what its merge said
        run["checkpoint"] = {"format": result.format, "notes": list(result.notes)}
    if result.reference_format is not None:
        run["reference_checkpoint"] = {"format": result.reference_format, "notes": list(result.reference_notes)}
    return run

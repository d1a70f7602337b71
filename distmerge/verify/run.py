"""`distmerge verify`: compare a merged model with a reference state dict, tensor by tensor.

Every rank makes the same calls in this order (with one process the collectives are no-ops):

    phase    who works                                                  collective
    list     rank 0 reads both sides' indexes and (validated) headers,  broadcast   (comm.root_only)
             pairs the names, settles missing / extra / shape
    compare  each rank reads both sides of the tensors in the merged    all_gather  (comm.gather)
             files it owns (plan.assign_owners over file sizes) and
             computes figures on comm.device; sends small records
    logits   --logits only: rank 0 loads both models with transformers  broadcast   (comm.root_only)
    report   rank 0 prints the table and the verdict, writes --json     broadcast   (comm.root_only)

Neither side is ever loaded whole by one process: safetensors files are opened with `safe_open` and
read one tensor at a time, pytorch_model*.bin with `torch.load(mmap=True, weights_only=True)`.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass

from distmerge.comm import Comm, process_group, resolve_device
from distmerge.plan import natural_key
from distmerge.verify.compare import check_mine
from distmerge.verify.listing import VerifyOptions, make_listing
from distmerge.verify.report import Check, Criteria, LogitsCheck, print_report, report_json, write_json


@dataclass(frozen=True, kw_only=True)
class VerifyResult:
    checks: list[Check]
    logits: LogitsCheck | None
    processes: int
    per_rank: list[int]  # tensors each rank compared
    device: str
    seconds: float

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks) and (self.logits is None or self.logits.passed)


def verify(opts: VerifyOptions, comm: Comm) -> VerifyResult:
    """Collective: every rank calls it and gets the same result."""
    start = time.perf_counter()
    listing = comm.root_only(lambda: make_listing(opts))
    per_rank = comm.gather(lambda: check_mine(listing, opts.criteria, comm))
    checks = sorted([*listing.settled, *(c for mine in per_rank for c in mine)],
                    key=lambda c: natural_key(c.name))
    logits = None
    if opts.logits:
        from distmerge.verify.logits import compare_logits

        logits = comm.root_only(lambda: compare_logits(listing, opts, comm.device))
    return VerifyResult(checks=checks, logits=logits, processes=comm.world, per_rank=[len(c) for c in per_rank],
                        device=str(comm.device), seconds=time.perf_counter() - start)


def verify_and_report(opts: VerifyOptions, comm: Comm) -> int:
    """Collective: verify, then rank 0 prints and writes the report. Returns the exit status (same on all)."""
    result = verify(opts, comm)

    def report() -> None:
        print_report(result.checks, result.logits, quiet=opts.quiet)
        if opts.json is not None:
            run = {"processes": result.processes, "compared_per_rank": result.per_rank, "device": result.device,
                   "seconds": round(result.seconds, 3)}
            write_json(opts.json, report_json(merged=str(opts.merged), reference=str(opts.reference),
                                              crit=opts.criteria, checks=result.checks, logits=result.logits, run=run))
        sys.stdout.flush()  # before the other ranks go on: torchrun stops rank 0 when another rank exits 1

    comm.root_only(report)
    return 0 if result.passed else 1


def run_verify(args: argparse.Namespace) -> int:
    """`distmerge verify`: under torchrun or alone."""
    crit = Criteria(atol=args.atol, rtol=args.rtol, min_cosine=args.min_cosine)
    opts = VerifyOptions(merged=args.merged, reference=args.reference, criteria=crit, logits=args.logits,
                         json=args.json, quiet=args.quiet)
    with process_group(device=resolve_device(args.device), timeout_s=args.timeout) as comm:
        return verify_and_report(opts, comm)

"""bench_scale.py's simulation against a real save: discovery and planning measured on real FSDP2 rank files,
beside the same steps on the inventory the simulation generates for the same config and W (issue #14, item 3).

    torchrun --standalone --nproc-per-node 16 tests/bench/make_ckpt.py --out /tmp/dm-w16/fsdp --size 68000000
    python tests/bench/bench_scale_real.py --input /tmp/dm-w16/fsdp [--procs 1 2 4]

`open` = FsdpFormat.open of every rank file, CPU seconds, best of 3 (per file and per DTensor entry: what
each rank's discovery costs); `plan` = inventory.unpack + prepare.prepare_merge for N processes (CPU seconds,
best of 3), on the real inventory and on the simulated one; `inventory` = pickled packed parts, all ranks.
The merge itself (output bytes for N = 1, 2, 4) is run with the CLI, see docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from bench_scale import FP32, Case, fsdp_inventories, gathered, plan_once

from distmerge import plan as planning
from distmerge.discover import discover
from distmerge.formats import registry
from distmerge.formats.base import Scan
from distmerge.prepare import OutputSettings


def best_of(work, repeats: int = 3) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(repeats):
        start = time.process_time()
        out = work()
        best = min(best, time.process_time() - start)
    return best, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input", type=Path, required=True, help="a verl-layout FSDP2 checkpoint folder")
    parser.add_argument("--procs", nargs="+", type=int, default=[1, 2, 4])
    args = parser.parse_args()
    found = discover(args.input.resolve(), "auto", None, {})
    fmt = registry.get(found.scan.format)
    fmt.warm_up()
    seconds, per_file = best_of(lambda: [fmt.open(found.scan, f).fragments for f in found.scan.files])
    world, entries = len(found.scan.files), sum(map(len, per_file))
    real = Case(label="real", scan=found.scan, config=found.config, per_file=per_file)
    files, simulated_frags = fsdp_inventories(world, found.config, FP32)
    simulated = Case(label="simulated", config=found.config, per_file=simulated_frags,
                     scan=Scan(format="fsdp", root="/sim", files=files, hf_dir=None, world_size=world))
    print(f"{args.input}: W={world}, {entries} fragments ({len(simulated_frags[0])} per file simulated); open "
          f"{seconds:.3f} s = {seconds / world * 1e3:.1f} ms per file, {seconds / entries * 1e6:.0f} us per entry")
    print("\n| N | plan s real | plan s simulated | inventory real | inventory simulated | plans equal |")
    print("|" + "---|" * 6)
    for n in args.procs:
        row = []
        plans = []
        for case in (real, simulated):
            parts = gathered(case, planning.assign_readers(case.scan.files, n), n)
            took, plan = best_of(lambda c=case, p=parts, n=n: plan_once(c, p, n, OutputSettings()))
            row += [took, sum(map(len, parts))]
            plans.append([(f.name, f.owner, [t.name for t in f.targets]) for f in plan.files])
        print(f"| {n} | {row[0]:.3f} | {row[2]:.3f} | {row[1] / 1e3:.0f} KB | {row[3] / 1e3:.0f} KB | "
              f"{plans[0] == plans[1]} |")


if __name__ == "__main__":
    main()

"""bench_scale.py's simulation against a real save: discovery and planning measured on real rank files (FSDP2
`.pt` files, or a DCP folder), beside the same steps on the inventory the simulation generates for the same
config and W (issue #14, item 3).

    torchrun --standalone --nproc-per-node 16 tests/bench/make_ckpt.py --out /tmp/dm-w16/fsdp --size 68000000
    torchrun --standalone --nproc-per-node 16 tests/bench/make_ckpt.py --out /tmp/dm-w16/dcp --size 68000000 \
        --layout dcp --wrap model
    python tests/bench/bench_scale_real.py --input /tmp/dm-w16/fsdp [--procs 1 2 4]

`open` = the format's open of every rank file, CPU seconds, best of 3 (per file and per entry: what each rank's
discovery costs). DCP adds `.metadata`: reading and checking it, once per rank (open keeps it cached), CPU
seconds, best of 3, measured apart from the files. `plan` = inventory.unpack + prepare.prepare_merge for N
processes (CPU seconds, best of 3), on the real inventory and on the simulated one; `inventory` = pickled
packed parts, all ranks. The merge itself (output bytes for N = 1, 2, 4) is run with the CLI, see
docs/dev/benchmarks-history.md.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from bench_scale import Case, dcp_inventories, fsdp_inventories, gathered, plan_once

from distmerge.engine import plan as planning
from distmerge.engine.discover import Discovery, discover
from distmerge.engine.prepare import OutputSettings
from distmerge.formats import registry
from distmerge.formats.base import Fragment, Scan
from distmerge.formats.dcp import folder as dcp
from distmerge.formats.torch_private import dcp as dcp_private
from distmerge.input import source

SIMULATED = {"fsdp": fsdp_inventories, "dcp": dcp_inventories}


def best_of(work, repeats: int = 3) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(repeats):
        start = time.process_time()
        out = work()
        best = min(best, time.process_time() - start)
    return best, out


def discovery_costs(found: Discovery) -> tuple[str, list[list[Fragment]]]:
    """One line of measured discovery costs, and the real inventory (each file's fragments)."""
    fmt = registry.get(found.scan.format)
    root = Path(found.scan.root)
    src = source.looking_at(root)
    line = ""
    if found.scan.format == "dcp":
        seconds, md = best_of(lambda: dcp_private.read_metadata(src, root / dcp.METADATA))
        size = (root / dcp.METADATA).stat().st_size
        line = (f"; .metadata ({size / 1e6:.2f} MB, {len(md.chunks)} chunks) {seconds:.3f} s = "
                f"{seconds / len(md.chunks) * 1e6:.0f} us per chunk")
        dcp.load_metadata(src, root)  # open's cache, as on a rank after its first file
    seconds, per_file = best_of(lambda: [fmt.open(src, found.scan, f).fragments for f in found.scan.files])
    world, entries = len(found.scan.files), sum(map(len, per_file))
    return (f"W={world}, {entries} fragments; open {seconds:.3f} s = {seconds / world * 1e3:.1f} ms per file, "
            f"{seconds / entries * 1e6:.0f} us per entry{line}"), per_file


def simulated(found: Discovery, per_file: list[list[Fragment]]) -> Case:
    """bench_scale's inventory for the real save's config, W, dtype and (DCP) key prefix."""
    first = per_file[0][0]
    wrap = first.key[: -len(first.name) - 1] if first.key != first.name else ""  # accelerate: "model"
    options = {"wrap": wrap} if found.scan.format == "dcp" else {}
    world = len(found.scan.files)
    files, frags = SIMULATED[found.scan.format](world, found.config, first.dtype, **options)
    scan = Scan(format=found.scan.format, root="/sim", files=files, hf_dir=None, world_size=world)
    return Case(label="simulated", config=found.config, per_file=frags, scan=scan)


def decisions(plan: planning.Plan, files: tuple) -> tuple[list, tuple]:
    """What the plan decides, by input path rather than index and without byte offsets (the simulation sizes a
    DCP chunk's blob to within 64 bytes): which rank reads each file; and output files with owners and tensors,
    rounds, every tensor's blocks. Readers apart: they are balanced on file sizes, which the simulation knows
    to a few hundred bytes (a torch.save rank file's records carry its name: rank 10's is longer than rank 9's),
    so ties between files of one size may fall to other ranks, with the same balance."""
    path = [f.path for f in files]
    blocks = {name: [(path[g.file_index], g.offsets, g.lengths) for g in source.fragments]
              for name, source in plan.sources.items()}
    outputs = [(f.name, f.owner, [t.name for t in f.targets]) for f in plan.files]
    return sorted(zip(path, plan.readers, strict=True)), (outputs, plan.rounds, plan.owner_of_unit, blocks)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input", type=Path, required=True, help="a verl-layout FSDP2 checkpoint or a DCP folder")
    parser.add_argument("--procs", nargs="+", type=int, default=[1, 2, 4])
    parser.add_argument("--max-shard-size", type=float, default=4e6,
                        help="output file bytes in the plans compared (4e6: 17 files, whose owners depend on N)")
    args = parser.parse_args()
    found = discover(args.input.resolve(), "auto", None, {})
    if found.scan.format not in SIMULATED:
        raise SystemExit(f"{args.input}: a {found.scan.format} save; the simulation makes {', '.join(SIMULATED)}")
    line, per_file = discovery_costs(found)
    real = Case(label="real", scan=found.scan, config=found.config, per_file=per_file)
    sim = simulated(found, per_file)
    sizes = [sum(f.size for f in case.scan.files) for case in (real, sim)]
    print(f"{args.input} ({found.scan.format}): {line}\nfile bytes: real {sizes[0]:,}, simulated {sizes[1]:,} "
          f"({len(sim.per_file[0])} fragments per file simulated)")
    print(f"\nplans at --max-shard-size {args.max_shard_size:g}")
    print("| N | plan s real | plan s simulated | inventory real | inventory simulated | readers equal | "
          "outputs, rounds, blocks equal |")
    print("|" + "---|" * 7)
    settings = OutputSettings(max_shard_bytes=int(args.max_shard_size))
    for n in args.procs:
        row = []
        plans = []
        for case in (real, sim):
            parts = gathered(case, planning.assign_readers(case.scan.files, n), n)
            took, plan = best_of(lambda c=case, p=parts, n=n: plan_once(c, p, n, settings))
            row += [took, sum(map(len, parts))]
            plans.append(decisions(plan, case.scan.files))
        print(f"| {n} | {row[0]:.3f} | {row[2]:.3f} | {row[1] / 1e3:.0f} KB | {row[3] / 1e3:.0f} KB | "
              f"{plans[0][0] == plans[1][0]} | {plans[0][1] == plans[1][1]} |")


if __name__ == "__main__":
    main()

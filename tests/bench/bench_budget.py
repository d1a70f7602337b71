"""Peak RSS per rank against `--budget`: does the budget bound a merge's memory?

    python tests/bench/bench_budget.py [--size 4GB] [--world 8] [--nproc 2] [--budgets 32MiB,128MiB,1GiB]
                                       [--repeats 1] [--work DIR] [--keep]

Makes (once, then reuses, like bench_fsdp.py and in the same work folder) a verl-layout FSDP2 checkpoint of a
Llama-shaped fp32 model with make_ckpt.py, then merges it with `torchrun --nproc-per-node N` once per budget
(rotated when repeated) and prints, per budget, each rank's peak RSS as the kernel counts it (`getrusage`
ru_maxrss, from distmerge's --json-summary), the same minus what a process holds after importing what a merge
imports (measured here, not assumed), and that difference over the budget. The engine keeps two rounds in
flight, so a rank's share of the budget may be held twice: "x budget" near or under 2 means the budget bounds
the memory; a value that grows with the model instead would mean it does not.
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import sys
from pathlib import Path

from common import PY, TORCHRUN, Failed, ensure_checkpoint, gb, machine_line, parse_size, run, show, warm
from compare_outputs import byte_differences
from make_ckpt import llama_shape

# What a merge process has imported before it reads a byte (cli, engine, torch.distributed, rich, formats).
IMPORTS_ONLY = ("import resource, torch.distributed, distmerge.front.cli, distmerge.engine.run, distmerge.report; "
                ""
                "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=parse_size, default=parse_size("4GB"), help="model bytes, fp32 (4GB)")
    parser.add_argument("--world", type=int, default=8, help="training world size W of the checkpoint (8)")
    parser.add_argument("--nproc", type=int, default=2, help="merge processes (2)")
    parser.add_argument("--budgets", default="32MiB,128MiB,1GiB", help="comma-separated --budget values")
    parser.add_argument("--repeats", type=int, default=1, help="runs per budget; the largest peak is kept (1)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/distmerge-bench-budget"), help="checkpoint + outputs")
    parser.add_argument("--keep", action="store_true", help="keep the merged outputs (the checkpoint always kept)")
    parser.add_argument("--max-shard-size", default="5GB", help="passed to distmerge (5GB)")
    return parser.parse_args()


def import_rss(work: Path) -> int:
    """Peak RSS of one process that imports what a merge imports and exits: the floor under every rank."""
    log = work / "logs" / "budget_imports.log"
    run([PY, "-c", IMPORTS_ONLY], log)
    return int(log.read_text().split()[-1])


def merge_once(args: argparse.Namespace, ckpt: Path, budget: str, out: Path) -> tuple[float, list[int], str]:
    summary = args.work / f"summary_budget_{budget}.json"
    summary.unlink(missing_ok=True)
    cmd = [*TORCHRUN, "--standalone", "--nproc-per-node", str(args.nproc), "-m", "distmerge", "merge", "--input",
           str(ckpt), "--output", str(out), "--overwrite", "--quiet", "--budget", budget, "--json-summary",
           str(summary), "--max-shard-size", args.max_shard_size]
    seconds, _ = run(cmd, args.work / "logs" / f"budget_{budget}.log")
    ranks = sorted(json.loads(summary.read_text())["ranks"], key=lambda r: r["rank"])
    return seconds, [r["peak_rss"] for r in ranks], shlex.join(cmd)


def main() -> int:
    args = parse_args()
    args.work = args.work.resolve()
    (args.work / "logs").mkdir(parents=True, exist_ok=True)
    budgets = [b.strip() for b in args.budgets.split(",")]
    peaks: dict[str, list[int]] = {b: [0] * args.nproc for b in budgets}
    seconds: dict[str, list[float]] = {b: [] for b in budgets}
    commands: dict[str, str] = {}
    try:
        ckpt = ensure_checkpoint(args, args.work)
        files = sorted(ckpt.glob("model_world_size_*"))
        warm(files)
        floor = import_rss(args.work)
        for i in range(args.repeats):
            for budget in budgets[i % len(budgets):] + budgets[: i % len(budgets)]:
                took, rss, commands[budget] = merge_once(args, ckpt, budget, args.work / "out" / f"budget_{budget}")
                peaks[budget] = [max(a, b) for a, b in zip(peaks[budget], rss, strict=True)]
                seconds[budget].append(took)
                print(f"  --budget {budget:>7}: {took:6.2f} s, peak RSS per rank {' / '.join(gb(p) for p in rss)}",
                      flush=True)
    except Failed as err:
        print(f"\nFAILED: {err}", file=sys.stderr)
        return 2
    rows = [["--budget", "peak RSS per rank", "minus imports per rank", "(minus imports) / budget", "wall s"]]
    for budget in budgets:
        over = [p - floor for p in peaks[budget]]
        rows.append([budget, " / ".join(gb(p) for p in peaks[budget]), " / ".join(gb(o) for o in over),
                     " / ".join(f"{o / parse_size(budget):.2f}" for o in over), f"{min(seconds[budget]):.2f}"])
    outs = [args.work / "out" / f"budget_{b}" for b in budgets]
    problems = [f"{b}: {p}" for b, o in zip(budgets[1:], outs[1:], strict=True) for p in byte_differences(outs[0], o)]
    print(f"\nimports alone: {gb(floor)} peak RSS (one process)")
    print(show(rows, markdown=False))
    print("check outputs byte-identical across budgets: " + ("OK" if not problems else "FAILED"))
    for p in problems[:20]:
        print(f"    {p}")
    for budget, cmd in commands.items():
        print(f"  {budget}: {cmd}")
    shape = llama_shape(args.size)
    print("\n----- markdown for docs/dev/benchmarks-history.md (and its row of the table in docs/benchmarks.md) -----")
    print(f"- command: `python tests/bench/bench_budget.py --size {args.size / 1e9:g}GB --world {args.world} "
          f"--nproc {args.nproc} --budgets {args.budgets} --repeats {args.repeats}`")
    print(machine_line())
    print(f"- model: {shape['params']:,} params, {shape['num_hidden_layers']} layers, hidden {shape['hidden_size']}; "
          f"checkpoint {len(files)} rank files, {gb(sum(p.stat().st_size for p in files))}; imports alone "
          f"{gb(floor)}\n")
    print(show(rows, markdown=True))
    if not args.keep:
        for out in outs:
            shutil.rmtree(out, ignore_errors=True)
    return 0 if not problems else 1


if __name__ == "__main__":
    raise SystemExit(main())

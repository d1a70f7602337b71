"""Benchmark distmerge on a real FSDP2 checkpoint, side by side with cp+sync and a load-everything baseline.

    python tests/bench/bench_fsdp.py [--size 0.8GB] [--world 8] [--repeats 3] [--work DIR] [--keep]

Makes (once, then reuses) a verl-layout FSDP2 checkpoint of a Llama-shaped fp32 model with make_ckpt.py,
then times, in every repeat and in rotating order so that drift on a shared machine hits all methods alike:
cp (+sync, the physical floor: distmerge fsyncs its output), launch-only (the CLI's imports and parser, and its
process group formed and destroyed: common.LAUNCH_ONLY) under python
and torchrun: start and import, to subtract), distmerge with 1 and 2 processes, and baseline_merge.py.
The page cache stays hot throughout on purpose: the comparison is of the mergers, not of the disk's cold-read speed.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
from pathlib import Path

from baseline_merge import rank_files
from common import (
    HERE,
    PY,
    Bench,
    Failed,
    bench_args,
    close_report,
    ensure_checkpoint,
    gb,
    machine_line,
    parse_size,
    print_checks,
    print_results,
    warm,
)
from compare_outputs import byte_differences, tensor_differences
from make_ckpt import llama_shape

ROWS = ["cp", "cp+sync", "launch N=1", "launch N=2", "distmerge N=1", "distmerge N=2", "baseline", "baseline+sync"]


class FsdpBench(Bench):
    def __init__(self, args: argparse.Namespace, work: Path, ckpt: Path) -> None:
        super().__init__(args, work, ROWS)
        self.ckpt = ckpt

    def baseline(self) -> None:
        dest = self.fresh("baseline")
        cmd = [PY, str(HERE / "baseline_merge.py"), "--input", str(self.ckpt), "--output", str(dest),
               "--max-shard-size", str(parse_size(self.args.max_shard_size)), "--json-summary",
               str(self.work / "summary_baseline.json")]
        # save_file does not fsync; peer() syncs its files right after so it can be compared like-for-like too.
        self.peer("baseline", cmd, dest, self.work / "summary_baseline.json", own_in_line=False)

    def measure(self) -> None:
        super().measure([lambda: self.cp(rank_files(self.ckpt), "model_world_size_*"), lambda: self.launch(1),
                         lambda: self.launch(2), lambda: self.distmerge(1, self.ckpt),
                         lambda: self.distmerge(2, self.ckpt), self.baseline])


def table(bench: FsdpBench, ckpt_bytes: int) -> list[list[str]]:
    med = {row: statistics.median(ts) for row, ts in bench.times.items() if ts}
    floor, base, base_sync = med["cp+sync"], med["baseline"], med["baseline+sync"]
    rows = [["method", "median s", "runs (s)", "GB/s", "x cp+sync", "baseline/this", "(baseline+sync)/this",
             "minus launch s", "own timer s", "own ratio", "peak RSS per rank"]]
    for row in ROWS:
        merge = not row.startswith("launch")
        n = row[-1] if row.startswith("distmerge") else ""
        rows.append([
            row, f"{med[row]:.2f}", " ".join(f"{t:.2f}" for t in bench.times[row]),
            f"{ckpt_bytes / med[row] / 1e9:.3g}" if merge else "",
            f"{med[row] / floor:.2f}" if merge and row != "cp" else "",
            f"{base / med[row]:.2f}" if n else "", f"{base_sync / med[row]:.2f}" if n else "",
            f"{med[row] - med[f'launch N={n}']:.2f}" if n else "",
            f"{statistics.median(bench.inner[row]):.2f}" if row in bench.inner else "",
            f"{statistics.median(bench.inner['baseline']) / statistics.median(bench.inner[row]):.2f}" if n else "",
            " / ".join(gb(p) for p in bench.rss.get(row, [])),
        ])
    return rows


def check(bench: FsdpBench) -> bool:
    return print_checks([
        ("distmerge N=2 vs baseline, tensor by tensor (torch.equal)", tensor_differences(bench.out / "n2",
                                                                                        bench.out / "baseline")),
        ("distmerge N=1 vs N=2, byte for byte (sha256 of every file)", byte_differences(bench.out / "n1",
                                                                                       bench.out / "n2")),
    ])


def main() -> int:
    args = bench_args(__doc__, "/tmp/distmerge-bench", "checkpoint")
    work = args.work.resolve()
    (work / "logs").mkdir(parents=True, exist_ok=True)
    if shutil.disk_usage(work).free < 6 * args.size:
        print(f"warning: {work} has {gb(shutil.disk_usage(work).free)} free; a run needs about {gb(6 * args.size)}")
    try:
        ckpt = ensure_checkpoint(args, work)
        files = rank_files(ckpt)
        ckpt_bytes = sum(p.stat().st_size for p in files)
        warm(files)
        bench = FsdpBench(args, work, ckpt)
        print(f"measuring {len(files)} rank files, {gb(ckpt_bytes)}, hot page cache, {args.repeats} repeat(s)")
        bench.measure()
    except Failed as err:
        print(f"\nFAILED: {err}", file=sys.stderr)
        return 2
    shape = llama_shape(args.size)
    rows = table(bench, ckpt_bytes)
    print_results(bench, rows, "checkpoint bytes")
    ok = check(bench)

    cmdline = (f"python tests/bench/bench_fsdp.py --size {args.size / 1e9:g}GB --world {args.world} "
               f"--repeats {args.repeats} --max-shard-size {args.max_shard_size}")
    print("\n----- markdown for docs/dev/benchmarks-history.md (and its row of the table in docs/benchmarks.md) -----")
    print(f"### FSDP2 (W={args.world}) → safetensors, Llama-shaped {gb(shape['params'] * 4)} fp32\n")
    print(f"- command: `{cmdline}`")
    print(machine_line())
    print(f"- model: {shape['params']:,} params, {shape['num_hidden_layers']} layers, hidden {shape['hidden_size']}, "
          f"vocab {shape['vocab_size']}; checkpoint {len(files)} rank files, {gb(ckpt_bytes)}")
    print(f"- median of {args.repeats} (methods rotated each repeat), hot page cache "
          "(before every timed run the inputs re-read and 3 GiB of memory touched: common.ready); "
          f"distmerge fsyncs its output, "
          "so `cp+sync` is the floor and `baseline+sync` the like-for-like baseline; launch rows are "
          "`import distmerge.engine.run` "
          "as the CLI imports, its process group formed and destroyed (common.LAUNCH_ONLY), "
          "under python (N=1) and torchrun (N=2)"
          ": start the processes, import what a merge "
          "imports (torch, DTensor, rich), exit; own timer = each tool's clock after its imports (distmerge's "
          "JSON `seconds`, the baseline's likewise); own ratio = baseline own / this own\n")
    return close_report(rows, ok, args.keep, bench.out, f"checkpoint kept for reuse in {ckpt} ({gb(ckpt_bytes)})")


if __name__ == "__main__":
    raise SystemExit(main())

"""Benchmark `verify --merged CHECKPOINT` (merged in memory, nothing written) against merge + verify of the output.

    python tests/bench/bench_verify_checkpoint.py [--size 0.8GB] [--world 8] [--repeats 3] [--work DIR] [--keep]

Makes (once, then reuses) the FSDP2 checkpoint of bench_fsdp.py (make_ckpt.py) and, once per run, outside the
timing, its reference: baseline_merge.py's output (a merger that shares no code with distmerge). Then times, in
every repeat and in rotating order: launch-only (N=1, N=2: to subtract), `verify --merged CKPT --reference REF`
with 1 and 2 processes, and with the same process counts `merge` into a fresh folder followed by `verify --merged
OUT --reference REF` (the two-step check it replaces: its rows are the sum of the two commands of one repeat).
Prints the ratios (merge + verify) / verify of the checkpoint and the peak RSS per rank of every command (from
the tools' JSON: distmerge's `peak_rss`, verify's `peak_rss_per_rank`). Hot page cache throughout (common.ready).
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
from pathlib import Path

from baseline_merge import rank_files
from common import (
    HERE,
    PY,
    TORCHRUN,
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
    ready,
    run,
    warm,
)

NS = (1, 2)
ROWS = [*(f"launch N={n}" for n in NS), *(f"verify ckpt N={n}" for n in NS),
        *(row for n in NS for row in (f"merge N={n}", f"verify out N={n}", f"merge+verify N={n}"))]


class VerifyBench(Bench):
    width = 18

    def __init__(self, args: argparse.Namespace, work: Path, ckpt: Path, reference: Path) -> None:
        super().__init__(args, work, ROWS)
        self.ckpt, self.reference = ckpt, reference
        self.ckpt_listing = sorted(p.name for p in ckpt.iterdir())  # to see that verify adds nothing to it
        self.verdicts: dict[str, list[str]] = {}  # row -> each run's JSON verdict

    def verify(self, n: int, merged: Path, row: str) -> float:
        """One timed verify with n processes; records its time, own timer, peak RSS per rank and verdict."""
        report = self.work / f"verify_{n}_{'ckpt' if merged == self.ckpt else 'out'}.json"
        report.unlink(missing_ok=True)
        prefix = [*TORCHRUN, "--standalone", "--nproc-per-node", str(n)] if n > 1 else [PY]
        cmd = [*prefix, "-m", "distmerge", "verify", "--merged", str(merged), "--reference", str(self.reference),
               "--quiet", "--json", str(report)]
        if merged == self.ckpt:
            cmd += ["--max-shard-size", self.args.max_shard_size]
        self.commands.setdefault(row, shlex.join(cmd))
        ready()
        seconds, _ = run(cmd, self.work / "logs" / f"{report.stem}.log")
        data = json.loads(report.read_text())
        peaks = data["run"]["peak_rss_per_rank"]
        self.times[row].append(seconds)
        self.inner.setdefault(row, []).append(data["run"]["seconds"])
        self.keep_peak(row, peaks)
        self.verdicts.setdefault(row, []).append(data["summary"])
        print(f"    {row:<{self.width}} {seconds:8.2f} s  (own timer {data['run']['seconds']:.2f} s, peak RSS per "
              f"rank {' / '.join(gb(p) for p in peaks)})", flush=True)
        return seconds

    def merge_then_verify(self, n: int) -> None:
        self.distmerge(n, self.ckpt, row=f"merge N={n}")
        merge_s = self.times[f"merge N={n}"][-1]
        verify_s = self.verify(n, self.out / f"n{n}", f"verify out N={n}")
        self.times[f"merge+verify N={n}"].append(merge_s + verify_s)
        self.inner.setdefault(f"merge+verify N={n}", []).append(self.inner[f"merge N={n}"][-1]
                                                                + self.inner[f"verify out N={n}"][-1])
        self.keep_peak(f"merge+verify N={n}", [max(a, b) for a, b in zip(self.rss[f"merge N={n}"],
                                                                         self.rss[f"verify out N={n}"], strict=True)])
        self.commands.setdefault(f"merge+verify N={n}", f"(merge N={n}) && (verify out N={n})")

    def measure(self) -> None:
        super().measure([*(lambda n=n: self.launch(n) for n in NS),
                         *(lambda n=n: self.verify(n, self.ckpt, f"verify ckpt N={n}") for n in NS),
                         *(lambda n=n: self.merge_then_verify(n) for n in NS)])


def make_reference(args: argparse.Namespace, work: Path, ckpt: Path) -> Path:
    """baseline_merge.py's output: the reference, made outside the timing (again each run: a few seconds)."""
    ref = work / "reference"
    cmd = [PY, str(HERE / "baseline_merge.py"), "--input", str(ckpt), "--output", str(ref), "--max-shard-size",
           str(parse_size(args.max_shard_size))]
    print(f"making the reference: {shlex.join(cmd)}", flush=True)
    run(cmd, work / "logs" / "reference.log")
    return ref


def table(bench: VerifyBench, ckpt_bytes: int) -> list[list[str]]:
    med = {row: statistics.median(ts) for row, ts in bench.times.items() if ts}
    rows = [["method", "median s", "runs (s)", "GB/s", "(merge+verify)/this", "minus launch s", "own timer s",
             "peak RSS per rank"]]
    for row in ROWS:
        n = row[-1]
        work = not row.startswith("launch")
        rows.append([
            row, f"{med[row]:.2f}", " ".join(f"{t:.2f}" for t in bench.times[row]),
            f"{ckpt_bytes / med[row] / 1e9:.3g}" if work else "",
            f"{med[f'merge+verify N={n}'] / med[row]:.2f}" if row.startswith("verify ckpt") else "",
            f"{med[row] - med[f'launch N={n}'] * (2 if row.startswith('merge+') else 1):.2f}" if work else "",
            f"{statistics.median(bench.inner[row]):.2f}" if row in bench.inner else "",
            " / ".join(gb(p) for p in bench.rss.get(row, [])),
        ])
    return rows


def check(bench: VerifyBench) -> bool:
    """Every verify passed bit-exact, and the in-memory merge left nothing beside the checkpoint."""
    problems = [f"{row}: {v}" for row, vs in bench.verdicts.items() for v in vs if not v.startswith("verify: PASS")]
    written = [p.name for p in bench.ckpt.iterdir() if p.name not in bench.ckpt_listing]
    return print_checks([("every verify passed (JSON verdicts)", problems),
                         ("verify of the checkpoint wrote nothing into it", written)])


def main() -> int:
    args = bench_args(__doc__, "/tmp/distmerge-bench", "checkpoint")
    work = args.work.resolve()
    (work / "logs").mkdir(parents=True, exist_ok=True)
    try:
        ckpt = ensure_checkpoint(args, work)
        files = rank_files(ckpt)
        ckpt_bytes = sum(p.stat().st_size for p in files)
        reference = make_reference(args, work, ckpt)
        warm([*files, *sorted(reference.glob("*.safetensors"))])
        bench = VerifyBench(args, work, ckpt, reference)
        print(f"measuring {len(files)} rank files, {gb(ckpt_bytes)}, hot page cache, {args.repeats} repeat(s)")
        bench.measure()
    except Failed as err:
        print(f"\nFAILED: {err}", file=sys.stderr)
        return 2
    rows = table(bench, ckpt_bytes)
    print_results(bench, rows, "checkpoint bytes", note="merge+verify rows: the sum of the two commands of each "
                  "repeat; their `minus launch` subtracts two launches")
    ok = check(bench)
    cmdline = (f"python tests/bench/bench_verify_checkpoint.py --size {args.size / 1e9:g}GB --world {args.world} "
               f"--repeats {args.repeats} --max-shard-size {args.max_shard_size}")
    print("\n----- markdown for docs/dev/benchmarks-history.md (and its row of the table in docs/benchmarks.md) -----")
    print(f"### verify of an FSDP2 (W={args.world}) checkpoint in memory vs merge + verify, {gb(ckpt_bytes)} fp32\n")
    print(f"- command: `{cmdline}`")
    print(machine_line())
    print(f"- median of {args.repeats} (methods rotated each repeat), hot page cache (common.ready before every "
          "timed run); the reference is baseline_merge.py's output; merge fsyncs its output, verify writes only "
          "its JSON; peak RSS per rank from the tools' JSON\n")
    return close_report(rows, ok, args.keep, bench.out, f"checkpoint kept for reuse in {ckpt} ({gb(ckpt_bytes)})")


if __name__ == "__main__":
    raise SystemExit(main())

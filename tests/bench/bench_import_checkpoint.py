"""Benchmark `distmerge import --to megatron` of a training checkpoint (the FSDP2 checkpoint the merge benchmarks
make), in one pass, side by side with the staged import it replaces (the checkpoint merged into a hidden Hugging
Face folder beside the output, then imported from it, then the folder removed: distmerge before issue #45's one-pass
import, run from another checkout) and with cp of the checkpoint's bytes.

    python tests/bench/bench_import_checkpoint.py --staged-repo /path/to/checkout/with/the/staged/import
        [--size 0.8GB] [--world 8] [--tp 2] [--pp 1] [--repeats 1] [--work DIR] [--keep]

The checkpoint is make_ckpt.py's (common.ensure_checkpoint: made once, reused while its stamp matches, shared with
bench_fsdp.py in /tmp/distmerge-bench). Its Llama shape has 11 layers at 0.8 GB, so --pp defaults to 1. Every
repeat times, in rotating order: cp (+sync) of the rank files, the one-pass import with N=1 and N=2 (this checkout),
the staged import with N=1 and N=2 (--staged-repo first on PYTHONPATH). Page cache hot throughout on purpose.
Peak RSS per rank as bench_import.py measures it (RSS_WRAPPER).

Checks: the four outputs are the same bytes (sha256 of every file).
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import statistics
import sys
from pathlib import Path

from baseline_merge import rank_files
from bench_import import RSS_WRAPPER
from common import (
    PY,
    TORCHRUN,
    Bench,
    Failed,
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

ROWS = ["cp", "cp+sync", "one-pass N=1", "one-pass N=2", "staged N=1", "staged N=2"]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--staged-repo", type=Path, required=True, help="a checkout whose import stages")
    parser.add_argument("--size", type=parse_size, default=parse_size("0.8GB"), help="model bytes, fp32 (0.8GB)")
    parser.add_argument("--world", type=int, default=8, help="the checkpoint's world size (8)")
    parser.add_argument("--tp", type=int, default=2, help="tensor parallel size written (2)")
    parser.add_argument("--pp", type=int, default=1, help="pipeline parallel size written (1: 11 layers at 0.8GB)")
    parser.add_argument("--repeats", type=int, default=1, help="runs per method; the median is reported (1)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/distmerge-bench"), help="checkpoint + outputs")
    parser.add_argument("--keep", action="store_true", help="keep the outputs (the checkpoint always kept)")
    return parser.parse_args()


class CheckpointImportBench(Bench):
    width = 14

    def __init__(self, args: argparse.Namespace, work: Path, ckpt: Path) -> None:
        super().__init__(args, work, ROWS)
        self.ckpt = ckpt
        self.out = work / "out-import-checkpoint"

    def import_(self, n: int, how: str) -> None:
        """One import with n processes: `how` one-pass (this checkout) or staged (--staged-repo first)."""
        row, name = f"{how} N={n}", f"{how}_n{n}"
        dest, rss = self.fresh(name), self.work / f"rss_{name}"
        shutil.rmtree(rss, ignore_errors=True)
        rss.mkdir(parents=True)
        env = ["env", f"PYTHONPATH={self.args.staged_repo.resolve()}"] if how == "staged" else []
        prefix = [*TORCHRUN, "--standalone", "--nproc-per-node", str(n), "--no-python", PY] if n > 1 else [PY]
        args = ["import", "--input", str(self.ckpt), "--output", str(dest), "--tp", str(self.args.tp),
                "--pp", str(self.args.pp), "--quiet"]
        launcher = ["torchrun", "--standalone", "--nproc-per-node", str(n)] if n > 1 else ["python"]
        self.commands.setdefault(row, shlex.join([*env, *launcher, "-m", "distmerge", *args]))
        ready()
        seconds, _ = run([*env, *prefix, "-c", RSS_WRAPPER, str(rss), *args], self.work / "logs" / f"{name}.log")
        peaks = [int((rss / f"rss_{r}").read_text()) for r in range(n)]
        self.times[row].append(seconds)
        self.keep_peak(row, peaks)
        print(f"    {row:<{self.width}} {seconds:8.2f} s  (peak RSS per rank {' / '.join(gb(p) for p in peaks)})",
              flush=True)

    def measure(self) -> None:  # type: ignore[override]
        super().measure([lambda: self.cp(rank_files(self.ckpt), "model_world_size_*"),
                         *(lambda n=n, how=how: self.import_(n, how) for how in ("one-pass", "staged")
                           for n in (1, 2))])


def table(bench: CheckpointImportBench, nbytes: int) -> list[list[str]]:
    med = {row: statistics.median(ts) for row, ts in bench.times.items()}
    rows = [["method", "median s", "runs (s)", "GB/s", "x cp+sync", "staged/this (same N)", "peak RSS per rank"]]
    for row in ROWS:
        staged = row.replace("one-pass", "staged")
        rows.append([row, f"{med[row]:.2f}", " ".join(f"{t:.2f}" for t in bench.times[row]),
                     f"{nbytes / med[row] / 1e9:.3g}", f"{med[row] / med['cp+sync']:.2f}" if row != "cp" else "",
                     f"{med[staged] / med[row]:.2f}" if row.startswith("one-pass") else "",
                     " / ".join(gb(p) for p in bench.rss.get(row, []))])
    return rows


def check(bench: CheckpointImportBench) -> bool:
    from compare_outputs import byte_differences

    out = bench.out
    return print_checks([(f"one-pass N=1 vs {other}, byte for byte (sha256 of every file)",
                          [*byte_differences(out / "one-pass_n1", out / other),
                           *byte_differences(out / "one-pass_n1" / "release", out / other / "release")])
                         for other in ("one-pass_n2", "staged_n1", "staged_n2")])


def main() -> int:
    args = parse_args()
    work = args.work.resolve()
    (work / "logs").mkdir(parents=True, exist_ok=True)
    try:
        ckpt = ensure_checkpoint(args, work)
        files = rank_files(ckpt)
        nbytes = sum(f.stat().st_size for f in files)
        warm(files)
        bench = CheckpointImportBench(args, work, ckpt)
        print(f"measuring import of the FSDP2 checkpoint ({gb(nbytes)}, W={args.world}) to TP={args.tp} x "
              f"PP={args.pp}, hot page cache, {args.repeats} repeat(s)")
        bench.measure()
    except Failed as err:
        print(f"\nFAILED: {err}", file=sys.stderr)
        return 2
    rows = table(bench, nbytes)
    print_results(bench, rows, "rank file bytes")
    ok = check(bench)
    print(f"\n- command: `python tests/bench/bench_import_checkpoint.py --staged-repo DIR --size "
          f"{args.size / 1e9:g}GB --world {args.world} --tp {args.tp} --pp {args.pp} --repeats {args.repeats}`")
    print(machine_line())
    return close_report(rows, ok, args.keep, bench.out, f"checkpoint kept for reuse in {ckpt} ({gb(nbytes)})")


if __name__ == "__main__":
    raise SystemExit(main())

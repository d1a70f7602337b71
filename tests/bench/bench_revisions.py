"""The same merge by several revisions of distmerge, interleaved: did a change make it faster, on this machine, now?

    python tests/bench/bench_revisions.py --input CKPT --revs REV1,REV2[,...] [--nproc 1,2] [--repeats 5]

Checks each revision out (a detached `git worktree` under --work, removed at the end), then for every repeat, every
N and every revision in turn (the order reversed every other repeat) deletes the previous output and syncs,
re-reads the inputs and touches the memory the run will get, as the other benchmarks do (common.ready), and runs
`distmerge merge` from that worktree (PYTHONPATH) with the same venv, into one output folder for every revision
(per-revision folders left the other revisions' 0.8 GB outputs on the disk and in the page cache in between, and
measured one revision up to 2x slower than a commit of the very same tree). Prints each revision's own timer (the JSON
summary's `seconds`: the merge without start-up) per run and its median, and the median's ratio to the first
revision's, and the same for the whole process (wall clock from launch to exit: start-up and imports included,
which the own timer leaves out). Every run's output is digested (sha256 of each file) and compared with the first
revision's, byte for byte. Made for a machine whose
speed drifts from minute to minute (see docs/dev/benchmarks-history.md on this VM): only runs interleaved in one session
compare.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import PY, ROOT, TORCHRUN, Failed, gb, machine_line, ready, run, warm
from compare_outputs import sha256_of


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input", type=Path, required=True, help="checkpoint to merge (kept as it is)")
    parser.add_argument("--revs", required=True, help="git revisions, comma-separated; the first is the reference")
    parser.add_argument("--nproc", default="1,2", help="process counts, comma-separated (1,2)")
    parser.add_argument("--repeats", type=int, default=5, help="runs per revision and N (5)")
    parser.add_argument("--max-shard-size", default="5GB", help="passed to distmerge (5GB)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/distmerge-bench-revisions"), help="worktrees, outputs")
    return parser.parse_args()


def checkout(rev: str, work: Path) -> tuple[str, Path]:
    """(short commit, worktree of it)."""
    sha = subprocess.run(["git", "rev-parse", "--short", rev], cwd=ROOT, check=True, capture_output=True,
                         text=True).stdout.strip()
    tree = work / f"tree-{sha}"
    if not (tree / "distmerge").is_dir():
        subprocess.run(["git", "worktree", "add", "--detach", "-f", str(tree), sha], cwd=ROOT, check=True,
                       capture_output=True)
    return sha, tree


def digest(out: Path) -> dict[str, str]:
    return {p.name: sha256_of(p) for p in sorted(out.iterdir()) if p.is_file()}


def merge(args: argparse.Namespace, tree: Path, n: int, out: Path) -> tuple[float, float]:
    """(own timer, whole process wall time) of one run from `tree`."""
    run(["rm", "-rf", str(out)], args.work / "logs" / "rm.log")
    run(["sync"], args.work / "logs" / "sync.log")
    ready()
    summary = args.work / "summary.json"
    prefix = [*TORCHRUN, "--standalone", "--nproc-per-node", str(n)] if n > 1 else [PY]
    cmd = [*prefix, "-m", "distmerge", "merge", "--input", str(args.input), "--output", str(out), "--quiet",
           "--overwrite", "--max-shard-size", args.max_shard_size, "--json-summary", str(summary)]
    # common.run puts the repository first on PYTHONPATH; the worktree must come before it, and the cwd must not
    # be the repository (python -m puts the cwd first on sys.path).
    with open(args.work / "logs" / "merge.log", "w") as log:
        start = time.perf_counter()
        subprocess.run(cmd, cwd=args.work, env={**os.environ, "PYTHONPATH": str(tree)}, check=True,
                       stdout=log, stderr=subprocess.STDOUT)
        wall = time.perf_counter() - start
    return json.loads(summary.read_text())["seconds"], wall


def main() -> int:
    args = parse_args()
    args.input, args.work = args.input.resolve(), args.work.resolve()
    (args.work / "logs").mkdir(parents=True, exist_ok=True)
    args.inputs = [p for p in args.input.rglob("*") if p.is_file()]
    warm(args.inputs)
    revs = [checkout(r, args.work) for r in args.revs.split(",")]
    try:
        return measure(args, revs)
    finally:  # the worktrees are registered in the repository: remove them (checking out again is quick)
        for _, tree in revs:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, capture_output=True)


def measure(args: argparse.Namespace, revs: list[tuple[str, Path]]) -> int:
    counts = [int(n) for n in args.nproc.split(",")]
    own: dict[tuple[int, str], list[float]] = {}
    whole: dict[tuple[int, str], list[float]] = {}
    digests: dict[tuple[int, str], dict[str, str]] = {}
    print(f"input {args.input} ({gb(sum(p.stat().st_size for p in args.inputs))}); revisions "
          f"{', '.join(sha for sha, _ in revs)}; N in {counts}; {args.repeats} repeats, interleaved")
    try:
        for rep in range(args.repeats):
            for n in counts:
                for sha, tree in (revs if rep % 2 == 0 else revs[::-1]):
                    seconds, wall = merge(args, tree, n, args.work / "out")
                    digests.setdefault((n, sha), digest(args.work / "out"))
                    own.setdefault((n, sha), []).append(seconds)
                    whole.setdefault((n, sha), []).append(wall)
                    print(f"  repeat {rep + 1} N={n} {sha} own {seconds:6.2f} s, whole process {wall:6.2f} s",
                          flush=True)
    except (Failed, subprocess.CalledProcessError) as err:
        print(f"FAILED: {err} (log: {args.work / 'logs' / 'merge.log'})", file=sys.stderr)
        return 2
    print(f"\n{machine_line()}\n")
    for what, times in (("own timer", own), ("whole process", whole)):
        print(f"| N | revision | {what} median s | runs (s) | median / first revision's |")
        print("|---:|---|---:|---|---:|")
        for n in counts:
            first = statistics.median(times[(n, revs[0][0])])
            for sha, _ in revs:
                xs = times[(n, sha)]
                print(f"| {n} | {sha} | {statistics.median(xs):.2f} | {' '.join(f'{x:.2f}' for x in xs)} | "
                      f"{statistics.median(xs) / first:.2f} |")
        print()
    ref = revs[0][0]
    problems = [f"N={n} {sha}" for n in counts for sha, _ in revs[1:] if digests[(n, sha)] != digests[(n, ref)]]
    print(f"\ncheck every revision's output byte-identical to {ref}'s: {'OK' if not problems else problems[:3]}")
    return 0 if not problems else 1


if __name__ == "__main__":
    raise SystemExit(main())

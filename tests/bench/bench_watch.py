"""`distmerge watch --once` over a run of 10 steps, beside 10 `distmerge merge` runs and cp of those bytes.

    python tests/bench/bench_watch.py [--size 0.2GB] [--world 4] [--steps 10] [--nproc 2] [--repeats 3] [--work DIR]

Makes (once, then reuses) a verl-layout FSDP2 checkpoint with make_ckpt.py, then a run folder of `--steps` steps as
verl lays them out (`global_step_N/actor/`, `latest_checkpointed_iteration.txt`), each step's files hard links of
that checkpoint's (the bytes are the same; distinct names, as a run's steps are). In every repeat, in rotating order:

    cp           every step's rank files copied into a fresh folder (+ sync: the floor of writing the bytes)
    watch        one `distmerge watch --once` over the run (N processes): every step merged, one start-up
    merge x K    one `distmerge merge` per step (N processes each): what a loop around a converter does

Each output is digested and the watch's must equal the merges' byte for byte. Peak RSS: the largest process of the
watch's tree (wait4), and per rank for the merges (their JSON summaries).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
import statistics
import sys
from pathlib import Path

from common import PY, TORCHRUN, Bench, Failed, ensure_checkpoint, gb, machine_line, parse_size, ready, run, show, warm

ROWS = ["cp", "cp+sync", "watch --once", "merge x K"]


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=parse_size, default=parse_size("0.2GB"), help="model bytes, fp32 (0.2GB)")
    parser.add_argument("--world", type=int, default=4, help="training world size W (4)")
    parser.add_argument("--steps", type=int, default=10, help="steps in the run (10)")
    parser.add_argument("--nproc", type=int, default=2, help="processes of each watch and merge (2)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per method; the median is reported (3)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/distmerge-bench-watch"))
    parser.add_argument("--max-shard-size", default="5GB")
    return parser.parse_args()


def make_run(ckpt: Path, run_dir: Path, steps: int) -> list[Path]:
    """verl's layout, each step's files hard links of the checkpoint's; the step folders, in order."""
    folders = []
    if not (run_dir / "latest_checkpointed_iteration.txt").exists():
        for k in range(1, steps + 1):
            actor = run_dir / f"global_step_{10 * k}" / "actor"
            for src in ckpt.rglob("*"):
                dest = actor / src.relative_to(ckpt)
                if src.is_dir():
                    dest.mkdir(parents=True, exist_ok=True)
                else:
                    dest.parent.mkdir(parents=True, exist_ok=True)
                    os.link(src, dest)
        (run_dir / "latest_checkpointed_iteration.txt").write_text(str(10 * steps))
    for k in range(1, steps + 1):
        folders.append(run_dir / f"global_step_{10 * k}" / "actor")
    return folders


def digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*.safetensors"))}


class WatchBench(Bench):
    width = 13

    def __init__(self, args: argparse.Namespace, work: Path, run_dir: Path, steps: list[Path]) -> None:
        super().__init__(args, work, ROWS)
        self.run_dir, self.steps = run_dir, steps
        self.prefix = [*TORCHRUN, "--standalone", "--nproc-per-node", str(args.nproc)] if args.nproc > 1 else [PY]

    def copy(self) -> None:
        files = [p for step in self.steps for p in sorted(step.glob("model_world_size_*"))]
        dest = self.fresh("cp")
        dest.mkdir(parents=True)
        ready()
        total = 0.0
        for i, step in enumerate(self.steps):  # one folder per step: the same names in every step
            (dest / str(i)).mkdir()
            names = [str(p) for p in sorted(step.glob("model_world_size_*"))]
            seconds, _ = run(["cp", *names, str(dest / str(i))], self.work / "logs" / "cp.log")
            total += seconds
        copies = [str(p) for p in dest.rglob("model_world_size_*")]
        sync_s, _ = run(["sync", *copies], self.work / "logs" / "sync.log")
        self.commands.setdefault("cp", f"cp STEP/actor/model_world_size_* DEST/i/  (for each of the {len(self.steps)} "
                                       f"steps: {gb(sum(p.stat().st_size for p in files))})")
        self.times["cp"].append(total)
        self.times["cp+sync"].append(total + sync_s)
        print(f"    {'cp':<{self.width}} {total:8.2f} s  (+ sync {sync_s:.2f} s = {total + sync_s:.2f} s)", flush=True)

    def watch(self) -> None:
        dest = self.fresh("watch")
        cmd = [*self.prefix, "-m", "distmerge", "watch", "--once", "--input", str(self.run_dir), "--output", str(dest),
               "--quiet", "--max-shard-size", self.args.max_shard_size]
        self.commands.setdefault("watch --once", shlex.join(cmd))
        ready()
        seconds, rss = run(cmd, self.work / "logs" / "watch.log")
        self.times["watch --once"].append(seconds)
        self.keep_peak("watch --once", [rss])
        print(f"    {'watch --once':<{self.width}} {seconds:8.2f} s  (peak RSS, largest process {gb(rss)})", flush=True)

    def merges(self) -> None:
        dest = self.fresh("merges")
        ready()
        total, peaks = 0.0, [0] * self.args.nproc
        for step in self.steps:
            rel = step.relative_to(self.run_dir)
            summary = self.work / "summary_merge.json"
            cmd = [*self.prefix, "-m", "distmerge", "merge", "--input", str(step), "--output", str(dest / rel),
                   "--quiet", "--json-summary", str(summary), "--max-shard-size", self.args.max_shard_size]
            self.commands.setdefault("merge x K", shlex.join(cmd) + f"  (for each of the {len(self.steps)} steps)")
            seconds, _ = run(cmd, self.work / "logs" / "merge.log")
            total += seconds
            ranks = sorted(json.loads(summary.read_text())["ranks"], key=lambda r: r["rank"])
            peaks = [max(a, r["peak_rss"]) for a, r in zip(peaks, ranks, strict=True)]
        self.times["merge x K"].append(total)
        self.keep_peak("merge x K", peaks)
        print(f"    {'merge x K':<{self.width}} {total:8.2f} s  (peak RSS per rank "
              f"{' / '.join(gb(p) for p in peaks)})", flush=True)


def main() -> int:
    args = parse()
    work = args.work
    (work / "logs").mkdir(parents=True, exist_ok=True)
    ckpt = ensure_checkpoint(args, work)
    run_dir = work / "run"
    steps = make_run(ckpt, run_dir, args.steps)
    warm(sorted(ckpt.glob("model_world_size_*")))
    bench = WatchBench(args, work, run_dir, steps)
    try:
        bench.measure([bench.copy, bench.watch, bench.merges])
    except Failed as err:
        print(f"FAILED: {err}")
        return 1
    rels = [s.relative_to(run_dir) for s in steps]
    outputs = [(bench.out / "watch" / rel, bench.out / "merges" / rel) for rel in rels]
    same = all(digest(a) and digest(a) == digest(b) for a, b in outputs)
    med = {row: statistics.median(v) for row, v in bench.times.items() if v}
    size = sum(p.stat().st_size for p in ckpt.glob("model_world_size_*")) * len(steps)
    rows = [["method", "s (median)", "GB/s", "x watch", "peak RSS"]]
    for row in ROWS:
        peaks = bench.rss.get(row)
        rows.append([row, f"{med[row]:.2f}", f"{size / med[row] / 1e9:.2f}", f"{med[row] / med['watch --once']:.2f}",
                     " / ".join(gb(p) for p in peaks) if peaks else "-"])
    print(f"\nresults (median of {args.repeats}; {len(steps)} steps of {gb(size / len(steps))}, N={args.nproc}; "
          "hot page cache):")
    print(show(rows, markdown=False))
    print("\ncommands:")
    for row, cmd in bench.commands.items():
        print(f"  {row}: {cmd}")
    print("\n----- markdown -----")
    print(machine_line())
    print(show(rows, markdown=True))
    print(f"\noutputs identical (watch vs merges, every step): {'OK' if same else 'FAILED'}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())

"""Benchmark distmerge on a real FSDP2 checkpoint, side by side with cp+sync and a load-everything baseline.

    python tests/bench/bench_fsdp.py [--size 0.8GB] [--world 8] [--repeats 3] [--work DIR] [--keep]

Makes (once, then reuses) a verl-layout FSDP2 checkpoint of a Llama-shaped fp32 model with make_ckpt.py,
then times, in every repeat and in rotating order so that drift on a shared machine hits all methods alike:
cp (+sync, the physical floor: distmerge fsyncs its output), launch-only (`-m distmerge.engine` under python
and torchrun: start and import, to subtract), distmerge with 1 and 2 processes, and baseline_merge.py.
The page cache stays hot throughout on purpose: the comparison is of the mergers, not of the disk's cold-read speed.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import platform
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from baseline_merge import rank_files
from compare_outputs import byte_differences, tensor_differences
from make_ckpt import llama_shape

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
PY = sys.executable
_TR = Path(PY).with_name("torchrun")
TORCHRUN = [str(_TR)] if _TR.exists() else [PY, "-m", "torch.distributed.run"]  # the same launcher either way
UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
ROWS = ["cp", "cp+sync", "launch N=1", "launch N=2", "distmerge N=1", "distmerge N=2", "baseline", "baseline+sync"]


class Failed(Exception):
    pass


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]i?B|B)?\s*", text, re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (try 0.8GB, 500MB)")
    return int(float(m[1]) * UNITS[(m[2] or "").upper()])


def gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


def run(cmd: list[str], log: Path) -> tuple[float, int]:
    """Wall seconds and peak RSS in bytes (largest single process of the tree) of one command."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    with open(log, "w") as out:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
        # wait4 reports this child alone; RUSAGE_CHILDREN would also count every earlier child (the maker).
        _, status, usage = os.wait4(proc.pid, 0)
        seconds = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:])
        raise Failed(f"exit {proc.returncode}: {shlex.join(cmd)}\n--- last lines of {log} ---\n{tail}")
    return seconds, usage.ru_maxrss * 1024  # Linux reports KiB


def ensure_checkpoint(args: argparse.Namespace, work: Path) -> Path:
    """Reuse work/ckpt when its stamp matches these parameters, else build it (the slow part of a run)."""
    import torch

    ckpt, tmp, stamp_path = work / "ckpt", work / "ckpt.partial", work / "ckpt.stamp.json"
    maker = HERE / "make_ckpt.py"
    stamp = {"size": args.size, "world": args.world, "shape": llama_shape(args.size), "torch": torch.__version__,
             "maker_sha256": hashlib.sha256(maker.read_bytes()).hexdigest()}
    if stamp_path.exists() and json.loads(stamp_path.read_text()) == stamp:
        print(f"reusing checkpoint {ckpt} (stamp matches)")
        return ckpt
    for old in (ckpt, tmp):
        shutil.rmtree(old, ignore_errors=True)
    stamp_path.unlink(missing_ok=True)
    cmd = [*TORCHRUN, "--standalone", "--nproc-per-node", str(args.world), str(maker), "--out", str(tmp),
           "--size", str(args.size)]
    print(f"making checkpoint: {shlex.join(cmd)}", flush=True)
    seconds, _ = run(cmd, work / "logs" / "make_ckpt.log")
    print(next(line for line in (work / "logs" / "make_ckpt.log").read_text().splitlines() if "make_ckpt:" in line))
    tmp.rename(ckpt)  # only a finished checkpoint ever gets the name (and the stamp) that allow reuse
    stamp_path.write_text(json.dumps(stamp, indent=2) + "\n")
    print(f"checkpoint made in {seconds:.1f} s")
    return ckpt


class Bench:
    def __init__(self, args: argparse.Namespace, work: Path, ckpt: Path) -> None:
        self.args, self.work, self.ckpt = args, work, ckpt
        self.times: dict[str, list[float]] = {row: [] for row in ROWS}
        self.rss: dict[str, list[int]] = {}  # row -> peak RSS per rank (max over repeats)
        self.inner: dict[str, list[float]] = {}  # distmerge's own "seconds", from its JSON summary
        self.commands: dict[str, str] = {}
        self.out = work / "out"

    def fresh(self, name: str) -> Path:
        dest = self.out / name
        shutil.rmtree(dest, ignore_errors=True)  # outside the timing: every run writes into a new folder
        return dest

    def cp(self) -> None:
        dest, files = self.fresh("cp"), [str(p) for p in rank_files(self.ckpt)]
        dest.mkdir(parents=True)
        self.commands.setdefault("cp", shlex.join(["cp", "-r", *files, str(dest)]))
        cp_s, _ = run(["cp", "-r", *files, str(dest)], self.work / "logs" / "cp.log")
        self.commands.setdefault("cp+sync", f"(cp as above) && sync {dest}/model_world_size_*")
        sync_s, _ = run(["sync", *(str(dest / Path(f).name) for f in files)], self.work / "logs" / "sync.log")
        self.times["cp"].append(cp_s)
        self.times["cp+sync"].append(cp_s + sync_s)
        print(f"    {'cp':<15} {cp_s:8.2f} s  (+ sync {sync_s:.2f} s = {cp_s + sync_s:.2f} s)", flush=True)

    def launch(self, n: int) -> None:
        prefix = [*TORCHRUN, "--standalone", "--nproc-per-node", str(n)] if n > 1 else [PY]
        # Start the processes and import everything a merge imports (torch, DTensor, rich), then exit.
        row, cmd = f"launch N={n}", [*prefix, "-m", "distmerge.engine"]
        self.commands.setdefault(row, shlex.join(cmd))
        seconds, _ = run(cmd, self.work / "logs" / f"launch_n{n}.log")
        self.times[row].append(seconds)
        print(f"    {row:<15} {seconds:8.2f} s", flush=True)

    def distmerge(self, n: int) -> None:
        row, summary = f"distmerge N={n}", self.work / f"summary_n{n}.json"
        prefix = [*TORCHRUN, "--standalone", "--nproc-per-node", str(n)] if n > 1 else [PY]
        summary.unlink(missing_ok=True)
        cmd = [*prefix, "-m", "distmerge", "merge", "--input", str(self.ckpt), "--output", str(self.fresh(f"n{n}")),
               "--overwrite", "--quiet", "--json-summary", str(summary), "--max-shard-size", self.args.max_shard_size]
        self.commands.setdefault(row, shlex.join(cmd))
        seconds, _ = run(cmd, self.work / "logs" / f"distmerge_n{n}.log")
        data = json.loads(summary.read_text())
        peaks = [r["peak_rss"] for r in sorted(data["ranks"], key=lambda r: r["rank"])]
        self.times[row].append(seconds)
        self.inner.setdefault(row, []).append(data["seconds"])
        self.rss[row] = [max(a, b) for a, b in zip(self.rss.get(row, [0] * len(peaks)), peaks, strict=True)]
        print(f"    {row:<15} {seconds:8.2f} s  (own timer {data['seconds']:.2f} s, peak RSS per rank "
              f"{' / '.join(gb(p) for p in peaks)})", flush=True)

    def baseline(self) -> None:
        dest = self.fresh("baseline")
        summary = self.work / "summary_baseline.json"
        cmd = [PY, str(HERE / "baseline_merge.py"), "--input", str(self.ckpt), "--output", str(dest),
               "--max-shard-size", str(parse_size(self.args.max_shard_size)), "--json-summary", str(summary)]
        self.commands.setdefault("baseline", shlex.join(cmd))
        seconds, rss = run(cmd, self.work / "logs" / "baseline.log")
        # save_file does not fsync; sync its files right after so it can be compared like-for-like too.
        written = [str(p) for p in dest.iterdir()]
        sync_s, _ = run(["sync", *written], self.work / "logs" / "sync.log")
        self.commands.setdefault("baseline+sync", f"(baseline as above) && sync {dest}/*")
        self.times["baseline"].append(seconds)
        self.times["baseline+sync"].append(seconds + sync_s)
        self.inner.setdefault("baseline", []).append(json.loads(summary.read_text())["seconds"])
        self.rss["baseline"] = [max(rss, *self.rss.get("baseline", [0]))]
        print(f"    {'baseline':<15} {seconds:8.2f} s  (+ sync {sync_s:.2f} s, peak RSS {gb(rss)})", flush=True)

    def measure(self) -> None:
        actions = [self.cp, lambda: self.launch(1), lambda: self.launch(2), lambda: self.distmerge(1),
                   lambda: self.distmerge(2), self.baseline]
        for i in range(self.args.repeats):
            print(f"  repeat {i + 1}/{self.args.repeats}", flush=True)
            # Rotate the start so each method takes every position in turn (first = coldest imports etc.);
            # neighbours stay the same, which is harmless as each method syncs what it wrote before the next.
            k = i % len(actions)
            for action in actions[k:] + actions[:k]:
                action()


def table(bench: Bench, ckpt_bytes: int) -> list[list[str]]:
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


def show(rows: list[list[str]], markdown: bool) -> str:
    if markdown:
        lines = ["| " + " | ".join(r) + " |" for r in rows]
        lines.insert(1, "|" + "|".join("---" if i == 0 else "---:" for i in range(len(rows[0]))) + "|")
        return "\n".join(lines)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    cells = (zip(r, widths, strict=True) for r in rows)
    return "\n".join("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(row)) for row in cells)


def cpu_name() -> str:
    with open("/proc/cpuinfo") as f:
        names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
    return names[0] if names else platform.machine()


def check(bench: Bench) -> bool:
    ok = True
    for title, problems in [
        ("distmerge N=2 vs baseline, tensor by tensor (torch.equal)", tensor_differences(bench.out / "n2",
                                                                                        bench.out / "baseline")),
        ("distmerge N=1 vs N=2, byte for byte (sha256 of every file)", byte_differences(bench.out / "n1",
                                                                                       bench.out / "n2")),
    ]:
        print(f"check {title}: {'OK' if not problems else 'FAILED'}")
        for p in problems[:20]:
            print(f"    {p}")
        ok = ok and not problems
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=parse_size, default=parse_size("0.8GB"), help="model bytes, fp32 (0.8GB)")
    parser.add_argument("--world", type=int, default=8, help="training world size W of the checkpoint (8)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per method; the median is reported (3)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/distmerge-bench"), help="checkpoint + outputs")
    parser.add_argument("--keep", action="store_true", help="keep the merged outputs (the checkpoint is always kept)")
    parser.add_argument("--max-shard-size", default="5GB", help="passed to distmerge and the baseline (5GB)")
    args = parser.parse_args()
    work = args.work.resolve()
    (work / "logs").mkdir(parents=True, exist_ok=True)
    if shutil.disk_usage(work).free < 6 * args.size:
        print(f"warning: {work} has {gb(shutil.disk_usage(work).free)} free; a run needs about {gb(6 * args.size)}")
    import torch

    try:
        ckpt = ensure_checkpoint(args, work)
        files = rank_files(ckpt)
        ckpt_bytes = sum(p.stat().st_size for p in files)
        for path in files:  # warm the page cache so the first method timed does not pay the cold reads
            with open(path, "rb") as f:
                while f.read(1 << 24):
                    pass
        bench = Bench(args, work, ckpt)
        print(f"measuring {len(files)} rank files, {gb(ckpt_bytes)}, hot page cache, {args.repeats} repeat(s)")
        bench.measure()
    except Failed as err:
        print(f"\nFAILED: {err}", file=sys.stderr)
        return 2
    shape = llama_shape(args.size)
    rows = table(bench, ckpt_bytes)
    print(f"\nresults (median of {args.repeats}; GB/s = checkpoint bytes / s; hot page cache, nothing dropped):")
    print(show(rows, markdown=False))
    print("\ncommands:")
    for row, cmd in bench.commands.items():
        print(f"  {row}: {cmd}")
    ok = check(bench)

    cmdline = (f"python tests/bench/bench_fsdp.py --size {args.size / 1e9:g}GB --world {args.world} "
               f"--repeats {args.repeats} --max-shard-size {args.max_shard_size}")
    # The parent never imports distmerge (it may not be installed): ask it.
    version = subprocess.run([PY, "-m", "distmerge", "--version"], capture_output=True, text=True, cwd=ROOT,
                             env=dict(os.environ, PYTHONPATH=str(ROOT))).stdout.split()[-1]
    print("\n----- markdown for docs/benchmarks.md -----")
    print(f"### FSDP2 (W={args.world}) → safetensors, Llama-shaped {gb(shape['params'] * 4)} fp32\n")
    print(f"- command: `{cmdline}`")
    print(f"- date: {datetime.date.today().isoformat()}; nproc: {len(os.sched_getaffinity(0))}; "
          f"RAM: {os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB; "
          f"CPU: {cpu_name()}; torch {torch.__version__}; distmerge {version}; "
          f"Python {platform.python_version()}")
    print(f"- model: {shape['params']:,} params, {shape['num_hidden_layers']} layers, hidden {shape['hidden_size']}, "
          f"vocab {shape['vocab_size']}; checkpoint {len(files)} rank files, {gb(ckpt_bytes)}")
    print(f"- median of {args.repeats} (methods rotated each repeat), hot page cache; distmerge fsyncs its output, "
          "so `cp+sync` is the floor and `baseline+sync` the like-for-like baseline; launch rows are "
          "`-m distmerge.engine` under python (N=1) and torchrun (N=2): start the processes, import what a merge "
          "imports (torch, DTensor, rich), exit; own timer = each tool's clock after its imports (distmerge's "
          "JSON `seconds`, the baseline's likewise); own ratio = baseline own / this own\n")
    print(show(rows, markdown=True))
    print("----- end -----")
    print(f"\ncorrectness: {'OK' if ok else 'FAILED'}")
    if not args.keep:
        shutil.rmtree(bench.out, ignore_errors=True)
    kept = f"kept in {bench.out}" if args.keep else "deleted (--keep keeps them)"
    print(f"checkpoint kept for reuse in {ckpt} ({gb(ckpt_bytes)}); merged outputs {kept}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())

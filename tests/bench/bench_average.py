"""Benchmark `distmerge merge --average` of K saves of one model against the plain way, beside cp of the K inputs.

    python tests/bench/bench_average.py [--size 0.8GB] [--world 8] [--k 4] [--repeats 3] [--work DIR] [--keep]
    python tests/bench/bench_average.py --by-k [--k 4] [--budget 128MiB]   (memory against K: the issue's bound)

Makes (once, then reuses) K verl-layout FSDP2 checkpoints of the Llama-shaped fp32 model of bench_fsdp.py
(make_ckpt.py, seeds 1234, 1235, ...: K different sets of weights, as K steps of one run), then times, in every
repeat and in rotating order: cp (+sync) of the K inputs (the floor: every input byte read, the output's size
written K times over), launch-only under python and torchrun, distmerge --average with 1 and 2 processes, and the
plain way (peer_average.py: merge each, load all K with from_pretrained, average in torch, save_pretrained).
Checks: distmerge N=1 and N=2 byte-identical; distmerge's tensors equal to the plain way's (torch.equal).

--by-k: distmerge alone, N=1 and N=2, over the first K = 1, 2, ... k inputs (K = 1: a merge of one save), each run
`--repeats` times: peak RSS per rank against K. Memory per rank bounded as for one input means flat in K.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shlex
import shutil
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
    close_report,
    gb,
    machine_line,
    parse_size,
    print_checks,
    print_results,
    ready,
    run,
    warm,
)
from compare_outputs import byte_differences, tensor_differences
from make_ckpt import llama_shape

ROWS = ["cp", "cp+sync", "launch N=1", "launch N=2", "distmerge N=1", "distmerge N=2", "plain", "plain+sync"]
SEED = 1234


def args_of() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=parse_size, default=parse_size("0.8GB"), help="model bytes, fp32 (0.8GB)")
    parser.add_argument("--world", type=int, default=8, help="training world size W of each checkpoint (8)")
    parser.add_argument("--k", type=int, default=4, help="checkpoints averaged (4)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per method; the median is reported (3)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/distmerge-bench-average"), help="inputs + outputs")
    parser.add_argument("--keep", action="store_true", help="keep the outputs (the checkpoints are always kept)")
    parser.add_argument("--max-shard-size", default="5GB", help="passed to distmerge (5GB)")
    parser.add_argument("--by-k", action="store_true", help="peak RSS per rank against K, distmerge alone")
    parser.add_argument("--budget", default="", help="--budget passed to distmerge (its default: 128MiB)")
    return parser.parse_args()


def ensure_inputs(args: argparse.Namespace, work: Path) -> list[Path]:
    """The K checkpoints, each made once by make_ckpt.py with its own seed and reused while its stamp matches."""
    import torch

    maker = HERE / "make_ckpt.py"
    found = []
    for i in range(args.k):
        ckpt, tmp, stamp_path = work / f"ckpt-{i}", work / f"ckpt-{i}.partial", work / f"ckpt-{i}.stamp.json"
        stamp = {"size": args.size, "world": args.world, "seed": SEED + i, "shape": llama_shape(args.size),
                 "torch": torch.__version__, "maker_sha256": hashlib.sha256(maker.read_bytes()).hexdigest()}
        found.append(ckpt)
        if stamp_path.exists() and json.loads(stamp_path.read_text()) == stamp:
            print(f"reusing checkpoint {ckpt} (stamp matches)")
            continue
        for old in (ckpt, tmp):
            shutil.rmtree(old, ignore_errors=True)
        cmd = [*TORCHRUN, "--standalone", "--nproc-per-node", str(args.world), str(maker), "--out", str(tmp),
               "--size", str(args.size), "--seed", str(SEED + i)]
        print(f"making checkpoint: {shlex.join(cmd)}", flush=True)
        seconds, _ = run(cmd, work / "logs" / f"make_ckpt_{i}.log")
        tmp.rename(ckpt)
        stamp_path.write_text(json.dumps(stamp, indent=2) + "\n")
        print(f"checkpoint made in {seconds:.1f} s", flush=True)
    return found


class AverageBench(Bench):
    def __init__(self, args: argparse.Namespace, work: Path, ckpts: list[Path]) -> None:
        super().__init__(args, work, ROWS)
        self.ckpts = ckpts

    def average(self, n: int, k: int | None = None) -> None:
        """distmerge --average of the first k inputs (all: k None) with n processes; k = 1: a merge of one save."""
        ckpts = self.ckpts[: k or len(self.ckpts)]
        more = tuple(a for c in ckpts[1:] for a in ("--input", str(c)))
        budget = ("--budget", self.args.budget) if self.args.budget else ()
        self.distmerge(n, ckpts[0], row=f"K={len(ckpts)} N={n}" if k else "", tag=f"k{k}" if k else "",
                       extra=(*more, *(("--average",) if len(ckpts) > 1 else ()), *budget))

    def plain(self) -> None:
        dest = self.fresh("plain")
        summary = self.work / "summary_plain.json"
        cmd = [PY, str(HERE / "peer_average.py"), *(a for c in self.ckpts for a in ("--input", str(c))),
               "--output", str(dest), "--work", str(self.fresh("plain-work")), "--json-summary", str(summary)]
        self.peer("plain", cmd, dest, summary)

    def copy(self) -> None:
        """cp -r of the K checkpoint folders (their rank files share names) into a fresh folder, then sync."""
        dest = self.fresh("cp")
        dest.mkdir(parents=True)
        cmd = ["cp", "-r", *map(str, self.ckpts), str(dest)]
        self.commands.setdefault("cp", shlex.join(cmd))
        self.commands.setdefault("cp+sync", f"(cp as above) && sync {dest}/*/model_world_size_*")
        ready()
        cp_s, _ = run(cmd, self.work / "logs" / "cp.log")
        sync_s, _ = run(["sync", *map(str, dest.glob("*/model_world_size_*"))], self.work / "logs" / "sync.log")
        self.times["cp"].append(cp_s)
        self.times["cp+sync"].append(cp_s + sync_s)
        print(f"    {'cp':<{self.width}} {cp_s:8.2f} s  (+ sync {sync_s:.2f} s = {cp_s + sync_s:.2f} s)", flush=True)

    def measure(self) -> None:
        super().measure([self.copy, lambda: self.launch(1), lambda: self.launch(2), lambda: self.average(1),
                         lambda: self.average(2), self.plain])


def table(bench: AverageBench, input_bytes: int) -> list[list[str]]:
    med = {row: statistics.median(ts) for row, ts in bench.times.items() if ts}
    rows = [["method", "median s", "runs (s)", "input GB/s", "x cp+sync", "plain/this", "(plain+sync)/this",
             "minus launch s", "own timer s", "peak RSS per rank"]]
    for row in ROWS:
        merge = not row.startswith("launch")
        n = row[-1] if row.startswith("distmerge") else ""
        rows.append([
            row, f"{med[row]:.2f}", " ".join(f"{t:.2f}" for t in bench.times[row]),
            f"{input_bytes / med[row] / 1e9:.3g}" if merge else "",
            f"{med[row] / med['cp+sync']:.2f}" if merge and row != "cp" else "",
            f"{med['plain'] / med[row]:.2f}" if n else "", f"{med['plain+sync'] / med[row]:.2f}" if n else "",
            f"{med[row] - med[f'launch N={n}']:.2f}" if n else "",
            f"{statistics.median(bench.inner[row]):.2f}" if row in bench.inner else "",
            " / ".join(gb(p) for p in bench.rss.get(row, [])),
        ])
    return rows


def by_k(args: argparse.Namespace, work: Path, ckpts: list[Path]) -> int:
    """Peak RSS per rank of distmerge N=1 and N=2 over the first K inputs, K = 1 .. k: the memory bound."""
    runs = [(k, n) for k in range(1, args.k + 1) for n in (1, 2)]
    bench = AverageBench(args, work, ckpts)
    bench.times.update({f"K={k} N={n}": [] for k, n in runs})
    for _ in range(args.repeats):
        for k, n in runs:
            bench.average(n, k)
    rows = [["inputs K", "N=1 peak RSS", "N=1 own timer s", "N=2 peak RSS per rank", "N=2 own timer s"]]
    for k in range(1, args.k + 1):
        one, two = f"K={k} N=1", f"K={k} N=2"
        rows.append([str(k), gb(max(bench.rss[one])), f"{statistics.median(bench.inner[one]):.2f}",
                     " / ".join(gb(p) for p in bench.rss[two]), f"{statistics.median(bench.inner[two]):.2f}"])
    width = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    print("\n" + "\n".join("| " + " | ".join(c.ljust(w) for c, w in zip(r, width, strict=True)) + " |" for r in rows))
    print(f"\n- command: `python tests/bench/bench_average.py --by-k --k {args.k} --repeats {args.repeats}"
          f"{' --budget ' + args.budget if args.budget else ''}`")
    print(machine_line())
    return 0


def main() -> int:
    args = args_of()
    work = args.work.resolve()
    (work / "logs").mkdir(parents=True, exist_ok=True)
    need = (args.k + 4) * args.size
    if shutil.disk_usage(work).free < need:
        print(f"warning: {work} has {gb(shutil.disk_usage(work).free)} free; a run needs about {gb(need)}")
    try:
        ckpts = ensure_inputs(args, work)
        files = [f for c in ckpts for f in rank_files(c)]
        input_bytes = sum(p.stat().st_size for p in files)
        warm(files)
        if args.by_k:
            return by_k(args, work, ckpts)
        bench = AverageBench(args, work, ckpts)
        print(f"measuring the average of {args.k} checkpoints ({len(files)} rank files, {gb(input_bytes)}), hot "
              f"page cache, {args.repeats} repeat(s)")
        bench.measure()
    except Failed as err:
        print(f"\nFAILED: {err}", file=sys.stderr)
        return 2
    shape = llama_shape(args.size)
    rows = table(bench, input_bytes)
    print_results(bench, rows, "input bytes")
    ok = print_checks([
        ("distmerge N=1 vs N=2, byte for byte (sha256 of every file)", byte_differences(bench.out / "n1",
                                                                                       bench.out / "n2")),
        ("distmerge N=2 vs the plain way, tensor by tensor (torch.equal)", tensor_differences(bench.out / "n2",
                                                                                             bench.out / "plain")),
    ])
    cmdline = (f"python tests/bench/bench_average.py --size {args.size / 1e9:g}GB --world {args.world} --k {args.k} "
               f"--repeats {args.repeats}")
    print("\n----- markdown for docs/dev/benchmarks-history.md (and its row of the table in docs/benchmarks.md) -----")
    print(f"### Average of {args.k} FSDP2 (W={args.world}) saves, Llama-shaped {gb(shape['params'] * 4)} fp32 each\n")
    print(f"- command: `{cmdline}`")
    print(machine_line())
    print(f"- model: {shape['params']:,} params, {shape['num_hidden_layers']} layers, hidden {shape['hidden_size']}; "
          f"{args.k} checkpoints of {len(files) // args.k} rank files, {gb(input_bytes)} in all")
    print(f"- median of {args.repeats} (methods rotated each repeat), hot page cache; `cp+sync` copies the "
          f"{args.k} inputs; the plain way (peer_average.py) merges each with distmerge N=1, loads the {args.k} "
          "models with from_pretrained, averages in torch with the same formula, save_pretrained\n")
    return close_report(rows, ok, args.keep, bench.out, f"checkpoints kept for reuse in {work}")


if __name__ == "__main__":
    raise SystemExit(main())

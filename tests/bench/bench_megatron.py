"""Benchmark distmerge on a real Megatron-LM legacy checkpoint (TP x PP), side by side with a load-everything baseline.

    python tests/bench/bench_megatron.py [--size 0.8GB] [--tp 2] [--pp 2] [--repeats 3] [--work DIR] [--keep]

Makes (once, then reuses) a megatron-core GPTModel checkpoint of a Llama-shaped fp32 model with
make_megatron_ckpt.py (iter_0000001/mp_rank_XX_YYY/model_optim_rng.pt, vocab 32001 padded to 128 x TP, and a
config.json folder for --hf-config), then times, every repeat and in rotating order: cp (+sync) of the
mp_rank files (the floor: distmerge fsyncs its output), launch-only (the CLI's imports and parser, and its
process group formed and destroyed: common.LAUNCH_ONLY) under python and
torchrun), distmerge N=1 and N=2, and peer_megatron_baseline.py (+sync), the torch.load-everything converter.
Page cache hot throughout on purpose: the comparison is of the mergers, not of the disk's cold reads.
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
from compare_outputs import byte_differences, tensor_differences, tensor_index
from make_megatron_ckpt import megatron_shape

ROWS = ["cp", "cp+sync", "launch N=1", "launch N=2", "distmerge N=1", "distmerge N=2", "baseline", "baseline+sync"]
SAVE = "iter_0000001"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=parse_size, default=parse_size("0.8GB"), help="model bytes, fp32 (0.8GB)")
    parser.add_argument("--tp", type=int, default=2, help="tensor parallel size of the checkpoint (2)")
    parser.add_argument("--pp", type=int, default=2, help="pipeline parallel size of the checkpoint (2)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per method; the median is reported (3)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/distmerge-bench-megatron"), help="checkpoint + outputs")
    parser.add_argument("--keep", action="store_true", help="keep the merged outputs (the checkpoint always kept)")
    parser.add_argument("--max-shard-size", default="5GB", help="passed to distmerge and the baseline (5GB)")
    return parser.parse_args()


def ensure_checkpoint(args: argparse.Namespace, work: Path) -> tuple[Path, Path]:
    """(checkpoint, hf config folder): reused when the stamp matches these parameters, else built (slow)."""
    from importlib.metadata import version

    import torch

    ckpt, tmp, stamp_path = work / "ckpt", work / "ckpt.partial", work / "ckpt.stamp.json"
    maker = HERE / "make_megatron_ckpt.py"
    stamp = {"size": args.size, "tp": args.tp, "pp": args.pp, "shape": megatron_shape(args.size, args.tp, args.pp),
             "torch": torch.__version__, "megatron_core": version("megatron-core"),
             "maker_sha256": hashlib.sha256(maker.read_bytes()).hexdigest()}
    if stamp_path.exists() and json.loads(stamp_path.read_text()) == stamp:
        print(f"reusing checkpoint {ckpt} (stamp matches)")
        return ckpt, work / "ckpt_hf"
    for old in (ckpt, tmp, work / "ckpt_hf", work / "ckpt.partial_hf"):
        shutil.rmtree(old, ignore_errors=True)
    stamp_path.unlink(missing_ok=True)
    cmd = [*TORCHRUN, "--standalone", "--nproc-per-node", str(args.tp * args.pp), str(maker), "--out", str(tmp),
           "--size", str(args.size), "--tp", str(args.tp), "--pp", str(args.pp)]
    print(f"making checkpoint: {shlex.join(cmd)}", flush=True)
    log = work / "logs" / "make_megatron_ckpt.log"
    seconds, _ = run(cmd, log)
    print(next(line for line in log.read_text().splitlines() if "make_megatron_ckpt:" in line))
    (work / "ckpt.partial_hf").rename(work / "ckpt_hf")
    tmp.rename(ckpt)  # only a finished checkpoint ever gets the name (and the stamp) that allow reuse
    stamp_path.write_text(json.dumps(stamp, indent=2) + "\n")
    print(f"checkpoint made in {seconds:.1f} s")
    return ckpt, work / "ckpt_hf"


def rank_files(ckpt: Path) -> list[Path]:
    return sorted((ckpt / SAVE).glob("mp_rank_*/model_optim_rng.pt"))


class MegatronBench(Bench):
    def __init__(self, args: argparse.Namespace, work: Path, ckpt: Path, hf: Path) -> None:
        super().__init__(args, work, ROWS)
        self.ckpt, self.hf = ckpt, hf

    def cp(self) -> None:
        """cp -r of the save folder (the rank files share one name), then sync of each copied file: a sync of a
        folder would flush only the folder itself."""
        dest = self.fresh("cp")
        dest.mkdir(parents=True)
        cmd = ["cp", "-r", str(self.ckpt / SAVE), str(dest)]
        self.commands.setdefault("cp", shlex.join(cmd))
        ready()
        cp_s, _ = run(cmd, self.work / "logs" / "cp.log")
        copied = rank_files(dest)
        self.commands.setdefault("cp+sync", f"(cp as above) && sync {dest}/{SAVE}/mp_rank_*/model_optim_rng.pt")
        sync_s, _ = run(["sync", *map(str, copied)], self.work / "logs" / "sync.log")
        self.times["cp"].append(cp_s)
        self.times["cp+sync"].append(cp_s + sync_s)
        print(f"    {'cp':<{self.width}} {cp_s:8.2f} s  (+ sync {sync_s:.2f} s = {cp_s + sync_s:.2f} s)", flush=True)

    def distmerge(self, n: int) -> None:
        """Bench.distmerge plus --hf-config: Megatron-LM saves no config.json, the user passes one."""
        super().distmerge(n, self.ckpt, extra=("--hf-config", str(self.hf)))

    def baseline(self) -> None:
        dest, summary = self.fresh("baseline"), self.work / "summary_baseline.json"
        cmd = [PY, str(HERE / "peer_megatron_baseline.py"), "--input", str(self.ckpt), "--hf-config", str(self.hf),
               "--output", str(dest), "--max-shard-size", str(parse_size(self.args.max_shard_size)),
               "--json-summary", str(summary)]
        self.peer("baseline", cmd, dest, summary, own_in_line=False)

    def measure(self) -> None:
        super().measure([self.cp, lambda: self.launch(1), lambda: self.launch(2), lambda: self.distmerge(1),
                         lambda: self.distmerge(2), self.baseline])


def table(bench: MegatronBench, ckpt_bytes: int) -> list[list[str]]:
    med = {row: statistics.median(ts) for row, ts in bench.times.items()}
    own = {row: statistics.median(ts) for row, ts in bench.inner.items()}
    floor, base, base_sync = med["cp+sync"], med["baseline"], med["baseline+sync"]
    rows = [["method", "median s", "runs (s)", "GB/s", "x cp+sync", "baseline/this", "(baseline+sync)/this",
             "minus launch s", "own timer s", "own ratio", "peak RSS per rank"]]
    for row in ROWS:
        merge, n = not row.startswith("launch"), row[-1] if row.startswith("distmerge") else ""
        rows.append([
            row, f"{med[row]:.2f}", " ".join(f"{t:.2f}" for t in bench.times[row]),
            f"{ckpt_bytes / med[row] / 1e9:.3g}" if merge else "",
            f"{med[row] / floor:.2f}" if merge and row != "cp" else "",
            f"{base / med[row]:.2f}" if n else "", f"{base_sync / med[row]:.2f}" if n else "",
            f"{med[row] - med[f'launch N={n}']:.2f}" if n else "",
            f"{own[row]:.2f}" if row in own else "",
            f"{own['baseline'] / own[row]:.2f}" if n and "baseline" in own else "",  # a peer may have no own timer
            " / ".join(gb(p) for p in bench.rss.get(row, [])),
        ])
    return rows


def hf_shape_problems(out: Path, hf: Path) -> list[str]:
    """Names and shapes against LlamaForCausalLM built from the config on meta: a check neither merger wrote."""
    import torch
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(hf))
    want = {k: list(v.shape) for k, v in model.state_dict().items()}
    got = {}
    for key, path in tensor_index(out).items():
        with safe_open(str(path), framework="pt") as f:
            got[key] = f.get_slice(key).get_shape()
    return [f"{k}: merged {got.get(k)} vs model {want.get(k)}" for k in sorted(want.keys() | got.keys())
            if got.get(k) != want.get(k)]


def check(bench: MegatronBench) -> bool:
    out = bench.out
    return print_checks([
        ("distmerge N=2 vs baseline, tensor by tensor (torch.equal)", tensor_differences(out / "n2", out / "baseline")),
        ("distmerge N=1 vs N=2, byte for byte (sha256 of every file)", byte_differences(out / "n1", out / "n2")),
        ("distmerge N=2 names and shapes vs LlamaForCausalLM(config)", hf_shape_problems(out / "n2", bench.hf)),
    ])


def main() -> int:
    args = parse_args()
    work = args.work.resolve()
    (work / "logs").mkdir(parents=True, exist_ok=True)
    if shutil.disk_usage(work).free < 6 * args.size:
        print(f"warning: {work} has {gb(shutil.disk_usage(work).free)} free; a run needs about {gb(6 * args.size)}")
    try:
        ckpt, hf = ensure_checkpoint(args, work)
        files = rank_files(ckpt)
        ckpt_bytes = sum(p.stat().st_size for p in files)
        warm(files)
        bench = MegatronBench(args, work, ckpt, hf)
        print(f"measuring {len(files)} mp_rank files, {gb(ckpt_bytes)}, hot page cache, {args.repeats} repeat(s)")
        bench.measure()
    except Failed as err:
        print(f"\nFAILED: {err}", file=sys.stderr)
        return 2
    shape = megatron_shape(args.size, args.tp, args.pp)
    rows = table(bench, ckpt_bytes)
    print_results(bench, rows, "mp_rank file bytes")
    ok = check(bench)

    cmdline = (f"python tests/bench/bench_megatron.py --size {args.size / 1e9:g}GB --tp {args.tp} --pp {args.pp} "
               f"--repeats {args.repeats} --max-shard-size {args.max_shard_size}")
    print("\n----- markdown for docs/dev/benchmarks-history.md (and its row of the table in docs/benchmarks.md) -----")
    print(f"### Megatron legacy (TP={args.tp} x PP={args.pp}) → safetensors, Llama-shaped "
          f"{gb(shape['params'] * 4)} fp32\n")
    print(f"- command: `{cmdline}`")
    print(machine_line())
    print(f"- model: {shape['params']:,} params (padded vocab), {shape['num_hidden_layers']} layers, hidden "
          f"{shape['hidden_size']}, vocab {shape['vocab_size']} padded to {shape['padded_vocab_size']}; checkpoint "
          f"{len(files)} mp_rank files, {gb(ckpt_bytes)}")
    print(f"- median of {args.repeats} (methods rotated each repeat), hot page cache "
          "(before every timed run the inputs re-read and 3 GiB of memory touched: common.ready); "
          f"distmerge fsyncs its output, "
          "so `cp+sync` is the floor and `baseline+sync` the like-for-like baseline; launch rows are "
          "`import distmerge.engine.run` "
          "as the CLI imports, its process group formed and destroyed (common.LAUNCH_ONLY), "
          "under python (N=1) and torchrun (N=2)"
          "; own timer = each tool's clock after its "
          "imports (the baseline imports megatron-core before its clock: unpickling `args` needs it); "
          "own ratio = baseline own / this own\n")
    return close_report(rows, ok, args.keep, bench.out, f"checkpoint kept for reuse in {ckpt} ({gb(ckpt_bytes)})")


if __name__ == "__main__":
    raise SystemExit(main())

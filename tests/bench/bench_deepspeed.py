"""Benchmark distmerge on a real DeepSpeed ZeRO checkpoint, side by side with DeepSpeed's own zero_to_fp32.py.

    python tests/bench/bench_deepspeed.py [--size 0.8GB] [--world 8] [--stage 2] [--repeats 3] [--work DIR] [--keep]

Makes (once per stage, then reuses) a bf16 ZeRO-2 or ZeRO-3 save of a Llama-shaped model with W data-parallel
ranks (make_deepspeed_ckpt.py: a real engine, one AdamW step, engine.save_checkpoint), and next to it, once, the
fp32 master partitions copied out of the optimizer files as plain files (what distmerge has to read). Then
times, every repeat and in rotating order: `cp masters` (+sync: the floor; at stage 3 with the small per-rank
model-states files, which distmerge reads too), `cp optim` (+sync) of the whole optimizer files (the masters
are a third of them, Adam's two moments the rest), launch-only (the CLI's imports and parser, and its
process group formed and destroyed: common.LAUNCH_ONLY) under python and
torchrun), `launch zero_to_fp32` (python importing what zero_to_fp32.py imports), distmerge N=1 and N=2, and
`python <ckpt>/zero_to_fp32.py <ckpt> <out> --safe_serialization` (+sync), the script DeepSpeed copies beside
every save. Page cache hot throughout on purpose: the comparison is of the mergers, not of the disk's cold reads.

The same file extracts the floor's files (`--extract`, in a subprocess), so the parent never imports deepspeed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shlex
import shutil
import statistics
import sys
from importlib.metadata import version
from pathlib import Path

from bench_megatron import hf_shape_problems
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

ROWS = ["cp masters", "cp masters+sync", "cp optim", "cp optim+sync", "launch N=1", "launch N=2",
        "launch zero_to_fp32", "distmerge N=1", "distmerge N=2", "zero_to_fp32", "zero_to_fp32+sync"]
FLOOR = "cp masters+sync"
TAG = "global_step1"
# What zero_to_fp32.py imports before its work (safetensors and huggingface_hub it imports inside the function).
Z2F_IMPORTS = ("import argparse, glob, math, os, re, gc, json, torch, numpy; from tqdm import tqdm; "
               "from deepspeed.utils import logger; from deepspeed.checkpoint.constants import DS_VERSION; "
               "import safetensors.torch, huggingface_hub")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=parse_size, default=parse_size("0.8GB"), help="model bytes, fp32 (0.8GB)")
    parser.add_argument("--world", type=int, default=8, help="data-parallel ranks W of the save (8)")
    parser.add_argument("--stage", type=int, choices=(2, 3), default=2, help="ZeRO stage of the save (2)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per method; the median is reported (3)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/distmerge-bench-deepspeed"), help="saves + outputs")
    parser.add_argument("--keep", action="store_true", help="keep the merged outputs (the saves always kept)")
    parser.add_argument("--max-shard-size", default="5GB", help="passed to distmerge (5GB; zero_to_fp32's default)")
    parser.add_argument("--extract", type=Path, metavar="CKPT", help=argparse.SUPPRESS)  # the floor's files
    parser.add_argument("--dest", type=Path, help=argparse.SUPPRESS)
    return parser.parse_args()


def optim_files(ckpt: Path) -> list[Path]:
    return sorted((ckpt / TAG).glob("*optim_states.pt"), key=lambda p: int(p.name.split("_rank_")[1].split("_")[0]))


def model_state_files(ckpt: Path) -> list[Path]:
    return sorted((ckpt / TAG).glob("*model_states.pt"))


def extract(ckpt: Path, dest: Path) -> None:
    """Write each optimizer file's fp32 master partition(s) as a plain file: the bytes distmerge reads from it."""
    import torch

    dest.mkdir(parents=True)
    for path in optim_files(ckpt):
        state = torch.load(path, map_location="cpu", mmap=True, weights_only=False)["optimizer_state_dict"]
        parts = state.get("single_partition_of_fp32_groups") or state["fp32_flat_groups"]  # stage 1-2 | 3
        with open(dest / path.name.replace("optim_states.pt", "masters.bin"), "wb") as f:
            for t in parts:
                t.detach().contiguous().numpy().tofile(f)


def ensure_checkpoint(args: argparse.Namespace, work: Path) -> tuple[Path, Path]:
    """(save, folder of the extracted master partitions): reused when the stamp matches, else made (slow)."""
    name = f"ckpt-z{args.stage}"
    ckpt, tmp, stamp_path = work / name, work / f"{name}.partial", work / f"{name}.stamp.json"
    floor = work / f"{name}-masters"
    maker = HERE / "make_deepspeed_ckpt.py"
    stamp = {"size": args.size, "world": args.world, "stage": args.stage, "shape": llama_shape(args.size),
             "torch": version("torch"), "deepspeed": version("deepspeed"),
             "maker_sha256": hashlib.sha256(maker.read_bytes()).hexdigest()}
    if stamp_path.exists() and json.loads(stamp_path.read_text()) == stamp and floor.is_dir():
        print(f"reusing checkpoint {ckpt} (stamp matches)")
        return ckpt, floor
    for old in (ckpt, tmp, floor):
        shutil.rmtree(old, ignore_errors=True)
    stamp_path.unlink(missing_ok=True)
    cmd = [*TORCHRUN, "--standalone", "--nproc-per-node", str(args.world), str(maker), "--out", str(tmp),
           "--size", str(args.size), "--stage", str(args.stage)]
    print(f"making checkpoint: {shlex.join(cmd)}", flush=True)
    log = work / "logs" / f"make_deepspeed_ckpt_z{args.stage}.log"
    seconds, _ = run(cmd, log)
    print(next(line for line in log.read_text().splitlines() if "make_deepspeed_ckpt:" in line))
    if "terminate called" in log.read_text():
        raise Failed(f"{log}: a rank aborted at exit")
    run([PY, str(Path(__file__)), "--extract", str(tmp), "--dest", str(floor)], work / "logs" / "extract.log")
    tmp.rename(ckpt)  # only a finished checkpoint ever gets the name (and the stamp) that allow reuse
    stamp_path.write_text(json.dumps(stamp, indent=2) + "\n")
    print(f"checkpoint made in {seconds:.1f} s")
    return ckpt, floor


class DeepSpeedBench(Bench):
    width = 19

    def __init__(self, args: argparse.Namespace, work: Path, ckpt: Path, floor_files: list[Path]) -> None:
        super().__init__(args, work, ROWS)
        self.ckpt, self.floor_files = ckpt, floor_files

    def launch_z2f(self) -> None:
        row, cmd = "launch zero_to_fp32", [PY, "-c", Z2F_IMPORTS]
        self.commands.setdefault(row, shlex.join(cmd))
        ready()
        seconds, _ = run(cmd, self.work / "logs" / "launch_z2f.log")
        self.times[row].append(seconds)
        print(f"    {row:<{self.width}} {seconds:8.2f} s", flush=True)

    def zero_to_fp32(self) -> None:
        dest = self.fresh("zero_to_fp32")
        cmd = [PY, str(self.ckpt / "zero_to_fp32.py"), str(self.ckpt), str(dest), "--safe_serialization"]
        self.peer("zero_to_fp32", cmd, dest)

    def measure(self) -> None:
        super().measure([
            lambda: self.cp(self.floor_files, "*", row="cp masters"),
            lambda: self.cp(optim_files(self.ckpt), "*optim_states.pt", row="cp optim"),
            lambda: self.launch(1), lambda: self.launch(2), self.launch_z2f,
            lambda: self.distmerge(1, self.ckpt), lambda: self.distmerge(2, self.ckpt), self.zero_to_fp32,
        ])


def table(bench: DeepSpeedBench, moved: dict[str, int]) -> list[list[str]]:
    """moved: bytes each row moves, for its GB/s (cp rows: what they copy; mergers: the fp32 model written)."""
    med = {row: statistics.median(ts) for row, ts in bench.times.items()}
    own = {row: statistics.median(ts) for row, ts in bench.inner.items()}
    floor, peer, peer_sync = med[FLOOR], med["zero_to_fp32"], med["zero_to_fp32+sync"]
    rows = [["method", "median s", "runs (s)", "GB/s", "x floor", "zero_to_fp32/this", "(zero_to_fp32+sync)/this",
             "minus launch s", "minus launch x floor", "own timer s", "peak RSS per rank"]]
    for row in ROWS:
        n = row[-1] if row.startswith("distmerge") else ""
        launch = f"launch N={n}" if n else "launch zero_to_fp32" if row == "zero_to_fp32" else ""
        marginal = med[row] - med[launch] if launch else None
        rows.append([
            row, f"{med[row]:.2f}", " ".join(f"{t:.2f}" for t in bench.times[row]),
            f"{moved[row.removesuffix('+sync')] / med[row] / 1e9:.3g}" if not row.startswith("launch") else "",
            f"{med[row] / floor:.2f}" if not row.startswith("launch") and not row.endswith(("masters", "optim"))
            else "",
            f"{peer / med[row]:.2f}" if n else "", f"{peer_sync / med[row]:.2f}" if n else "",
            f"{marginal:.2f}" if marginal is not None else "",
            f"{marginal / floor:.2f}" if marginal is not None else "",
            f"{own[row]:.2f}" if row in own else "",
            " / ".join(gb(p) for p in bench.rss.get(row, [])),
        ])
    return rows


def bytes_read(work: Path) -> str:
    """What distmerge says each rank read (its --json-summary), for comparison with the floor."""
    out = []
    for n in (1, 2):
        ranks = json.loads((work / f"summary_n{n}.json").read_text())["ranks"]
        out.append(f"N={n}: " + " + ".join(gb(r["bytes_read"]) for r in sorted(ranks, key=lambda r: r["rank"])))
    return "; ".join(out)


def check(bench: DeepSpeedBench) -> bool:
    out = bench.out
    return print_checks([
        ("distmerge N=1 vs zero_to_fp32, tensor by tensor (torch.equal)",
         tensor_differences(out / "n1", out / "zero_to_fp32")),
        ("distmerge N=1 vs N=2, byte for byte (sha256 of every file)", byte_differences(out / "n1", out / "n2")),
        ("distmerge N=2 names and shapes vs LlamaForCausalLM(config)",
         hf_shape_problems(out / "n2", bench.ckpt / "huggingface")),
    ])


def main() -> int:
    args = parse_args()
    if args.extract:
        extract(args.extract, args.dest)
        return 0
    work = args.work.resolve()
    (work / "logs").mkdir(parents=True, exist_ok=True)
    if shutil.disk_usage(work).free < 10 * args.size:
        print(f"warning: {work} has {gb(shutil.disk_usage(work).free)} free; a run needs about {gb(10 * args.size)}")
    try:
        ckpt, floor = ensure_checkpoint(args, work)
        masters = sorted(floor.iterdir()) + (model_state_files(ckpt) if args.stage == 3 else [])
        optims = optim_files(ckpt)
        shape = llama_shape(args.size)
        moved = {"cp masters": sum(p.stat().st_size for p in masters),
                 "cp optim": sum(p.stat().st_size for p in optims)}
        moved |= dict.fromkeys(("distmerge N=1", "distmerge N=2", "zero_to_fp32"), shape["params"] * 4)
        warm([*masters, *optims, *model_state_files(ckpt)])
        bench = DeepSpeedBench(args, work, ckpt, masters)
        print(f"measuring ZeRO-{args.stage} W={args.world}: {len(optims)} optimizer files {gb(moved['cp optim'])}, "
              f"floor {gb(moved['cp masters'])}, hot page cache, {args.repeats} repeat(s)")
        bench.measure()
    except Failed as err:
        print(f"\nFAILED: {err}", file=sys.stderr)
        return 2
    rows = table(bench, moved)
    print_results(bench, rows, "bytes each row moves (mergers: the fp32 model)")
    print(f"distmerge read per rank: {bytes_read(work)}; floor {gb(moved['cp masters'])}")
    ok = check(bench)

    ckpt_bytes = sum(p.stat().st_size for p in (ckpt / TAG).iterdir())
    states = model_state_files(ckpt)
    cmdline = (f"python tests/bench/bench_deepspeed.py --size {args.size / 1e9:g}GB --world {args.world} "
               f"--stage {args.stage} --repeats {args.repeats} --max-shard-size {args.max_shard_size}")
    print("\n----- markdown for docs/dev/benchmarks-history.md (and its row of the table in docs/benchmarks.md) -----")
    print(f"### DeepSpeed ZeRO-{args.stage} (bf16, W={args.world}) → safetensors, Llama-shaped "
          f"{gb(shape['params'] * 4)} fp32\n")
    print(f"- command: `{cmdline}`")
    print(f"{machine_line()}; deepspeed {version('deepspeed')}")
    print(f"- model: {shape['params']:,} params, {shape['num_hidden_layers']} layers, hidden {shape['hidden_size']}, "
          f"vocab {shape['vocab_size']}, untied; save `{TAG}`: {len(optims)} optimizer files {gb(moved['cp optim'])}, "
          f"{len(states)} model-states file(s) {gb(sum(p.stat().st_size for p in states))}, {gb(ckpt_bytes)} in all")
    print(f"- median of {args.repeats} (methods rotated each repeat), hot page cache "
          "(before every timed run the inputs re-read and 3 GiB of memory touched: common.ready); "
          f"floor = `cp masters+sync`: the "
          "fp32 master partitions, copied out of the optimizer files once as plain files"
          f"{' (plus the per-rank model-states files)' if args.stage == 3 else ''}, i.e. the bytes distmerge reads; "
          "`cp optim` copies whole optimizer files; launch rows: `import distmerge.engine.run` "
          "as the CLI imports, its process group formed and destroyed (common.LAUNCH_ONLY), under python (N=1) and "
          "torchrun (N=2), and python importing what zero_to_fp32.py imports (torch, deepspeed); minus launch = "
          "median minus the matching launch row; own timer = distmerge's JSON `seconds`\n")
    return close_report(rows, ok, args.keep, bench.out, f"checkpoint kept for reuse in {ckpt} ({gb(ckpt_bytes)})")


if __name__ == "__main__":
    raise SystemExit(main())

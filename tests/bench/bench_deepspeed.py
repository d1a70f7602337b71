"""Benchmark distmerge on a real DeepSpeed ZeRO checkpoint, side by side with DeepSpeed's own zero_to_fp32.py.

    python tests/bench/bench_deepspeed.py [--size 0.55GB] [--stage 2] [--world 4] [--repeats 3] [--work DIR]

Makes (once, then reuses) a checkpoint with make_deepspeed_ckpt.py, then times, every repeat and in rotating
order: cp (+sync) of the optimizer files (all their bytes; distmerge reads only the fp32 master partitions,
about a third of them, so this floor is generous to nobody), launch-only, distmerge N=1 and N=2, and
`python <ckpt>/zero_to_fp32.py <ckpt> <out> --safe_serialization` (+sync). Page cache hot on purpose.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shlex
import shutil
import sys
from pathlib import Path

from bench_megatron import table
from common import (
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
    run,
    warm,
)
from compare_outputs import byte_differences, tensor_differences

ROWS = ["cp", "cp+sync", "launch N=1", "launch N=2", "distmerge N=1", "distmerge N=2", "baseline", "baseline+sync"]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=parse_size, default=parse_size("0.55GB"), help="model bytes, fp32")
    parser.add_argument("--stage", type=int, default=2, choices=(1, 2, 3))
    parser.add_argument("--world", type=int, default=4, help="data-parallel ranks saving the checkpoint (4)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--work", type=Path, default=Path("/tmp/distmerge-bench-deepspeed"))
    parser.add_argument("--keep", action="store_true", help="keep the merged outputs")
    parser.add_argument("--max-shard-size", default="5GB")
    return parser.parse_args()


def ensure_checkpoint(args: argparse.Namespace, work: Path) -> Path:
    maker = Path(__file__).with_name("make_deepspeed_ckpt.py")
    ckpt, stamp_path = work / f"ckpt_z{args.stage}_w{args.world}", work / f"ckpt_z{args.stage}_w{args.world}.stamp"
    stamp = {"size": args.size, "maker": hashlib.sha256(maker.read_bytes()).hexdigest()}
    if stamp_path.exists() and json.loads(stamp_path.read_text()) == stamp:
        print(f"reusing checkpoint {ckpt} (stamp matches)")
        return ckpt
    shutil.rmtree(ckpt, ignore_errors=True)
    cmd = [*TORCHRUN, "--standalone", "--nproc-per-node", str(args.world), str(maker), "--out", str(ckpt),
           "--size", str(args.size), "--stage", str(args.stage)]
    print(f"making checkpoint: {shlex.join(cmd)}", flush=True)
    seconds, _ = run(cmd, work / "logs" / "make_deepspeed_ckpt.log")
    stamp_path.write_text(json.dumps(stamp) + "\n")
    print(f"checkpoint made in {seconds:.1f} s")
    return ckpt


class DeepSpeedBench(Bench):
    def __init__(self, args: argparse.Namespace, work: Path, ckpt: Path) -> None:
        super().__init__(args, work, ROWS)
        self.ckpt = ckpt

    def optim_files(self) -> list[Path]:
        return sorted(self.ckpt.glob("global_step*/*optim_states.pt"))

    def baseline(self) -> None:
        dest = self.fresh("baseline")
        cmd = [PY, str(self.ckpt / "zero_to_fp32.py"), str(self.ckpt), str(dest), "--safe_serialization"]
        self.peer("baseline", cmd, dest)

    def measure(self) -> None:
        super().measure([lambda: self.cp(self.optim_files(), "*optim_states.pt"), lambda: self.launch(1),
                         lambda: self.launch(2), lambda: self.distmerge(1, self.ckpt),
                         lambda: self.distmerge(2, self.ckpt), self.baseline])


def main() -> int:
    args = parse_args()
    work = args.work.resolve()
    (work / "logs").mkdir(parents=True, exist_ok=True)
    try:
        ckpt = ensure_checkpoint(args, work)
        bench = DeepSpeedBench(args, work, ckpt)
        files = bench.optim_files()
        ckpt_bytes = sum(p.stat().st_size for p in files)
        warm(files + sorted(ckpt.glob("global_step*/*model_states.pt")))
        print(f"measuring {len(files)} optimizer files, {gb(ckpt_bytes)}, hot page cache, {args.repeats} repeat(s)")
        bench.measure()
    except Failed as err:
        print(f"\nFAILED: {err}", file=sys.stderr)
        return 2
    rows = table(bench, ckpt_bytes)  # Megatron's table: `baseline` here is zero_to_fp32.py
    print_results(bench, rows, "optimizer file bytes")
    out = bench.out
    ok = print_checks([
        ("distmerge N=2 vs zero_to_fp32, tensor by tensor (torch.equal)",
         tensor_differences(out / "n2", out / "baseline")),
        ("distmerge N=1 vs N=2, byte for byte (sha256 of every file)", byte_differences(out / "n1", out / "n2")),
    ])
    print(f"\n- command: `python tests/bench/bench_deepspeed.py --size {args.size / 1e9:g}GB --stage {args.stage} "
          f"--world {args.world} --repeats {args.repeats}`")
    print(machine_line())
    return close_report(rows, ok, args.keep, out, f"checkpoint kept for reuse in {ckpt}")


if __name__ == "__main__":
    raise SystemExit(main())

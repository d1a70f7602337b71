"""Benchmark merge + quantization in one run against merge to bf16, then a separate quantizer.

    python tests/bench/bench_quantize.py [--size 0.8GB] [--world 8] [--repeats 3] [--work DIR] [--keep]
    python tests/bench/bench_quantize.py --scheme nvfp4 [--repeats 1] [--peer-python .venv-peer/bin/python]

The checkpoint is bench_fsdp.py's (make_ckpt.py: a verl-layout FSDP2 save of a Llama-shaped fp32 model, made
once and reused). Rows, timed in every repeat in rotating order, page cache hot:

    distmerge --quantize N=1, N=2   merge --dtype bf16 --quantize fp8-channel (and fp8-block at N=2): one pass
    distmerge bf16 N=1              merge --dtype bf16: the first step of the two-step path
    compressed-tensors quantize     peer_ct_quantize.py on that bf16 folder: compressed-tensors' own FP8_DYNAMIC path
                                    (+sync: and its output synced, as distmerge fsyncs its own)
    two steps                       distmerge bf16 N=1 + compressed-tensors quantize+sync, per repeat

Peak RSS per rank for each. Checks: fp8-channel N=1 and N=2 byte for byte; the two FP8_DYNAMIC outputs name the same
tensors, and distmerge's dequantized weights are within the FP8 bound of the bf16 merge; how far each side's are is
printed (compressed-tensors divides in bf16 with a bf16 scale, distmerge in float32 with a float32 scale: not the
same bytes, by design).

With --scheme nvfp4 or mxfp4 (bench_fp4.py), the rows are the issue's: torchrun N=2 `--dtype bf16 --quantize SCHEME`
against torchrun N=2 `--dtype bf16` followed by llm-compressor's model_free_ptq (max_workers=2, in .venv-peer:
peer_model_free_ptq.py), each a whole process; the check: the two outputs' tensors byte for byte.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import bench_fp4
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
    print_checks,
    print_results,
    warm,
)
from compare_outputs import byte_differences
from make_ckpt import llama_shape

ROWS = ["distmerge --quantize N=1", "distmerge --quantize N=2", "distmerge fp8-block N=2", "distmerge bf16 N=1",
        "compressed-tensors quantize", "compressed-tensors quantize+sync", "two steps"]
QUANTIZE = ("--dtype", "bf16", "--quantize", "fp8-channel")


class QuantizeBench(Bench):
    width = 28

    def __init__(self, args, work: Path, ckpt: Path) -> None:
        super().__init__(args, work, ROWS)
        self.ckpt = ckpt

    def two_steps(self) -> None:
        self.distmerge(1, self.ckpt, row="distmerge bf16 N=1", tag="_bf16", extra=("--dtype", "bf16"))
        dest = self.fresh("ct")
        cmd = [PY, str(HERE / "peer_ct_quantize.py"), "--input", str(self.out / "n1_bf16"), "--output", str(dest),
               "--json-summary", str(self.work / "summary_ct.json")]
        self.peer("compressed-tensors quantize", cmd, dest, self.work / "summary_ct.json")
        self.times["two steps"].append(self.times["distmerge bf16 N=1"][-1] +
                                       self.times["compressed-tensors quantize+sync"][-1])
        self.rss["two steps"] = [max(self.rss["distmerge bf16 N=1"][0], self.rss["compressed-tensors quantize"][0])]

    def measure(self) -> None:
        super().measure([lambda: self.distmerge(1, self.ckpt, row="distmerge --quantize N=1", tag="_q", extra=QUANTIZE),
                         lambda: self.distmerge(2, self.ckpt, row="distmerge --quantize N=2", tag="_q", extra=QUANTIZE),
                         lambda: self.distmerge(2, self.ckpt, row="distmerge fp8-block N=2", tag="_block",
                                                extra=("--dtype", "bf16", "--quantize", "fp8-block")),
                         self.two_steps])


def table(bench: QuantizeBench) -> list[list[str]]:
    med = {row: statistics.median(ts) for row, ts in bench.times.items() if ts}
    two = med["two steps"]
    rows = [["method", "median s", "runs (s)", "two steps / this", "peak RSS per rank"]]
    for row in ROWS:
        rows.append([row, f"{med[row]:.2f}", " ".join(f"{t:.2f}" for t in bench.times[row]), f"{two / med[row]:.2f}",
                     " / ".join(gb(p) for p in bench.rss.get(row, []))])
    return rows


def agreement(ours: Path, theirs: Path, bf16: Path) -> list[str]:
    """Same tensor names, FP8 weights on both sides; each side's dequantized weights measured against the bf16
    merge they were both quantized from, in units of the FP8 bound (distmerge's must be <= 1). Prints the worst of
    each side and the share of FP8 bytes that are equal."""
    import torch
    from safetensors.torch import load_file

    sys.path.insert(0, str(HERE.parents[1]))
    from distmerge.quantize import fp8, schemes

    def load(folder: Path) -> dict:
        return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}

    a, b, x = load(ours), load(theirs), load(bf16)
    if not (a and b and x):
        return ["an output is missing"]
    problems = [f"names differ: {sorted(set(a) ^ set(b))[:5]}"] if set(a) != set(b) else []
    grid, worst, same, total = schemes.SCHEMES["fp8-channel"], [0.0, 0.0], 0, 0
    for name in sorted(n for n in a if n.endswith(".weight_scale") and n in b):
        w = name.removesuffix("_scale")
        if a[w].dtype != torch.float8_e4m3fn or b[w].dtype != torch.float8_e4m3fn:
            problems.append(f"{w}: not float8_e4m3fn on both sides")
            continue
        limit = fp8.bound(x[w], grid.expand(a[name], tuple(x[w].shape)))
        for i, (q, s) in enumerate(((a[w], a[name]), (b[w], b[name]))):
            worst[i] = max(worst[i], float(((grid.dequantize(q, s) - x[w].float()).abs() / limit).max()))
        same += int((a[w].view(torch.uint8) == b[w].view(torch.uint8)).sum())
        total += a[w].numel()
    print(f"FP8_DYNAMIC against the bf16 merge, in FP8 bounds: distmerge at most {worst[0]:.3f}, compressed-tensors "
          f"(bf16 division and scale) at most {worst[1]:.3f}; equal FP8 bytes {same / max(total, 1):.2%}")
    if worst[0] > 1:
        problems.append(f"distmerge's FP8 weights beyond the FP8 bound of the bf16 merge ({worst[0]:.3f})")
    return problems


def main() -> int:
    args = bench_args(__doc__, "/tmp/distmerge-bench", "checkpoint", more=bench_fp4.options)
    if args.scheme != "fp8":
        return bench_fp4.main(args)
    work = args.work.resolve()
    (work / "logs").mkdir(parents=True, exist_ok=True)
    try:
        ckpt = ensure_checkpoint(args, work)
        files = rank_files(ckpt)
        warm(files)
        bench = QuantizeBench(args, work, ckpt)
        size = gb(sum(p.stat().st_size for p in files))
        print(f"measuring {len(files)} rank files, {size}, {args.repeats} repeat(s)")
        bench.measure()
    except Failed as err:
        print(f"\nFAILED: {err}", file=sys.stderr)
        return 2
    shape = llama_shape(args.size)
    rows = table(bench)
    print_results(bench, rows, "-")
    ok = print_checks([
        ("--quantize N=1 vs N=2, byte for byte", byte_differences(bench.out / "n1_q", bench.out / "n2_q")),
        ("distmerge vs compressed-tensors FP8_DYNAMIC: names, FP8 weights, values", agreement(bench.out / "n1_q",
                                                                                               bench.out / "ct",
                                                                                               bench.out / "n1_bf16")),
    ])
    cmdline = f"python tests/bench/bench_quantize.py --size {args.size / 1e9:g}GB --world {args.world} " \
              f"--repeats {args.repeats}"
    print("\n----- markdown for docs/quantize.md -----")
    print(f"- command: `{cmdline}`")
    print(machine_line())
    print(f"- model: {shape['params']:,} params, {shape['num_hidden_layers']} layers, hidden {shape['hidden_size']}; "
          f"checkpoint {len(files)} fp32 rank files; outputs bf16 + FP8; median of {args.repeats}\n")
    return close_report(rows, ok, args.keep, bench.out, f"checkpoint kept for reuse in {ckpt}")


if __name__ == "__main__":
    raise SystemExit(main())

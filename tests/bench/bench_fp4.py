"""bench_quantize.py --scheme nvfp4 | mxfp4: merge + 4-bit quantization in one run against the two-step path the
issue names, on bench_fsdp.py's checkpoint (a verl FSDP2 save, fp32):

    distmerge --quantize N=2   torchrun N=2 merge --dtype bf16 --quantize SCHEME: one pass, a whole process
    distmerge bf16 N=2         torchrun N=2 merge --dtype bf16: the first step
    model_free_ptq             llm-compressor 0.14's model_free_ptq on that folder (scheme NVFP4A16 or MXFP4A16,
                               ignore lm_head and the embeddings, max_workers=2), in its own environment
                               (.venv-peer: launch/setup_peer.sh), a whole process (+sync: its output synced, as
                               distmerge fsyncs its own)
    two steps                  distmerge bf16 N=2 + model_free_ptq+sync

The check: both outputs hold the same tensors, byte for byte.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from baseline_merge import rank_files
from common import (
    HERE,
    ROOT,
    Bench,
    Failed,
    close_report,
    ensure_checkpoint,
    gb,
    machine_line,
    print_checks,
    print_results,
    warm,
)
from make_ckpt import llama_shape

PRESETS = {"nvfp4": "NVFP4A16", "mxfp4": "MXFP4A16"}


def options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--scheme", choices=("fp8", *PRESETS), default="fp8",
                        help="fp8 (the FP8 rows), or a 4-bit scheme against model_free_ptq")
    parser.add_argument("--peer-python", type=Path, default=ROOT / ".venv-peer" / "bin" / "python",
                        help="llm-compressor's environment (launch/setup_peer.sh)")


class Fp4Bench(Bench):
    width = 26

    def __init__(self, args, work: Path, ckpt: Path) -> None:
        self.rows = [f"distmerge --quantize {args.scheme} N=2", "distmerge bf16 N=2", "model_free_ptq",
                     "model_free_ptq+sync", "two steps"]
        super().__init__(args, work, self.rows)
        self.ckpt = ckpt

    def one_pass(self) -> None:
        self.distmerge(2, self.ckpt, row=self.rows[0], tag="_q",
                       extra=("--dtype", "bf16", "--quantize", self.args.scheme))

    def two_steps(self) -> None:
        self.distmerge(2, self.ckpt, row="distmerge bf16 N=2", tag="_bf16", extra=("--dtype", "bf16"))
        dest = self.fresh("peer")
        cmd = [str(self.args.peer_python), str(HERE / "peer_model_free_ptq.py"), "--input", str(self.out / "n2_bf16"),
               "--output", str(dest), "--scheme", PRESETS[self.args.scheme], "--max-workers", "2",
               "--json-summary", str(self.work / "summary_peer.json")]
        self.peer("model_free_ptq", cmd, dest, self.work / "summary_peer.json")
        self.times["two steps"].append(self.times["distmerge bf16 N=2"][-1] + self.times["model_free_ptq+sync"][-1])
        self.rss["two steps"] = [max(max(self.rss["distmerge bf16 N=2"]), self.rss["model_free_ptq"][0])]

    def measure(self) -> None:
        super().measure([self.one_pass, self.two_steps])


def table(bench: Fp4Bench) -> list[list[str]]:
    med = {row: statistics.median(ts) for row, ts in bench.times.items() if ts}
    two = med["two steps"]
    rows = [["method", "median s", "runs (s)", "two steps / this", "peak RSS per rank"]]
    for row in bench.rows:
        rows.append([row, f"{med[row]:.2f}", " ".join(f"{t:.2f}" for t in bench.times[row]), f"{two / med[row]:.2f}",
                     " / ".join(gb(p) for p in bench.rss.get(row, []))])
    return rows


def same_tensors(ours: Path, theirs: Path) -> list[str]:
    import torch
    from safetensors import safe_open

    def load(folder: Path) -> dict:
        out = {}
        for f in sorted(folder.glob("*.safetensors")):
            with safe_open(f, "pt") as h:
                out |= {k: h.get_tensor(k) for k in h.keys()}  # noqa: SIM118 (safe_open is not iterable)
        return out

    a, b = load(ours), load(theirs)
    if not (a and b):
        return ["an output is missing"]
    problems = [f"names differ: {sorted(set(a) ^ set(b))[:5]}"] if set(a) != set(b) else []
    for name in sorted(set(a) & set(b)):
        x, y = a[name], b[name]
        if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(x.view(torch.uint8), y.view(torch.uint8)):
            problems.append(f"{name}: differs")
    print(f"compared {len(a)} tensors ({sum(n.endswith('_packed') for n in a)} packed weights)")
    return problems


def main(args: argparse.Namespace) -> int:
    work = args.work.resolve()
    (work / "logs").mkdir(parents=True, exist_ok=True)
    if not args.peer_python.exists():
        print(f"FAILED: {args.peer_python} is missing: bash launch/setup_peer.sh makes it")
        return 2
    try:
        ckpt = ensure_checkpoint(args, work)
        files = rank_files(ckpt)
        warm(files)
        bench = Fp4Bench(args, work, ckpt)
        print(f"measuring {len(files)} rank files, {gb(sum(p.stat().st_size for p in files))}, {args.repeats} "
              "repeat(s)")
        bench.measure()
    except Failed as err:
        print(f"\nFAILED: {err}")
        return 2
    rows = table(bench)
    print_results(bench, rows, "-")
    ok = print_checks([(f"distmerge --quantize {args.scheme} vs model_free_ptq {PRESETS[args.scheme]}: every tensor, "
                        "byte for byte", same_tensors(bench.out / "n2_q", bench.out / "peer"))])
    shape = llama_shape(args.size)
    print("\n----- markdown for docs/quantize.md -----")
    print(f"- command: `python tests/bench/bench_quantize.py --scheme {args.scheme} --size {args.size / 1e9:g}GB "
          f"--world {args.world} --repeats {args.repeats}`")
    print(machine_line())
    print(f"- model: {shape['params']:,} params, {shape['num_hidden_layers']} layers, hidden {shape['hidden_size']}; "
          f"checkpoint {len(files)} fp32 rank files; outputs bf16 + {args.scheme}; median of {args.repeats}\n")
    return close_report(rows, ok, args.keep, bench.out, f"checkpoint kept for reuse in {ckpt}")

"""Benchmark `distmerge import --to megatron` on a Llama-shaped Hugging Face model, side by side with the plain way
(megatron-core converting in one process) and with cp of the same bytes.

    python tests/bench/bench_import.py [--size 0.8GB] [--tp 2] [--pp 2] [--repeats 3] [--work DIR] [--keep]

Makes (once, then reuses) a Hugging Face Llama of about --size fp32 bytes with make_hf_model.py (config.json and one
model.safetensors), then times, every repeat and in rotating order: cp (+sync) of model.safetensors (the floor:
distmerge fsyncs its output), distmerge import N=1 and N=2 (torchrun) at TP x PP, and peer_megatron_import.py
(+sync): the Hugging Face state dict loaded whole, megatron-core's GPTModel built at TP=1 in a gloo group of one,
loaded, and saved with dist_checkpointing.save in one process. Page cache hot throughout on purpose.

Peak RSS per rank: each distmerge process reports its own (getrusage at exit, through RSS_WRAPPER, since wait4 on
torchrun sees the largest process of the tree only); the peer is one process (wait4).

Checks: N=1 and N=2 write the same bytes, and the distmerge folder holds the peer's tensors (every torch_dist key's
global tensor equal, torch.equal: the global tensors of a torch_dist save do not depend on TP or PP).
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
from make_hf_model import hf_shape

ROWS = ["cp", "cp+sync", "distmerge N=1", "distmerge N=2", "peer", "peer+sync"]
# Runs `python -m distmerge ARGS` and, at exit, writes this process's peak RSS to DIR/rss_RANK (argv: DIR, ARGS...).
RSS_WRAPPER = ("import atexit, os, resource, runpy, sys\n"
               "out = sys.argv[1]\n"
               "def report():\n"
               "    with open(f\"{out}/rss_{os.environ.get('RANK', '0')}\", 'w') as f:\n"
               "        f.write(str(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024))\n"
               "atexit.register(report)\n"
               "sys.argv = ['distmerge', *sys.argv[2:]]\n"
               "runpy.run_module('distmerge', run_name='__main__')")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=parse_size, default=parse_size("0.8GB"), help="model bytes, fp32 (0.8GB)")
    parser.add_argument("--tp", type=int, default=2, help="tensor parallel size written (2)")
    parser.add_argument("--pp", type=int, default=2, help="pipeline parallel size written (2)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per method; the median is reported (3)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/distmerge-bench-import"), help="model + outputs")
    parser.add_argument("--keep", action="store_true", help="keep the outputs (the model always kept)")
    return parser.parse_args()


def ensure_model(args: argparse.Namespace, work: Path) -> Path:
    """The Hugging Face model folder: reused when its stamp matches these parameters, else made."""
    import torch

    model, tmp, stamp_path = work / "hf", work / "hf.partial", work / "hf.stamp.json"
    maker = HERE / "make_hf_model.py"
    stamp = {"size": args.size, "shape": hf_shape(args.size, True), "torch": torch.__version__,
             "maker_sha256": hashlib.sha256(maker.read_bytes()).hexdigest()}
    if stamp_path.exists() and json.loads(stamp_path.read_text()) == stamp:
        print(f"reusing model {model} (stamp matches)")
        return model
    for old in (model, tmp):
        shutil.rmtree(old, ignore_errors=True)
    cmd = [PY, str(maker), "--out", str(tmp), "--size", str(args.size), "--even-layers"]
    print(f"making model: {shlex.join(cmd)}", flush=True)
    seconds, _ = run(cmd, work / "logs" / "make_hf_model.log")
    tmp.rename(model)
    stamp_path.write_text(json.dumps(stamp, indent=2) + "\n")
    print(f"model made in {seconds:.1f} s")
    return model


class ImportBench(Bench):
    def __init__(self, args: argparse.Namespace, work: Path, model: Path) -> None:
        super().__init__(args, work, ROWS)
        self.model = model

    def copy(self) -> None:
        self.cp([self.model / "model.safetensors"], "model.safetensors")

    def distmerge(self, n: int) -> None:  # type: ignore[override]
        row, dest, rss = f"distmerge N={n}", self.fresh(f"n{n}"), self.work / f"rss_n{n}"
        shutil.rmtree(rss, ignore_errors=True)
        rss.mkdir(parents=True)
        prefix = [*TORCHRUN, "--standalone", "--nproc-per-node", str(n), "--no-python", PY] if n > 1 else [PY]
        args = ["import", "--input", str(self.model), "--output", str(dest), "--tp", str(self.args.tp),
                "--pp", str(self.args.pp), "--quiet"]
        cmd = [*prefix, "-c", RSS_WRAPPER, str(rss), *args]
        launcher = ["torchrun", "--standalone", "--nproc-per-node", str(n)] if n > 1 else [PY]
        self.commands.setdefault(row, shlex.join([*launcher, "-m", "distmerge", *args]) + "  (each process "
                                 "under RSS_WRAPPER, which reports its peak RSS)")
        ready()
        seconds, _ = run(cmd, self.work / "logs" / f"distmerge_n{n}.log")
        peaks = [int((rss / f"rss_{r}").read_text()) for r in range(n)]
        self.times[row].append(seconds)
        self.keep_peak(row, peaks)
        print(f"    {row:<{self.width}} {seconds:8.2f} s  (peak RSS per rank {' / '.join(gb(p) for p in peaks)})",
              flush=True)

    def peer_import(self) -> None:
        dest, summary = self.fresh("peer"), self.work / "summary_peer.json"
        cmd = [PY, str(HERE / "peer_megatron_import.py"), "--input", str(self.model), "--output", str(dest),
               "--json-summary", str(summary)]
        self.peer("peer", cmd, dest / "release", summary)

    def measure(self) -> None:  # type: ignore[override]
        super().measure([self.copy, lambda: self.distmerge(1), lambda: self.distmerge(2), self.peer_import])


def table(bench: ImportBench, nbytes: int) -> list[list[str]]:
    med = {row: statistics.median(ts) for row, ts in bench.times.items()}
    floor, peer, peer_sync = med["cp+sync"], med["peer"], med["peer+sync"]
    rows = [["method", "median s", "runs (s)", "GB/s", "x cp+sync", "peer/this", "(peer+sync)/this",
             "peak RSS per rank"]]
    for row in ROWS:
        mine = row.startswith("distmerge")
        rows.append([row, f"{med[row]:.2f}", " ".join(f"{t:.2f}" for t in bench.times[row]),
                     f"{nbytes / med[row] / 1e9:.3g}", f"{med[row] / floor:.2f}" if row != "cp" else "",
                     f"{peer / med[row]:.2f}" if mine else "", f"{peer_sync / med[row]:.2f}" if mine else "",
                     " / ".join(gb(p) for p in bench.rss.get(row, []))])
    return rows


def tensor_problems(ours: Path, peer: Path) -> list[str]:
    """Every tensor key of the peer's torch_dist save against ours, as global tensors (DCP reads whole tensors)."""
    import torch
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    def tensor_keys(folder: Path) -> dict:
        meta = FileSystemReader(str(folder)).read_metadata().state_dict_metadata
        return {k: m for k, m in meta.items() if isinstance(m, TensorStorageMetadata)}

    mine, theirs = tensor_keys(ours / "release"), tensor_keys(peer / "release")
    problems = [f"{k}: only in {'ours' if k in mine else 'the peer'}" for k in sorted(set(mine) ^ set(theirs))]
    import torch.distributed.checkpoint as dcp

    for key in sorted(set(mine) & set(theirs)):
        a = torch.empty(tuple(mine[key].size), dtype=mine[key].properties.dtype)
        b = torch.empty(tuple(theirs[key].size), dtype=theirs[key].properties.dtype)
        dcp.load({key: a}, checkpoint_id=str(ours / "release"), no_dist=True)
        dcp.load({key: b}, checkpoint_id=str(peer / "release"), no_dist=True)
        if not torch.equal(a, b):
            problems.append(f"{key}: differs")
    return problems


def check(bench: ImportBench) -> bool:
    from compare_outputs import byte_differences

    out = bench.out
    return print_checks([
        ("distmerge N=1 vs N=2, byte for byte (sha256 of every file)",  # the tracker, and release/'s files
         [*byte_differences(out / "n1", out / "n2"),
          *byte_differences(out / "n1" / "release", out / "n2" / "release")]),
        ("distmerge N=2 vs peer, every torch_dist tensor (torch.equal)", tensor_problems(out / "n2", out / "peer")),
    ])


def main() -> int:
    args = parse_args()
    work = args.work.resolve()
    (work / "logs").mkdir(parents=True, exist_ok=True)
    try:
        model = ensure_model(args, work)
        files = [model / "model.safetensors"]
        nbytes = files[0].stat().st_size
        warm(files)
        bench = ImportBench(args, work, model)
        print(f"measuring import of {gb(nbytes)} to TP={args.tp} x PP={args.pp}, hot page cache, "
              f"{args.repeats} repeat(s)")
        bench.measure()
    except Failed as err:
        print(f"\nFAILED: {err}", file=sys.stderr)
        return 2
    shape = hf_shape(args.size, True)
    rows = table(bench, nbytes)
    print_results(bench, rows, "model.safetensors bytes")
    ok = check(bench)
    cmdline = (f"python tests/bench/bench_import.py --size {args.size / 1e9:g}GB --tp {args.tp} --pp {args.pp} "
               f"--repeats {args.repeats}")
    print("\n----- markdown for docs/dev/benchmarks-history.md (and its row of the table in docs/benchmarks.md) -----")
    print(f"### Import: Hugging Face → Megatron-LM torch_dist (TP={args.tp} x PP={args.pp}), Llama-shaped "
          f"{gb(nbytes)} fp32\n")
    print(f"- command: `{cmdline}`")
    print(machine_line())
    print(f"- model: {shape['params']:,} params, {shape['num_hidden_layers']} layers, hidden {shape['hidden_size']}, "
          f"vocab {shape['vocab_size']}; one model.safetensors of {gb(nbytes)}")
    print(f"- median of {args.repeats} (methods rotated each repeat), hot page cache; distmerge fsyncs its output, "
          "so `cp+sync` is the floor and `peer+sync` the like-for-like peer; the peer is "
          "tests/bench/peer_megatron_import.py (HF state dict loaded whole, megatron-core GPTModel at TP=1 in a "
          "gloo group of one, dist_checkpointing.save in one process)\n")
    return close_report(rows, ok, args.keep, bench.out, f"model kept for reuse in {model} ({gb(nbytes)})")


if __name__ == "__main__":
    raise SystemExit(main())

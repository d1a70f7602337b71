"""Benchmark distmerge on real torch.distributed.checkpoint (DCP) checkpoints, side by side with the peers.

    python tests/bench/bench_dcp.py [--size 0.8GB] [--world 8] [--repeats 3] [--work DIR] [--keep]

Makes (once, then reuses) two saves of the same FSDP2-sharded Llama-shaped fp32 model with make_ckpt.py: a
plain DCP folder (`dcp.save`: .metadata + __R_0.distcp) and the HuggingFaceStorageWriter distributed layout
(sharded/shard-0000R-model-00001-of-00001.safetensors). Then times, every repeat and in rotating order:
cp (+sync) of the .distcp files (the floor: distmerge fsyncs its output), launch-only, distmerge N=1 and N=2 on
the DCP folder, distmerge N=2 on the HF-writer folder, and three peers, each also with a sync of its output:
  dcp_to_torch_save       torch's format_utils.dcp_to_torch_save, load, safetensors save (peer_torch_save.py)
  accelerate              merge_fsdp_weights(), what `accelerate merge-weights DCP_DIR OUT` runs (peer_accelerate.py)
  torch consolidate N=2   torch's consolidate_safetensors_files_on_every_rank on the HF-writer shards under
                          torchrun with 2 processes (peer_consolidate.py)
Page cache hot throughout on purpose: the comparison is of the mergers, not of the disk's cold reads.
"""

from __future__ import annotations

import argparse
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
    bench_args,
    close_report,
    ensure_checkpoint,
    gb,
    machine_line,
    parse_size,
    print_checks,
    print_results,
    warm,
)
from compare_outputs import byte_differences, tensor_differences
from make_ckpt import llama_shape

DISTMERGE = ["distmerge N=1", "distmerge N=2", "distmerge N=2 HF-writer"]
PEERS = ["dcp_to_torch_save", "accelerate", "torch consolidate N=2"]
ROWS = ["cp", "cp+sync", "launch N=1", "launch N=2", *DISTMERGE, *(r for p in PEERS for r in (p, f"{p}+sync"))]
HF_TAG = "-hf"  # distmerge's output/log/summary names for its run on the HF-writer layout


class DcpBench(Bench):
    width = max(map(len, DISTMERGE + PEERS))

    def __init__(self, args: argparse.Namespace, work: Path, dcp: Path, hf: Path) -> None:
        super().__init__(args, work, ROWS)
        self.dcp, self.hf = dcp, hf
        self.max_bytes = str(parse_size(args.max_shard_size))

    def torch_save(self) -> None:
        dest, summary = self.fresh("torch-save"), self.work / "summary_torch_save.json"
        cmd = [PY, str(HERE / "peer_torch_save.py"), "--input", str(self.dcp), "--output", str(dest),
               "--max-shard-size", self.max_bytes, "--json-summary", str(summary)]
        self.peer("dcp_to_torch_save", cmd, dest, summary)

    def accelerate(self) -> None:
        dest, summary = self.fresh("accelerate"), self.work / "summary_accelerate.json"
        # The function its `merge-weights` CLI calls, wrapped for an own timer; no size option: one
        # model.safetensors, no index, no config.json.
        cmd = [PY, str(HERE / "peer_accelerate.py"), "--input", str(self.dcp), "--output", str(dest),
               "--json-summary", str(summary)]
        self.peer("accelerate", cmd, dest, summary)

    def consolidate(self) -> None:
        dest, summary = self.fresh("consolidate"), self.work / "summary_consolidate.json"
        cmd = [*TORCHRUN, "--standalone", "--nproc-per-node", "2", str(HERE / "peer_consolidate.py"), "--input",
               str(self.hf / "sharded"), "--output", str(dest), "--max-shard-size", self.max_bytes,
               "--json-summary", str(summary)]
        self.peer("torch consolidate N=2", cmd, dest, summary)

    def measure(self) -> None:
        super().measure([
            lambda: self.cp(distcp_files(self.dcp), "__*.distcp"), lambda: self.launch(1), lambda: self.launch(2),
            lambda: self.distmerge(1, self.dcp), lambda: self.distmerge(2, self.dcp),
            lambda: self.distmerge(2, self.hf, "distmerge N=2 HF-writer", HF_TAG),
            self.torch_save, self.accelerate, self.consolidate,
        ])


def distcp_files(ckpt: Path) -> list[Path]:
    return sorted(ckpt.glob("*.distcp"))


def hf_files(ckpt: Path) -> list[Path]:
    return sorted((ckpt / "sharded").glob("shard-*.safetensors"))


def best(values: dict[str, float]) -> tuple[str, float]:
    name = min(values, key=values.__getitem__)
    return name, values[name]


def table(bench: DcpBench, ckpt_bytes: int) -> tuple[list[list[str]], str]:
    """The rows, and a line naming the best peer by each measure (the ratios divide its time by distmerge's)."""
    med = {row: statistics.median(ts) for row, ts in bench.times.items() if ts}
    own = {row: statistics.median(ts) for row, ts in bench.inner.items()}
    floor = med["cp+sync"]
    peer_wall, peer_sync = best({p: med[p] for p in PEERS}), best({p: med[f"{p}+sync"] for p in PEERS})
    peer_own = best({p: own[p] for p in PEERS if p in own})
    rows = [["method", "median s", "runs (s)", "GB/s", "x cp+sync", "best peer/this", "(best peer+sync)/this",
             "minus launch s", "own timer s", "best peer own/this own", "peak RSS per rank"]]
    for row in ROWS:
        merge, ours = not row.startswith("launch"), row in DISTMERGE
        n = row.split("N=")[1][0] if ours else ""
        rows.append([
            row, f"{med[row]:.2f}", " ".join(f"{t:.2f}" for t in bench.times[row]),
            f"{ckpt_bytes / med[row] / 1e9:.3g}" if merge else "",
            f"{med[row] / floor:.2f}" if merge and row != "cp" else "",
            f"{peer_wall[1] / med[row]:.2f}" if ours else "", f"{peer_sync[1] / med[row]:.2f}" if ours else "",
            f"{med[row] - med[f'launch N={n}']:.2f}" if ours else "",
            f"{own[row]:.2f}" if row in own else "",
            f"{peer_own[1] / own[row]:.2f}" if ours else "",
            " / ".join(gb(p) for p in bench.rss.get(row, [])),
        ])
    note = (f"best peer: wall {peer_wall[0]} ({peer_wall[1]:.2f} s), with sync {peer_sync[0]} ({peer_sync[1]:.2f} s), "
            f"own timer {peer_own[0]} ({peer_own[1]:.2f} s)")
    return rows, note


def check(bench: DcpBench) -> bool:
    out, ref = bench.out, bench.out / "torch-save"
    n_files = {name: len(list((out / name).glob("*.safetensors"))) for name in ("n2", "consolidate")}
    return print_checks([
        ("distmerge N=2 (DCP) vs dcp_to_torch_save, tensor by tensor (torch.equal)",
         tensor_differences(out / "n2", ref)),
        ("distmerge N=2 (HF-writer) vs dcp_to_torch_save, tensor by tensor", tensor_differences(out / f"n2{HF_TAG}",
                                                                                               ref)),
        ("distmerge N=1 vs N=2 (DCP), byte for byte (sha256 of every file)", byte_differences(out / "n1", out / "n2")),
        # The peers are checked too: a peer that writes something else would make its time meaningless.
        ("accelerate vs dcp_to_torch_save, tensor by tensor", tensor_differences(out / "accelerate", ref)),
        ("torch consolidate N=2 vs dcp_to_torch_save, tensor by tensor", tensor_differences(out / "consolidate", ref)),
        ("torch consolidate N=2 writes as many files as distmerge",
         [] if n_files["n2"] == n_files["consolidate"] else [f"safetensors files: {n_files}"]),
    ])


def main() -> int:
    args = bench_args(__doc__, "/tmp/distmerge-bench-dcp", "checkpoints")
    work = args.work.resolve()
    (work / "logs").mkdir(parents=True, exist_ok=True)
    # Two checkpoints, seven outputs and dcp_to_torch_save's intermediate .pt.
    if shutil.disk_usage(work).free < 11 * args.size:
        print(f"warning: {work} has {gb(shutil.disk_usage(work).free)} free; a run needs about {gb(11 * args.size)}")
    try:
        dcp, hf = ensure_checkpoint(args, work, "dcp"), ensure_checkpoint(args, work, "hf")
        files, shards = distcp_files(dcp), hf_files(hf)
        ckpt_bytes, hf_bytes = (sum(p.stat().st_size for p in fs) for fs in (files, shards))
        warm([dcp / ".metadata", *files, *shards])
        bench = DcpBench(args, work, dcp, hf)
        print(f"measuring {len(files)} .distcp files, {gb(ckpt_bytes)} (HF-writer: {len(shards)} shards, "
              f"{gb(hf_bytes)}), hot page cache, {args.repeats} repeat(s)")
        bench.measure()
    except Failed as err:
        print(f"\nFAILED: {err}", file=sys.stderr)
        return 2
    shape = llama_shape(args.size)
    rows, note = table(bench, ckpt_bytes)
    print_results(bench, rows, ".distcp bytes", note)
    ok = check(bench)

    cmdline = (f"python tests/bench/bench_dcp.py --size {args.size / 1e9:g}GB --world {args.world} "
               f"--repeats {args.repeats} --max-shard-size {args.max_shard_size}")
    print("\n----- markdown for docs/dev/benchmarks-history.md (and its row of the table in docs/benchmarks.md) -----")
    print(f"### DCP (FSDP2, W={args.world}) → safetensors, Llama-shaped {gb(shape['params'] * 4)} fp32\n")
    print(f"- command: `{cmdline}`")
    print(machine_line())
    print(f"- model: {shape['params']:,} params, {shape['num_hidden_layers']} layers, hidden {shape['hidden_size']}, "
          f"vocab {shape['vocab_size']}; `dcp.save`: {len(files)} .distcp files, {gb(ckpt_bytes)}; "
          f"HuggingFaceStorageWriter(save_distributed=True): {len(shards)} shard files, {gb(hf_bytes)}")
    print(f"- median of {args.repeats} (methods rotated each repeat), hot page cache "
          "(before every timed run the inputs re-read and 3 GiB of memory touched: common.ready); "
          f"distmerge fsyncs its output, "
          "the peers do not, so `cp+sync` is the floor and the `+sync` rows are the like-for-like peers; launch rows "
          "are `import distmerge.engine.run` "
          "as the CLI imports, its process group formed and destroyed (common.LAUNCH_ONLY), "
          "under python (N=1) and torchrun (N=2)"
          "; own timer = each tool's clock after "
          "its imports (accelerate: merge_fsdp_weights, what its merge-weights CLI runs); "
          "`dcp_to_torch_save` = torch's DCP → .pt → load → safetensors route; `torch consolidate N=2` = "
          "torch's consolidate_safetensors_files_on_every_rank on the HF-writer "
          "shards, which splits work by output file, so with one output file one rank does all of it; "
          f"{note}\n")
    return close_report(rows, ok, args.keep, bench.out, f"checkpoints kept for reuse in {dcp} and {hf}")


if __name__ == "__main__":
    raise SystemExit(main())

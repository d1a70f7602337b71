"""Benchmark distmerge on a real torchtitan model-only export, side by side with torchtitan's own route to Hugging Face.

    python tests/bench/bench_torchtitan.py [--size 0.8GB] [--world 8] [--repeats 3] [--work DIR] [--keep]

Makes (once, then reuses) a llama3 save with torchtitan's own CheckpointManager under torchrun with W processes
(gloo, CPU, FSDP2; tests/fixtures/make_torchtitan.py's job, the model at its initial weights): the last-step
model-only export `dump/checkpoint/step-1/` (.metadata + __R_0.distcp, fp32) and `dump/huggingface/config.json`.
Then times, every repeat and in rotating order: cp (+sync) of the .distcp files (the floor: distmerge fsyncs
its output), launch-only, distmerge N=1 and N=2 on the dump, and torchtitan's route (+sync): the calls its
scripts/checkpoint_conversion/convert_to_hf.py makes (that script is not in the wheel), made with the installed
package in one process: build the registered model, dcp.load its state dict, state_dict_adapter.to_hf,
dcp.save through HuggingFaceStorageWriter(save_distributed=True, enable_consolidation=True).
Page cache hot throughout on purpose: the comparison is of the mergers, not of the disk's cold reads.

The same file is the maker (`--make`, under torchrun) and the peer (`--peer`), so the parent never imports torchtitan.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shlex
import shutil
import statistics
import sys
import time
from pathlib import Path

from common import (
    PY,
    ROOT,
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
from make_ckpt import llama_shape

ROWS = ["cp", "cp+sync", "launch N=1", "launch N=2", "distmerge N=1", "distmerge N=2", "torchtitan",
        "torchtitan+sync"]
STEP = "checkpoint/step-1"


def case(args_size: int, world: int):
    """The torchtitan fixture case of a Llama-shaped model of about args_size fp32 bytes (make_ckpt's shape)."""
    sys.path.insert(0, str(ROOT))
    from tests.fixtures.torchtitan_cases import TTCase

    s = llama_shape(args_size)
    return TTCase(world, "llama3", dim=s["hidden_size"], n_layers=s["num_hidden_layers"],
                  n_heads=s["num_attention_heads"], n_kv_heads=s["num_key_value_heads"],
                  hidden_dim=s["intermediate_size"], vocab_size=s["vocab_size"])


def make(out: Path, size: int) -> None:
    """Under torchrun: torchtitan's job builds the sharded model and its CheckpointManager saves step 1 as the
    last step, model only (no train step: a real step's time on 2 cores buys nothing the layout shows)."""
    import torch.distributed as dist

    from tests.fixtures import make_torchtitan as mt
    from tests.fixtures import torchtitan_cases as tc

    tc.prepare_torchtitan()
    dist.init_process_group("gloo")
    try:
        spec = case(size, dist.get_world_size())
        job = mt.build_job("bench", spec, out)
        start = time.perf_counter()
        job.checkpointer.save(1, last_step=True)
        job.checkpointer.close()
        dist.barrier()
        if dist.get_rank() == 0:
            (out / "huggingface").mkdir(parents=True, exist_ok=True)
            tc.hf_config(spec, job.config.model_spec.model).to_json_file(str(out / "huggingface" / "config.json"))
            params = sum(p.numel() for p in job.model.parameters())
            print(f"bench_torchtitan: made {out / STEP}: {params:,} params in {time.perf_counter() - start:.1f} s")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def peer(step: Path, out: Path, size: int, summary: Path) -> None:
    """torchtitan's route to Hugging Face, in one process (see the module docstring)."""
    import resource

    from tests.fixtures import torchtitan_cases as tc

    tc.prepare_torchtitan()
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader, HuggingFaceStorageWriter
    from torchtitan.components.checkpointer.base import ModelWrapper
    from torchtitan.models import llama3

    start = time.perf_counter()  # own timer: after the imports, like convert_to_hf.py's work
    llama3.llama3_configs["bench"] = tc._llama3_flavor(case(size, 1))  # a size is a registry flavor
    spec = llama3.model_registry("bench")
    with torch.device("cpu"), torch.inference_mode():
        model = spec.model.build()
        state = ModelWrapper(model)._get_state_dict()
        dcp.load(state, storage_reader=FileSystemReader(str(step)))
        adapter = spec.state_dict_adapter(spec.model, None)
        hf = adapter.to_hf(state)
        writer = HuggingFaceStorageWriter(path=str(out), save_distributed=True, enable_consolidation=True,
                                          fqn_to_index_mapping=adapter.fqn_to_index_mapping)
        dcp.save(hf, storage_writer=writer)
    summary.write_text(json.dumps({"seconds": time.perf_counter() - start,
                                   "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))


def ensure_dump(args: argparse.Namespace, work: Path) -> Path:
    """Reuse the dump in work/ when its stamp matches these parameters, else make it (the slow part)."""
    from importlib.metadata import version

    dump, tmp, stamp_path = work / "dump", work / "dump.partial", work / "dump.stamp.json"
    makers = [Path(__file__), ROOT / "tests/fixtures/make_torchtitan.py", ROOT / "tests/fixtures/torchtitan_cases.py"]
    stamp = {"size": args.size, "world": args.world, "shape": llama_shape(args.size),
             "torchtitan": version("torchtitan"), "torch": version("torch"),
             "makers_sha256": [hashlib.sha256(p.read_bytes()).hexdigest() for p in makers]}
    if stamp_path.exists() and json.loads(stamp_path.read_text()) == stamp:
        print(f"reusing dump {dump} (stamp matches)")
        return dump
    for old in (dump, tmp):
        shutil.rmtree(old, ignore_errors=True)
    stamp_path.unlink(missing_ok=True)
    cmd = [*TORCHRUN, "--standalone", "--nproc-per-node", str(args.world), str(Path(__file__)), "--make", str(tmp),
           "--size", str(args.size)]
    print(f"making the torchtitan save: {shlex.join(cmd)}", flush=True)
    log = work / "logs" / "make_torchtitan.log"
    seconds, _ = run(cmd, log)
    print(next(line for line in log.read_text().splitlines() if "bench_torchtitan:" in line))
    tmp.rename(dump)  # only a finished dump ever gets the name (and the stamp) that allow reuse
    stamp_path.write_text(json.dumps(stamp, indent=2) + "\n")
    print(f"dump made in {seconds:.1f} s")
    return dump


class TorchtitanBench(Bench):
    def __init__(self, args: argparse.Namespace, work: Path, dump: Path) -> None:
        super().__init__(args, work, ROWS)
        self.dump = dump

    def torchtitan(self) -> None:
        dest, summary = self.fresh("torchtitan"), self.work / "summary_torchtitan.json"
        cmd = [PY, str(Path(__file__)), "--peer", str(self.dump / STEP), "--output", str(dest), "--size",
               str(self.args.size), "--json-summary", str(summary)]
        self.peer("torchtitan", cmd, dest, summary)

    def measure(self) -> None:
        super().measure([lambda: self.cp(distcp_files(self.dump), "__*.distcp"), lambda: self.launch(1),
                         lambda: self.launch(2), lambda: self.distmerge(1, self.dump),
                         lambda: self.distmerge(2, self.dump), self.torchtitan])


def distcp_files(dump: Path) -> list[Path]:
    return sorted((dump / STEP).glob("*.distcp"))


def table(bench: TorchtitanBench, ckpt_bytes: int) -> list[list[str]]:
    med = {row: statistics.median(ts) for row, ts in bench.times.items()}
    own = {row: statistics.median(ts) for row, ts in bench.inner.items()}
    floor, peer_s, peer_sync = med["cp+sync"], med["torchtitan"], med["torchtitan+sync"]
    rows = [["method", "median s", "runs (s)", "GB/s", "x cp+sync", "torchtitan/this", "(torchtitan+sync)/this",
             "minus launch s", "own timer s", "own ratio", "peak RSS per rank"]]
    for row in ROWS:
        merge, n = not row.startswith("launch"), row[-1] if row.startswith("distmerge") else ""
        rows.append([
            row, f"{med[row]:.2f}", " ".join(f"{t:.2f}" for t in bench.times[row]),
            f"{ckpt_bytes / med[row] / 1e9:.3g}" if merge else "",
            f"{med[row] / floor:.2f}" if merge and row != "cp" else "",
            f"{peer_s / med[row]:.2f}" if n else "", f"{peer_sync / med[row]:.2f}" if n else "",
            f"{med[row] - med[f'launch N={n}']:.2f}" if n else "",
            f"{own[row]:.2f}" if row in own else "", f"{own['torchtitan'] / own[row]:.2f}" if n else "",
            " / ".join(gb(p) for p in bench.rss.get(row, [])),
        ])
    return rows


def check(bench: TorchtitanBench) -> bool:
    out = bench.out
    return print_checks([
        ("distmerge N=2 vs torchtitan's route, tensor by tensor (torch.equal)",
         tensor_differences(out / "n2", out / "torchtitan")),
        ("distmerge N=1 vs N=2, byte for byte (sha256 of every file)", byte_differences(out / "n1", out / "n2")),
    ])


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=parse_size, default=parse_size("0.8GB"), help="model bytes, fp32 (0.8GB)")
    parser.add_argument("--world", type=int, default=8, help="training world size W of the save (8)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per method; the median is reported (3)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/distmerge-bench-torchtitan"), help="dump + outputs")
    parser.add_argument("--keep", action="store_true", help="keep the merged outputs (the dump always kept)")
    parser.add_argument("--max-shard-size", default="5GB", help="passed to distmerge (5GB)")
    parser.add_argument("--make", type=Path, metavar="DIR", help=argparse.SUPPRESS)  # the maker, under torchrun
    parser.add_argument("--peer", type=Path, metavar="STEP", help=argparse.SUPPRESS)  # torchtitan's route
    parser.add_argument("--output", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--json-summary", type=Path, help=argparse.SUPPRESS)
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    if args.make:
        make(args.make, args.size)
        return 0
    if args.peer:
        peer(args.peer, args.output, args.size, args.json_summary)
        return 0
    work = args.work.resolve()
    (work / "logs").mkdir(parents=True, exist_ok=True)
    try:
        dump = ensure_dump(args, work)
        files = distcp_files(dump)
        ckpt_bytes = sum(p.stat().st_size for p in files)
        warm([dump / STEP / ".metadata", *files])
        bench = TorchtitanBench(args, work, dump)
        print(f"measuring {len(files)} .distcp files, {gb(ckpt_bytes)}, hot page cache, {args.repeats} repeat(s)")
        bench.measure()
    except Failed as err:
        print(f"\nFAILED: {err}", file=sys.stderr)
        return 2
    shape = llama_shape(args.size)
    rows = table(bench, ckpt_bytes)
    print_results(bench, rows, ".distcp bytes")
    ok = check(bench)
    cmdline = (f"python tests/bench/bench_torchtitan.py --size {args.size / 1e9:g}GB --world {args.world} "
               f"--repeats {args.repeats} --max-shard-size {args.max_shard_size}")
    print("\n----- markdown for docs/dev/benchmarks-history.md (and its row of the table in docs/benchmarks.md) -----")
    print(f"### torchtitan (llama3, FSDP2 W={args.world}, model-only export) → safetensors, {gb(shape['params'] * 4)} "
          "fp32\n")
    print(f"- command: `{cmdline}`")
    print(machine_line())
    print(f"- model: {shape['params']:,} params, {shape['num_hidden_layers']} layers, hidden {shape['hidden_size']}, "
          f"vocab {shape['vocab_size']}, saved by torchtitan's CheckpointManager: {len(files)} .distcp files, "
          f"{gb(ckpt_bytes)}")
    print(f"- median of {args.repeats} (methods rotated each repeat), hot page cache "
          "(before every timed run the inputs re-read and 3 GiB of memory touched: common.ready); "
          f"distmerge fsyncs its output, "
          "torchtitan's route does not, so `cp+sync` is the floor and `torchtitan+sync` the like-for-like peer; "
          "launch rows are `import distmerge.engine.run` "
          "as the CLI imports, its process group formed and destroyed (common.LAUNCH_ONLY), "
          "under python (N=1) and torchrun (N=2); own timer = each tool's "
          "clock after its imports (torchtitan: importing it takes most of its wall time on 2 cores); "
          "own ratio = torchtitan own / this own\n")
    return close_report(rows, ok, args.keep, bench.out, f"dump kept for reuse in {dump} ({gb(ckpt_bytes)})")


if __name__ == "__main__":
    raise SystemExit(main())

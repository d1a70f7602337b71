"""DCP saves of 256 and 1024 ranks (issue #27): `.metadata` reading and whole merges, beside torch's own route.

    python tests/bench/bench_dcp_scale.py [--world 256 1024] [--procs 1 2 4] [--repeats 1] [--work DIR]
                                          [--names hf|torchtitan] [--model 405b|small] [--no-peer] [--keep]
                                          [--format dcp|megatron-dist] [--layers 128]

The saves are written once (then reused while their stamp matches) by make_dcp_scale.py: torch's own
DefaultSavePlanner and FileSystemWriter, W simulated ranks in one process, Llama-3.1-405B's 1,137 tensors with
their real rows and 4 columns (bf16), FSDP2's uneven Shard(0); at W=1024 1,164,278 chunks and a 191 MB
`.metadata`. For each W, every repeat, in rotating order:

  .metadata: torch            pickle.load of the file with torch's classes (what torch's FileSystemReader does;
                              unsafe on untrusted input), in a fresh process: its seconds and peak RSS
  .metadata: distmerge        distmerge's read_metadata (the chunk table, checked), the same way
  distmerge N=1, 2, 4         `python -m distmerge merge` / torchrun: wall time, distmerge's own timer, each
                              rank's phases (discover = rank 0 reads .metadata; open; plan; rounds) and peak RSS
  dcp_to_torch_save           torch's documented route: format_utils.dcp_to_torch_save, torch.load, safetensors
                              save (peer_torch_save.py), one process

Checks: every distmerge output byte-identical across N, and tensor for tensor equal (torch.equal) to the peer
route's (for `--names hf`: with torchtitan's names the family renames and un-permutes, tested in
tests/test_merge_torchtitan.py; `--names torchtitan --model small` shows the torchtitan format at W ranks).

`--format megatron-dist`: megatron-core torch_dist saves instead, made by make_megatron_dist_scale.py with
megatron-core's own save code (GPTModel.sharded_state_dict, the fully-parallel split over DP, MCoreSavePlanner,
FileSystemWriterAsync; TP=8, PP=16, DP = W / 128, a Llama of `--layers` layers); the .metadata rows and the peer
read iter_0000001/, distmerge merges the Megatron folder. Checks: byte-identical across N, every tensor equal to
the reference the maker wrote (the peer's output keeps Megatron's stacked names: it is timed, not compared).
The machine is shared: run under `flock /tmp/distmerge-bench.lock` and read `uptime` beside the table.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shlex
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

from common import HERE, PY, Bench, Failed, close_report, gb, machine_line, print_checks, run
from compare_outputs import byte_differences, tensor_differences

READERS = {  # what each .metadata row runs, in a fresh interpreter: prints {"seconds": ...}
    "torch": ("import pickle, sys, time, json\nimport torch.distributed.checkpoint.filesystem\n"
              "t = time.perf_counter()\nwith open(sys.argv[1], 'rb') as f:\n    md = pickle.load(f)\n"
              "n = sum(len(getattr(m, 'chunks', ())) for m in md.state_dict_metadata.values())\n"
              "print(json.dumps({'seconds': time.perf_counter() - t, 'chunks': n}))\n"),
    "distmerge": ("import sys, time, json\nfrom pathlib import Path\n"
                  "from distmerge.formats.torch_private.dcp import read_metadata\n"
                  "from distmerge.input import source\n"
                  "t = time.perf_counter()\nmd = read_metadata(source.of(sys.argv[1]), Path(sys.argv[1]))\n"
                  "print(json.dumps({'seconds': time.perf_counter() - t, 'chunks': len(md)}))\n"),
}


def maker(args: argparse.Namespace, world: int) -> tuple[str, Path, list[str]]:
    """(the save's tag, its maker, the maker's options but --out)."""
    if args.format == "megatron-dist":
        tag = f"megatron_w{world}_l{args.layers}"
        return tag, HERE / "make_megatron_dist_scale.py", [
            "--world", str(world), "--layers", str(args.layers),
            "--reference", str(args.work / f"{tag}_reference" / "model.safetensors")]
    tag = f"dcp_w{world}_{args.names}" + ("" if args.model == "405b" else f"_{args.model}")
    return tag, HERE / "make_dcp_scale.py", ["--world", str(world), "--names", args.names, "--model", args.model]


def ensure_save(args: argparse.Namespace, world: int) -> Path:
    work = args.work
    tag, maker_py, options = maker(args, world)
    save, stamp_path = work / tag, work / f"{tag}.stamp.json"
    # the DCP saves' stamps as before this option (their saves, which take long to make, are reused)
    stamp = {"options": options} if args.format == "megatron-dist" else {
        "world": world, "names": args.names, "model": args.model}
    stamp["maker_sha256"] = hashlib.sha256(maker_py.read_bytes()).hexdigest()
    if stamp_path.exists() and json.loads(stamp_path.read_text()) == stamp:
        print(f"reusing {save} (stamp matches)")
        return save
    if save.is_symlink():
        raise SystemExit(f"{save} links to a save made otherwise (its stamp differs): remove the link or the stamp")
    shutil.rmtree(save, ignore_errors=True)
    cmd = [PY, str(maker_py), "--out", str(save.with_suffix(".partial")), *options]
    print(f"making the save: {shlex.join(cmd)}", flush=True)
    run(cmd, work / "logs" / f"make_w{world}.log")
    save.with_suffix(".partial").rename(save)
    stamp_path.write_text(json.dumps(stamp) + "\n")
    return save


class ScaleBench(Bench):
    width = 22

    def __init__(self, args: argparse.Namespace, work: Path, world: int, save: Path) -> None:
        rows = [*(f".metadata: {r}" for r in READERS), *(f"distmerge N={n}" for n in args.procs)]
        rows += ["dcp_to_torch_save", "dcp_to_torch_save+sync"] if args.peer else []
        super().__init__(args, work, rows)
        self.world, self.save, self.phases = world, save, {}
        self.dcp = save / "iter_0000001" if args.format == "megatron-dist" else save  # the DCP folder itself
        self.meta: dict[str, list[tuple[float, int]]] = {}

    def actions(self) -> list:
        out = [lambda r=r: self.metadata(r) for r in READERS] + [lambda n=n: self.merge(n) for n in self.args.procs]
        return out + ([self.torch_route] if self.args.peer else [])

    def metadata(self, reader: str) -> None:
        row, log = f".metadata: {reader}", self.work / "logs" / f"metadata_{reader}.log"
        cmd = [PY, "-c", READERS[reader], str(self.dcp / ".metadata")]
        self.commands.setdefault(row, f"python -c <{reader} reader> {self.dcp}/.metadata")
        wall, rss = run(cmd, log)
        data = json.loads(log.read_text().splitlines()[-1])
        self.meta.setdefault(row, []).append((data["seconds"], rss))
        self.times[row].append(data["seconds"])
        print(f"    {row:<{self.width}} {data['seconds']:8.2f} s  (peak RSS {gb(rss)}, {data['chunks']:,} chunks, "
              f"process {wall:.1f} s)", flush=True)

    def merge(self, n: int) -> None:
        self.distmerge(n, self.save, tag=f"_w{self.world}")
        summary = json.loads((self.work / f"summary_n{n}_w{self.world}.json").read_text())
        self.phases.setdefault(n, []).append(sorted(summary["ranks"], key=lambda r: r["rank"]))

    def torch_route(self) -> None:
        dest, summary = self.fresh(f"torch_save_w{self.world}"), self.work / "summary_torch_save.json"
        cmd = [PY, str(HERE / "peer_torch_save.py"), "--input", str(self.dcp), "--output", str(dest),
               "--max-shard-size", str(5 * 10**9), "--json-summary", str(summary)]
        self.peer("dcp_to_torch_save", cmd, dest, summary)


def table(bench: ScaleBench) -> list[list[str]]:
    """One row per method: median seconds, phases (median over repeats, the slowest rank), peak RSS per rank."""
    rows = [["W", "method", "wall s", "own s", ".metadata (rank 0)", "open", "plan", "rounds", "peak RSS per rank"]]
    for row in bench.times:
        if row.endswith("+sync") or not bench.times[row]:
            continue
        wall = statistics.median(bench.times[row])
        own = f"{statistics.median(bench.inner[row]):.1f}" if row in bench.inner else ""
        cells = ["", "", "", ""]
        if row.startswith("distmerge N="):
            runs = bench.phases[int(row.split("=")[1])]
            cells = [f"{statistics.median(r[0]['phases'][p] for r in runs):.1f}" if p == "discover" else
                     f"{statistics.median(max(k['phases'][p] for k in r) for r in runs):.1f}"
                     for p in ("discover", "open", "plan", "rounds")]
        peaks = bench.rss.get(row) or [max(r for _, r in bench.meta.get(row, [(0, 0)]))]
        rows.append([str(bench.world), row, f"{wall:.1f}", own, *cells, " / ".join(gb(p) for p in peaks)])
    return rows


def checks(bench: ScaleBench) -> list[tuple[str, list[str]]]:
    outs = [bench.out / f"n{n}_w{bench.world}" for n in bench.args.procs]
    found = [(f"W={bench.world}: N={a} and N={b} byte-identical", byte_differences(outs[0], o))
             for a, b, o in zip(bench.args.procs[:1] * len(outs), bench.args.procs, outs, strict=True) if o != outs[0]]
    if bench.args.format == "megatron-dist":  # the peer keeps Megatron's names and stacked layers
        tag = maker(bench.args, bench.world)[0]
        found.append((f"W={bench.world}: distmerge equals the reference weights",
                      tensor_differences(outs[0], bench.args.work / f"{tag}_reference")))
    elif bench.args.peer and bench.args.names == "hf":  # torchtitan's names and RoPE layout are the family's to map
        found.append((f"W={bench.world}: distmerge equals dcp_to_torch_save + save_file",
                      tensor_differences(outs[0], bench.out / f"torch_save_w{bench.world}")))
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--procs", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--work", type=Path, default=Path("/tmp/distmerge-bench-dcp-scale"))
    parser.add_argument("--names", choices=("hf", "torchtitan"), default="hf")
    parser.add_argument("--model", choices=("405b", "small"), default="405b", help="make_dcp_scale.py --model")
    parser.add_argument("--format", choices=("dcp", "megatron-dist"), default="dcp",
                        help="torch DCP saves (make_dcp_scale.py) or megatron-core torch_dist saves")
    parser.add_argument("--layers", type=int, default=128, help="megatron-dist: the Llama's layers (128)")
    parser.add_argument("--no-peer", dest="peer", action="store_false", help="skip torch's dcp_to_torch_save route")
    parser.add_argument("--keep", action="store_true", help="keep the merged outputs (the saves are always kept)")
    parser.add_argument("--max-shard-size", default="5GB")
    args = parser.parse_args()
    (args.work / "logs").mkdir(parents=True, exist_ok=True)
    print(machine_line())
    print("uptime:", subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip(), flush=True)
    rows, ok = [], True
    for world in args.world:
        save = ensure_save(args, world)
        bench = ScaleBench(args, args.work, world, save)
        print(f"W={world}: {save}", flush=True)
        try:
            bench.measure(bench.actions())
        except Failed as err:
            print(err)
            return 1
        ok = print_checks(checks(bench)) and ok
        got = table(bench)
        rows += got if not rows else got[1:]
        print("uptime:", subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip(), flush=True)
    print("\ncommands:")
    for row, cmd in bench.commands.items():
        print(f"  {row}: {cmd}")
    return close_report(rows, ok, args.keep, args.work / "out", f"saves kept in {args.work}")


if __name__ == "__main__":
    sys.exit(main())

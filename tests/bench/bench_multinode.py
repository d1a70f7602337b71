"""A checkpoint where the nodes left it: BENCH (an FSDP2 save, W=8) split over two simulated nodes (two torchrun
agents, each in a mount namespace of its own that shows its own half at the input's path, as
tests/helpers/two_nodes.py does), merged where it lies, side by side in one run with

    shared      the same two nodes, each seeing the whole folder (a shared file system): the goal is at most 1.2x
    copy+merge  the plain way: node 1's files copied to node 0's disk (cp, sync), then a one-node merge: slower,
                and it needs the copy's disk
    cp+sync     the physical floor: the checkpoint's model files copied and synced once

and prints the ratios, the bytes that crossed nodes (from distmerge's summary) and the peak RSS per rank (its
--json-summary). Needs root (mount namespaces). Usage:

    python tests/bench/bench_multinode.py --size 0.8GB --world 8 --nproc 1 --repeats 3
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import ROOT, bench_args, ensure_checkpoint, gb

PY = sys.executable


def port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_nodes(disks: list[Path], at: Path, args: list[str], nproc: int, log: Path) -> float:
    """One merge over two simulated nodes; the wall seconds until both agents are done."""
    p = port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    start = time.perf_counter()
    procs, logs = [], [open(log.with_suffix(f".node{k}.log"), "w") for k in (0, 1)]  # noqa: SIM115 (closed below)
    for k in (0, 1):
        cmd = [PY, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(k), "--nproc-per-node",
               str(nproc), "--rdzv-backend", "static", "--master-addr", "127.0.0.1", "--master-port", str(p),
               "-m", "distmerge", *map(str, args)]
        script = f"mount --bind {shlex.quote(str(disks[k]))} {shlex.quote(str(at))} && exec {shlex.join(cmd)}"
        procs.append(subprocess.Popen(["unshare", "-m", "--propagation", "private", "sh", "-c", script], cwd=ROOT,
                                      env=env, stdout=logs[k], stderr=subprocess.STDOUT))
    codes = [p.wait() for p in procs]
    for f in logs:
        f.close()
    seconds = time.perf_counter() - start
    if any(codes):
        raise SystemExit(f"exit {codes}: see {log.with_suffix('.node0.log')}")
    return seconds


def model_files(ckpt: Path) -> list[Path]:
    return sorted(ckpt.glob("model_world_size_*_rank_*.pt"))


RANK = re.compile(r"rank_(\d+)\.pt$|^__(\d+)_\d+\.distcp$")  # a rank file's training rank (FSDP, DCP)


def options(parser) -> None:
    parser.add_argument("--nproc", type=int, default=1, help="processes per node")
    parser.add_argument("--scale-input", type=Path, help="instead: this checkpoint folder (a rank file's rank in its "
                        "name: FSDP, DCP), split by rank over the nodes by hard links, merged split and shared, "
                        "for the time and peak RSS per rank (--world: its training world size)")
    parser.add_argument("--rest-on", type=int, default=0, choices=(0, 1), help="with --scale-input: the node that "
                        "holds the files of no rank (.metadata, huggingface/): 1 makes rank 0 read them from node 1")


def scale(args, work: Path) -> int:
    """Split and shared merges of a large existing save (e.g. make_dcp_scale.py's 1024-rank DCP save): peak RSS."""
    lab = work / "multinode-scale"
    shutil.rmtree(lab, ignore_errors=True)
    disks, at, whole = [lab / "node0", lab / "node1"], lab / "ckpt", args.scale_input
    at.mkdir(parents=True)
    for path in sorted(p for p in whole.rglob("*") if p.is_file()):
        m = RANK.search(path.name)
        node = args.rest_on if m is None else int(int(m.group(1) or m.group(2)) >= args.world // 2)
        dest = disks[node] / path.relative_to(whole)
        dest.parent.mkdir(parents=True, exist_ok=True)
        os.link(path, dest)
    for row, views in (("split", disks), ("shared", [whole, whole])):
        for _ in range(args.repeats):
            js = lab / f"{row}.json"
            out = lab / f"out-{row}"
            shutil.rmtree(out, ignore_errors=True)
            seconds = two_nodes(views, at, ["merge", "--input", at, "--output", out, "--quiet", "--json-summary", js],
                                args.nproc, work / "logs" / f"multinode-scale-{row}")
            summary = json.loads(js.read_text())
            print(f"  {row:<7} {seconds:7.2f} s (own {summary['seconds']:.2f} s), peak RSS per rank: "
                  + ", ".join(gb(r["peak_rss"]) for r in summary["ranks"]))
    return 0


def main() -> int:
    args = bench_args(__doc__, "/tmp/distmerge-bench", "an FSDP2 checkpoint split over two nodes", options)
    work = Path(args.work)
    if args.scale_input:
        (work / "logs").mkdir(parents=True, exist_ok=True)
        return scale(args, work)
    (work / "logs").mkdir(parents=True, exist_ok=True)
    ckpt = ensure_checkpoint(args, work)
    lab = work / "multinode"
    shutil.rmtree(lab, ignore_errors=True)
    disks, at = [lab / "node0", lab / "node1"], lab / "ckpt"
    for d in (*disks, at):
        d.mkdir(parents=True)
    half = args.world // 2
    for f in sorted(p for p in ckpt.iterdir() if p.is_file()):
        m = re.search(r"rank_(\d+)\.pt$", f.name)
        node = 0 if m is None or int(m.group(1)) < half else 1
        if m is None or f.name.startswith("model_"):
            shutil.copy2(f, disks[node] / f.name)
    shutil.copytree(ckpt / "huggingface", disks[0] / "huggingface")
    whole = lab / "whole"  # the shared folder: every file, seen by both nodes
    shutil.copytree(disks[0], whole)
    for f in disks[1].iterdir():
        shutil.copy2(f, whole / f.name)
    nbytes = sum(f.stat().st_size for f in model_files(whole))
    times: dict[str, list[float]] = {"split": [], "shared": [], "copy+merge": [], "cp+sync": []}
    own: dict[str, list[float]] = {"split": [], "shared": [], "copy+merge": []}  # the merge's clock, after start-up
    summaries: dict[str, dict] = {}
    for r in range(args.repeats):
        for row in (list(times) * 2)[r % len(times):][:len(times)]:  # rotating order
            out = lab / f"out-{row}"
            shutil.rmtree(out, ignore_errors=True)
            subprocess.run(["sync"], check=True)
            js = lab / f"{row}.json"
            merge = ["merge", "--input", at, "--output", out, "--max-shard-size", args.max_shard_size, "--quiet",
                     "--json-summary", js]
            if row == "split":
                times[row].append(two_nodes(disks, at, merge, args.nproc, work / "logs" / "multinode-split"))
            elif row == "shared":
                times[row].append(two_nodes([whole, whole], at, merge, args.nproc, work / "logs" / "multinode-shared"))
            elif row == "copy+merge":
                plain = lab / "plain"
                shutil.rmtree(plain, ignore_errors=True)
                start = time.perf_counter()
                shutil.copytree(disks[0], plain)
                subprocess.run(["cp", "-r", *map(str, disks[1].iterdir()), str(plain)], check=True)
                subprocess.run(["sync"], check=True)
                cmd = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(2 * args.nproc),
                       "-m", "distmerge", "merge", "--input", str(plain), "--output", str(out), "--max-shard-size",
                       args.max_shard_size, "--quiet", "--json-summary", str(js)]
                subprocess.run(cmd, check=True, cwd=ROOT, capture_output=True,
                               env={**os.environ, "OMP_NUM_THREADS": "1"})
                times[row].append(time.perf_counter() - start)
            else:
                dest = lab / "cp"
                shutil.rmtree(dest, ignore_errors=True)
                dest.mkdir()
                start = time.perf_counter()
                subprocess.run(["cp", *map(str, model_files(whole)), str(dest)], check=True)
                subprocess.run(["sync"], check=True)
                times[row].append(time.perf_counter() - start)
            if js.exists():
                summaries[row] = json.loads(js.read_text())
                own[row].append(summaries[row]["seconds"])
                js.unlink()
    same = all((lab / "out-split" / n).read_bytes() == (lab / f"out-{o}" / n).read_bytes()
               for o in ("shared", "copy+merge") for n in ("model.safetensors.index.json",)
               ) and all(f.read_bytes() == (lab / "out-shared" / f.name).read_bytes()
                         for f in sorted((lab / "out-split").glob("model*.safetensors")))
    med = {row: statistics.median(t) for row, t in times.items()}
    split = summaries["split"]
    crossed = sum(r.get("bytes_from_other_nodes", 0) for r in split["ranks"])
    print(f"bench_multinode: BENCH {gb(nbytes)} of model files, W={args.world}, 2 nodes x {args.nproc} process(es), "
          f"{args.repeats} repeat(s), medians")
    for row in times:
        print(f"  {row:<11} {med[row]:7.2f} s   (runs: {', '.join(f'{t:.2f}' for t in times[row])})")
    mown = {row: statistics.median(t) for row, t in own.items()}
    print("  own (distmerge's clock, after its start-up): " + ", ".join(f"{r} {t:.2f} s" for r, t in mown.items()))
    print(f"  own split / shared: {mown['split'] / mown['shared']:.2f}x; the copy alone in copy+merge: "
          f"{med['copy+merge'] - mown['copy+merge']:.2f} s with the merge's start-up")
    print(f"  split / shared: {med['split'] / med['shared']:.2f}x (goal <= 1.2x); copy+merge / split: "
          f"{med['copy+merge'] / med['split']:.2f}x (goal > 1); split / cp+sync: {med['split'] / med['cp+sync']:.2f}x")
    print(f"  crossed nodes: {gb(crossed)} of {gb(nbytes)}; the plain way's extra disk: "
          f"{gb(sum(f.stat().st_size for f in disks[1].iterdir()))} (node 1's files copied), split: 0")
    for row in ("split", "shared", "copy+merge"):
        peaks = ", ".join(gb(r["peak_rss"]) for r in summaries[row]["ranks"])
        print(f"  peak RSS per rank, {row}: {peaks}")
    print(f"  outputs byte-identical: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())

"""Benchmark merging in an object store: s3 -> s3 directly, against the local merge and against the three-step
route a user takes without it (download with the client library, merge on disk, upload), on one S3 server.

    python tests/bench/bench_s3.py [--size 0.8GB] [--world 8] [--repeats 3] [--work DIR] [--keep]

The server is moto's (tests/s3_server.py) on 127.0.0.1, started here; the checkpoint is bench_fsdp.py's (made once
by make_ckpt.py, reused while its stamp matches), uploaded once before the timings. Every row runs N=2 processes,
in rotating order each repeat:

    local      distmerge disk -> disk (its own output fsynced)
    s3->s3     distmerge --input s3://ckpt/run --output s3://models/direct: ranged GETs of the bytes each rank owns,
               one multipart upload per output file
    3-step     boto3's transfer manager downloads the checkpoint (download_file per object, its default threads),
               distmerge merges disk -> disk, boto3 uploads the output (upload_file per file): each step timed

Bytes moved: s3->s3 reads each input byte once (the ranks' `read` column adds up to the model) and sends each
output byte once; the 3-step route moves the model through the local disk twice more. Requests: every request the
server answered during a row, from its log (GETs of the checkpoint's objects; PUTs and POSTs: parts, uploads
started and completed, small files), printed per run and in the table.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import sys
import time
from pathlib import Path

from common import TORCHRUN, Bench, bench_args, ensure_checkpoint, gb, machine_line, run

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.s3_server import client, download_tree, s3_server, upload_tree  # noqa: E402

ROWS = ["local N=2", "s3->s3 N=2", "3-step N=2", "  download", "  merge", "  upload"]


REQUEST = re.compile(r'"\S*(GET|PUT|POST|HEAD|DELETE) /(\w[\w.-]*)')  # moto's (werkzeug's) log line of a request


class Requests:
    """Requests the server answered since the last `take`, by method and bucket, read from its log."""

    def __init__(self, log: Path) -> None:
        self.log, self.at = log, 0

    def take(self) -> dict[str, int]:
        time.sleep(0.5)  # the server logs a request after answering it
        with open(self.log, "rb") as f:
            f.seek(self.at)
            text = f.read().decode(errors="replace")
            self.at = f.tell()
        counts: dict[str, int] = {}
        for method, bucket in REQUEST.findall(text):
            key = f"{method} {bucket}"
            counts[key] = counts.get(key, 0) + 1
        return counts


def shown(counts: dict[str, int]) -> str:
    return ", ".join(f"{n} {k}" for k, n in sorted(counts.items()) if not k.startswith(("HEAD", "DELETE")))


class S3Bench(Bench):
    width = 12

    def __init__(self, args, work: Path, ckpt: Path, env: dict[str, str], requests: Requests) -> None:
        super().__init__(args, work, ROWS)
        self.ckpt, self.env, self.requests = ckpt, env, requests
        self.s3 = client(env)
        self.moved: dict[str, int] = {}
        self.asked: dict[str, dict[str, int]] = {}  # row -> requests of its last run
        self.out = work / "out-s3"  # beside the other benchmarks' outputs, removed at the end

    def merge(self, row: str, source: str, target: str) -> tuple[float, dict]:
        summary = self.work / f"summary_{row.split()[0].replace('>', '')}.json"
        cmd = [*TORCHRUN, "--standalone", "--nproc-per-node", "2", "-m", "distmerge", "merge", "--input", source,
               "--output", target, "--overwrite", "--quiet", "--json-summary", str(summary)]
        self.commands.setdefault(row, " ".join(cmd))
        os.environ.update(self.env)
        seconds, _ = run(cmd, self.work / "logs" / f"{summary.stem}.log")
        data = json.loads(summary.read_text())
        self.keep_peak(row, [r["peak_rss"] for r in sorted(data["ranks"], key=lambda r: r["rank"])])
        self.inner.setdefault(row, []).append(data["seconds"])
        return seconds, data

    def local(self) -> None:
        self.requests.take()
        seconds, data = self.merge("local N=2", str(self.ckpt), str(self.fresh("local")))
        self.times["local N=2"].append(seconds)
        print(f"    {'local N=2':<{self.width}} {seconds:8.2f} s", flush=True)

    def direct(self) -> None:
        self.requests.take()
        seconds, data = self.merge("s3->s3 N=2", "s3://ckpt/run", "s3://models/direct")
        self.asked["s3->s3 N=2"] = self.requests.take()
        self.times["s3->s3 N=2"].append(seconds)
        self.moved["s3->s3 read"] = sum(r["bytes_read"] for r in data["ranks"])
        self.moved["s3->s3 written"] = sum(r["bytes_written"] for r in data["ranks"])
        print(f"    {'s3->s3 N=2':<{self.width}} {seconds:8.2f} s  (read {gb(self.moved['s3->s3 read'])}, "
              f"written {gb(self.moved['s3->s3 written'])}; requests: {shown(self.asked['s3->s3 N=2'])})",
              flush=True)

    def three_step(self) -> None:
        local_in, local_out = self.fresh("downloaded"), self.fresh("three_step")
        self.requests.take()
        start = time.perf_counter()
        listed = self.s3.list_objects_v2(Bucket="ckpt", Prefix="run/")["Contents"]
        for obj in listed:
            path = local_in / obj["Key"][len("run/"):]
            path.parent.mkdir(parents=True, exist_ok=True)
            self.s3.download_file("ckpt", obj["Key"], str(path))
        os.sync()
        download = time.perf_counter() - start
        merge, _ = self.merge("3-step N=2", str(local_in), str(local_out))
        start = time.perf_counter()
        for path in sorted(p for p in local_out.rglob("*") if p.is_file()):
            self.s3.upload_file(str(path), "models", f"three-step/{path.relative_to(local_out).as_posix()}")
        upload = time.perf_counter() - start
        self.asked["3-step N=2"] = self.requests.take()
        self.commands.setdefault("  download", "boto3 download_file of every object of s3://ckpt/run/, then sync")
        self.commands.setdefault("  upload", "boto3 upload_file of every output file to s3://models/three-step/")
        for row, seconds in (("  download", download), ("  merge", merge), ("  upload", upload)):
            self.times[row].append(seconds)
        self.times["3-step N=2"].append(download + merge + upload)
        print(f"    {'3-step N=2':<{self.width}} {download + merge + upload:8.2f} s  (download {download:.2f} s, "
              f"merge {merge:.2f} s, upload {upload:.2f} s; requests: {shown(self.asked['3-step N=2'])})", flush=True)


def main() -> int:
    args = bench_args(__doc__, "/tmp/distmerge-bench", "checkpoint")
    work = args.work
    (work / "logs").mkdir(parents=True, exist_ok=True)
    ckpt = ensure_checkpoint(args, work)
    print(machine_line(), flush=True)
    log = work / "logs" / "moto.log"
    with s3_server(log=log) as env:
        s3 = client(env)
        for bucket in ("ckpt", "models"):
            s3.create_bucket(Bucket=bucket)
        upload_tree(s3, ckpt, "ckpt", "run")
        bench = S3Bench(args, work, ckpt, env, Requests(log))
        bench.measure([bench.local, bench.direct, bench.three_step])
        same = download_tree(s3, "models", "direct")
        local = {p.relative_to(bench.out / "local").as_posix(): p.read_bytes()
                 for p in (bench.out / "local").rglob("*") if p.is_file()}
        differ = [n for n in local if not n.startswith(".distmerge") and same.get(n) != local[n]]
    print(f"\ns3->s3 output equals the local merge's, byte for byte: {not differ} {differ[:3]}")
    print("\n| route (N=2) | median s | runs s | peak RSS per rank | requests (last run) |\n|---|---|---|---|---|")
    for row in ROWS:
        runs = bench.times[row]
        peaks = " / ".join(gb(p) for p in bench.rss.get(row, []))
        print(f"| {row.strip()} | {statistics.median(runs):.2f} | {' '.join(f'{t:.2f}' for t in runs)} | {peaks} | "
              f"{shown(bench.asked.get(row, {}))} |")
    print(f"\nbytes: model {gb(sum(p.stat().st_size for p in ckpt.rglob('*') if p.is_file()))} in the checkpoint; "
          + ", ".join(f"{k} {gb(v)}" for k, v in bench.moved.items()))
    for row, cmd in bench.commands.items():
        print(f"  {row.strip()}: {cmd}")
    if not args.keep:
        shutil.rmtree(bench.out, ignore_errors=True)
    return 0 if not differ else 1


if __name__ == "__main__":
    sys.exit(main())

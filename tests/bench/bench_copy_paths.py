"""How fast can bytes go from input files into one output file on this machine, by each way of copying them?

    python tests/bench/bench_copy_paths.py [--src DIR] [--repeats 3]

Copies every file of DIR (default: the fp32 master partitions bench_deepspeed.py extracts, 0.78 GB in 8 files)
into one new file, as a merge does, by 1 process (all of it) and by 2 processes (half each, into disjoint
ranges of the same file), each way:

- `cfr`: copy_file_range, 16 MiB per call (what distmerge did until 2026-12-01);
- `buf1`: preadv into a reused 1 MiB buffer, pwrite of it (what distmerge does: reader.copy_to);
- `buf16x4`: a 16 MiB buffer written in 4 MiB pwrites (large writes, for comparison);

each with and without asking for writeback every 16 MiB (`+wb`: sync_file_range(SYNC_FILE_RANGE_WRITE), what
distmerge/writeback.py does), then fsync. Before every trial the previous output is deleted and synced and the
inputs are re-read. Prints the wall time of each trial (copy and fsync inside it) and the medians.
"""

from __future__ import annotations

import argparse
import ctypes
import multiprocessing as mp
import os
import statistics
import time
from pathlib import Path

WAYS = ["cfr", "cfr+wb", "buf1", "buf1+wb", "buf16x4+wb"]
KICK = 16 << 20


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--src", type=Path, default=Path("/tmp/distmerge-bench-deepspeed/ckpt-z2-masters"))
    parser.add_argument("--out", type=Path, default=Path("/tmp/distmerge-bench-copy/out.bin"))
    parser.add_argument("--repeats", type=int, default=3)
    return parser.parse_args()


def copy(way: str, sources: list[Path], dst: Path, base: int, barrier, results) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.sync_file_range.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    read_size, write_size = (16 << 20, 4 << 20) if way.startswith("buf16") else (1 << 20, 1 << 20)
    buf = memoryview(bytearray(read_size))
    fd = os.open(dst, os.O_WRONLY)
    barrier.wait()
    start, at, kicked = time.perf_counter(), base, base
    for path in sources:
        src, size, done = os.open(path, os.O_RDONLY), path.stat().st_size, 0
        while done < size:
            if way.startswith("cfr"):
                got = os.copy_file_range(src, fd, min(16 << 20, size - done), done, at + done)
            else:
                got = os.preadv(src, [buf[: min(read_size, size - done)]], done)
                for w in range(0, got, write_size):
                    os.pwrite(fd, buf[w : min(got, w + write_size)], at + done + w)
            done += got
            if way.endswith("+wb") and at + done - kicked >= KICK:
                libc.sync_file_range(fd, kicked, at + done - kicked, 2)
                kicked = at + done
        os.close(src)
        at += size
    os.fsync(fd)
    os.close(fd)
    results.put(time.perf_counter() - start)


def trial(way: str, nproc: int, sources: list[Path], out: Path) -> float:
    out.unlink(missing_ok=True)
    os.sync()
    chunk = bytearray(1 << 20)
    for path in sources:
        with open(path, "rb") as f:
            while f.readinto(chunk):
                pass
    sizes = [p.stat().st_size for p in sources]
    with open(out, "wb") as f:
        f.truncate(sum(sizes))
    half = len(sources) // nproc
    parts = [sources] if nproc == 1 else [sources[:half], sources[half:]]
    bases = [0] if nproc == 1 else [0, sum(sizes[:half])]
    barrier, results = mp.Barrier(nproc), mp.Queue()
    procs = [mp.Process(target=copy, args=(way, part, out, base, barrier, results))
             for part, base in zip(parts, bases, strict=True)]
    start = time.perf_counter()
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    return time.perf_counter() - start


def main() -> int:
    args = parse_args()
    sources = sorted(p for p in args.src.iterdir() if p.is_file())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    total = sum(p.stat().st_size for p in sources)
    print(f"{len(sources)} files, {total / 1e9:.2f} GB from {args.src} into one file; {args.repeats} repeats")
    times: dict[tuple[str, int], list[float]] = {}
    for rep in range(args.repeats):
        for nproc in (1, 2):
            for way in (WAYS if rep % 2 == 0 else WAYS[::-1]):
                seconds = trial(way, nproc, sources, args.out)
                times.setdefault((way, nproc), []).append(seconds)
                print(f"  repeat {rep + 1} N={nproc} {way:<11} {seconds:6.3f} s", flush=True)
    args.out.unlink(missing_ok=True)
    print("\n| way | N=1 median s | N=1 runs | N=2 median s | N=2 runs |\n|---|---:|---|---:|---|")
    for way in WAYS:
        one, two = times[(way, 1)], times[(way, 2)]
        print(f"| {way} | {statistics.median(one):.2f} | {' '.join(f'{t:.2f}' for t in one)} | "
              f"{statistics.median(two):.2f} | {' '.join(f'{t:.2f}' for t in two)} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

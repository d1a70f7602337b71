"""What starting writeback early (distmerge/writeback.py) changes: the same merge with it and without, interleaved.

    python tests/bench/bench_writeback.py --input CKPT [--nproc 1,2] [--repeats 5] [--max-shard-size 5GB]

Runs `distmerge merge` on CKPT (any checkpoint distmerge reads, e.g. the save bench_deepspeed.py keeps in
/tmp/distmerge-bench-deepspeed/ckpt-z2) with N processes, alternating "on" (as shipped) and "off" (the same CLI
with writeback._CALL set to None: writeback left to the final fsync), with the inputs re-read and the previous
output deleted and synced before every run. Prints each setting's own timer (the JSON summary's `seconds`: the
merge without start-up) and wall time, their medians, and off/on. Outputs of both settings are compared byte
for byte.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from common import PY, TORCHRUN, Failed, _read, gb, machine_line, run
from compare_outputs import byte_differences

# The CLI as shipped, or with the writeback request disabled before anything is written.
SWITCH = "import sys, distmerge.writeback as w\nif sys.argv.pop(1) == 'off': w._CALL = None\n" \
         "from distmerge.cli import main\nraise SystemExit(main())"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input", type=Path, required=True, help="checkpoint to merge (kept as it is)")
    parser.add_argument("--nproc", default="1,2", help="process counts, comma-separated (1,2)")
    parser.add_argument("--repeats", type=int, default=5, help="runs per setting and N (5)")
    parser.add_argument("--max-shard-size", default="5GB", help="passed to distmerge (5GB)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/distmerge-bench-writeback"), help="outputs, logs")
    return parser.parse_args()


def merge(args: argparse.Namespace, n: int, setting: str, out: Path) -> tuple[float, float]:
    """(wall s, own timer s) of one run."""
    run(["rm", "-rf", str(out)], args.work / "logs" / "rm.log")
    run(["sync"], args.work / "logs" / "sync.log")  # the deletion's discards settle outside the timing
    _read([p for p in args.input.rglob("*") if p.is_file()])
    summary = args.work / f"summary_{setting}_n{n}.json"
    prefix = [*TORCHRUN, "--standalone", "--nproc-per-node", str(n), "--no-python", PY] if n > 1 else [PY]
    cmd = [*prefix, "-c", SWITCH, setting, "merge", "--input", str(args.input), "--output", str(out), "--quiet",
           "--overwrite", "--max-shard-size", args.max_shard_size, "--json-summary", str(summary)]
    wall, _ = run(cmd, args.work / "logs" / f"{setting}_n{n}.log")
    return wall, json.loads(summary.read_text())["seconds"]


def main() -> int:
    args = parse_args()
    args.input = args.input.resolve()
    (args.work / "logs").mkdir(parents=True, exist_ok=True)
    counts = [int(n) for n in args.nproc.split(",")]
    own: dict[tuple[int, str], list[float]] = {}
    wall: dict[tuple[int, str], list[float]] = {}
    size = sum(p.stat().st_size for p in args.input.rglob("*") if p.is_file())
    print(f"input {args.input} ({gb(size)}), N in {counts}, {args.repeats} repeats, settings alternating")
    try:
        for rep in range(args.repeats):
            for n in counts:
                for setting in (("on", "off") if rep % 2 == 0 else ("off", "on")):
                    w, s = merge(args, n, setting, args.work / f"out_{setting}_n{n}")
                    wall.setdefault((n, setting), []).append(w)
                    own.setdefault((n, setting), []).append(s)
                    print(f"  repeat {rep + 1} N={n} {setting:<3} own {s:6.2f} s  wall {w:6.2f} s", flush=True)
    except Failed as err:
        print(f"FAILED: {err}", file=sys.stderr)
        return 2
    print(f"\n{machine_line()}")
    print("\n| N | writeback | own timer median s | own runs (s) | wall median s | off/on (own) |")
    print("|---:|---|---:|---|---:|---:|")
    for n in counts:
        for setting in ("on", "off"):
            o, w = own[(n, setting)], wall[(n, setting)]
            ratio = statistics.median(own[(n, "off")]) / statistics.median(own[(n, "on")])
            print(f"| {n} | {setting} | {statistics.median(o):.2f} | {' '.join(f'{x:.2f}' for x in o)} | "
                  f"{statistics.median(w):.2f} | {f'{ratio:.2f}' if setting == 'on' else ''} |")
    problems = [p for n in counts for p in byte_differences(args.work / f"out_on_n{n}", args.work / f"out_off_n{n}")]
    print(f"\ncheck on vs off, byte for byte: {'OK' if not problems else problems[:3]}")
    return 0 if not problems else 1


if __name__ == "__main__":
    raise SystemExit(main())

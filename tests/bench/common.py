"""What bench_fsdp.py and bench_dcp.py share: running and timing commands, the checkpoint stamp, the rows
every benchmark has (cp+sync, launch-only, distmerge, a peer merger + sync), table printing, machine facts.

Only stdlib and the stdlib-only parts of this folder are imported at module level, and distmerge never is:
the benchmarks ask it for its version in a subprocess so they run even where it is not installed.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from make_ckpt import llama_shape

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
PY = sys.executable
_TR = Path(PY).with_name("torchrun")
# The launch-only row: everything a merge command does except the merge (distmerge/front/cli.py's order): the imports
# and the parser under the CLI's start-up (GC off, then frozen), then the process group formed and destroyed, the
# torchrun rendezvous and the teardown that every run pays whatever it merges. `minus launch` is then the work.
LAUNCH_ONLY = ("from distmerge.front.cli import _start_up, build_parser\n"
               "with _start_up(program=True):\n"
               "    build_parser()\n"
               "    import distmerge.engine.run\n"
               "from distmerge.distributed.comm import process_group\n"
               "with process_group(device='cpu', timeout_s=600):\n"
               "    pass")
TORCHRUN = [str(_TR)] if _TR.exists() else [PY, "-m", "torch.distributed.run"]  # the same launcher either way
UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


class Failed(Exception):
    pass


def parse_size(text: str) -> int:
    # distmerge.options.parse_size accepts the same forms; it is not imported so the parent stays distmerge-free.
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]i?B|B)?\s*", text, re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (try 0.8GB, 500MB)")
    return int(float(m[1]) * UNITS[(m[2] or "").upper()])


def bench_args(doc: str, work: str, what: str,
               more: Callable[[argparse.ArgumentParser], None] | None = None) -> argparse.Namespace:
    """The options both benchmarks take; `work` is the default folder, `what` names the checkpoint(s); `more` adds
    a benchmark's own."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    if more:
        more(parser)
    parser.add_argument("--size", type=parse_size, default=parse_size("0.8GB"), help="model bytes, fp32 (0.8GB)")
    parser.add_argument("--world", type=int, default=8, help=f"training world size W of the {what} (8)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per method; the median is reported (3)")
    parser.add_argument("--work", type=Path, default=Path(work), help=f"{what} + outputs")
    parser.add_argument("--keep", action="store_true", help=f"keep the merged outputs (the {what} always kept)")
    parser.add_argument("--max-shard-size", default="5GB", help="passed to distmerge and the tools that split (5GB)")
    return parser.parse_args()


def gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


def run(cmd: list[str], log: Path) -> tuple[float, int]:
    """Wall seconds and peak RSS in bytes (largest single process of the tree) of one command."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    with open(log, "w") as out:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
        # wait4 reports this child alone; RUSAGE_CHILDREN would also count every earlier child (the maker).
        _, status, usage = os.wait4(proc.pid, 0)
        seconds = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:])
        raise Failed(f"exit {proc.returncode}: {shlex.join(cmd)}\n--- last lines of {log} ---\n{tail}")
    return seconds, usage.ru_maxrss * 1024  # Linux reports KiB


def ensure_checkpoint(args: argparse.Namespace, work: Path, layout: str = "fsdp") -> Path:
    """Reuse the checkpoint in work/ when its stamp matches these parameters, else build it (the slow part)."""
    import torch

    # The fsdp names predate the other layouts; keeping them lets an existing stamp still match.
    name, log = ("ckpt", "make_ckpt.log") if layout == "fsdp" else (f"ckpt-{layout}", f"make_ckpt_{layout}.log")
    ckpt, tmp, stamp_path = work / name, work / f"{name}.partial", work / f"{name}.stamp.json"
    maker = HERE / "make_ckpt.py"
    stamp = {"size": args.size, "world": args.world, "shape": llama_shape(args.size), "torch": torch.__version__,
             "maker_sha256": hashlib.sha256(maker.read_bytes()).hexdigest()}
    if layout != "fsdp":
        stamp["layout"] = layout
    if stamp_path.exists() and json.loads(stamp_path.read_text()) == stamp:
        print(f"reusing checkpoint {ckpt} (stamp matches)")
        return ckpt
    for old in (ckpt, tmp):
        shutil.rmtree(old, ignore_errors=True)
    stamp_path.unlink(missing_ok=True)
    cmd = [*TORCHRUN, "--standalone", "--nproc-per-node", str(args.world), str(maker), "--out", str(tmp),
           "--size", str(args.size)] + (["--layout", layout] if layout != "fsdp" else [])
    print(f"making checkpoint: {shlex.join(cmd)}", flush=True)
    seconds, _ = run(cmd, work / "logs" / log)
    print(next(line for line in (work / "logs" / log).read_text().splitlines() if "make_ckpt:" in line))
    tmp.rename(ckpt)  # only a finished checkpoint ever gets the name (and the stamp) that allow reuse
    stamp_path.write_text(json.dumps(stamp, indent=2) + "\n")
    print(f"checkpoint made in {seconds:.1f} s")
    return ckpt


HOT: list[Path] = []  # the inputs warm() was given: read again before every timed run (ready())


def warm(files: list[Path]) -> None:
    """Read the files now, and again before every timed run, so no method pays cold reads another skips. Once is
    not enough on these machines: the VM's DAMON reclaim pages out page-cache memory not accessed for about a
    minute (/sys/kernel/mm/damon/admin/kdamonds/0: action pageout, min age 12 x 5 s), so in a bench's rotation
    the inputs of one run were sometimes cold and sometimes hot, by chance (a merge's own timer 0.65 s hot,
    1.65 s cold)."""
    HOT[:] = files
    _read(files)


# Memory touched just before every timed run, then freed. The suspected cause of the drift it fights (not
# isolated): this VM gives free memory back to its host (virtio-balloon free page reporting: bit 5 of
# /sys/bus/virtio/drivers/virtio_balloon/*/features), and the next process that uses such pages waits while the
# host hands them out again, so which method got recycled memory was chance: in one ZeRO-3 run the own
# timer of distmerge N=2 fell with every repeat (2.57, 1.85, 1.14, 0.77, 0.71 s) as the bench's own churn brought
# memory back, and the same merges run back to back took 0.35-0.40 s. Touched and freed right before the timed
# command starts, these pages are the ones it gets. 3 GiB: more than any method here allocates.
READY_BYTES = 3 << 30


# In a child process of its own: touched in this one, the pages would raise its peak RSS, which a command it
# starts inherits (vfork + exec carries the parent's high-water mark into the child's ru_maxrss).
_TOUCH = f"m = bytearray({READY_BYTES}); m[::4096] = bytes(len(range(0, {READY_BYTES}, 4096)))"


def ready() -> None:
    """Before every timed run: the inputs re-read (HOT) and guest memory handed back by the host (READY_BYTES)."""
    _read(HOT)
    subprocess.run([PY, "-c", _TOUCH], check=True)  # every page written once, freed when the child exits


def _read(files: list[Path]) -> None:
    for path in files:
        with open(path, "rb") as f:
            while f.read(1 << 24):
                pass


def slug(row: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", row.lower()).strip("_")


class Bench:
    """Every run's wall time per row, peak RSS per rank, own timers and the exact commands."""

    width = 15  # of the row name in the per-run lines

    def __init__(self, args: argparse.Namespace, work: Path, rows: list[str]) -> None:
        self.args, self.work = args, work
        self.times: dict[str, list[float]] = {row: [] for row in rows}
        self.rss: dict[str, list[int]] = {}  # row -> peak RSS per rank (max over repeats)
        self.inner: dict[str, list[float]] = {}  # each tool's own "seconds", from its JSON summary
        self.commands: dict[str, str] = {}
        self.out = work / "out"

    def fresh(self, name: str) -> Path:
        dest = self.out / name
        shutil.rmtree(dest, ignore_errors=True)  # outside the timing: every run writes into a new folder
        # ...and the deletion settled outside it too: / is mounted with `discard`, so freeing a just-written
        # 0.8 GB file queues discards that the next fsync's journal commit waits for (a merge right after one
        # took 1.25 s instead of 0.67 s).
        os.sync()
        return dest

    def keep_peak(self, row: str, peaks: list[int]) -> None:
        self.rss[row] = [max(a, b) for a, b in zip(self.rss.get(row, [0] * len(peaks)), peaks, strict=True)]

    def cp(self, files: list[Path], pattern: str, row: str = "cp") -> None:
        """cp of files into a fresh folder (row), then sync of each copy (row+sync); row names a second floor."""
        dest, names = self.fresh(slug(row)), [str(p) for p in files]
        dest.mkdir(parents=True)
        self.commands.setdefault(row, shlex.join(["cp", "-r", *names, str(dest)]))
        ready()
        cp_s, _ = run(["cp", "-r", *names, str(dest)], self.work / "logs" / f"{slug(row)}.log")
        self.commands.setdefault(f"{row}+sync", f"({row} as above) && sync {dest}/{pattern}")
        sync_s, _ = run(["sync", *(str(dest / p.name) for p in files)], self.work / "logs" / "sync.log")
        self.times[row].append(cp_s)
        self.times[f"{row}+sync"].append(cp_s + sync_s)
        print(f"    {row:<{self.width}} {cp_s:8.2f} s  (+ sync {sync_s:.2f} s = {cp_s + sync_s:.2f} s)", flush=True)

    def launch(self, n: int) -> None:
        prefix = [*TORCHRUN, "--standalone", "--nproc-per-node", str(n), "--no-python", PY] if n > 1 else [PY]
        # Start the processes and import everything a merge imports, as `python -m distmerge` imports it (the
        # CLI's start-up: GC off, then the imported objects frozen; cli._start_up), then exit.
        row, cmd = f"launch N={n}", [*prefix, "-c", LAUNCH_ONLY]
        self.commands.setdefault(row, shlex.join(cmd))
        ready()
        seconds, _ = run(cmd, self.work / "logs" / f"launch_n{n}.log")
        self.times[row].append(seconds)
        print(f"    {row:<{self.width}} {seconds:8.2f} s", flush=True)

    def distmerge(self, n: int, ckpt: Path, row: str = "", tag: str = "", extra: tuple[str, ...] = ()) -> None:
        """One distmerge run with n processes; tag tells apart runs on other inputs (outputs, logs, summaries);
        extra: more merge options (e.g. --hf-config)."""
        row, name = row or f"distmerge N={n}", f"n{n}{tag}"
        summary = self.work / f"summary_{name}.json"
        prefix = [*TORCHRUN, "--standalone", "--nproc-per-node", str(n)] if n > 1 else [PY]
        summary.unlink(missing_ok=True)
        cmd = [*prefix, "-m", "distmerge", "merge", "--input", str(ckpt), "--output", str(self.fresh(name)),
               *extra, "--overwrite", "--quiet", "--json-summary", str(summary), "--max-shard-size",
               self.args.max_shard_size]
        self.commands.setdefault(row, shlex.join(cmd))
        ready()
        seconds, _ = run(cmd, self.work / "logs" / f"distmerge_{name}.log")
        data = json.loads(summary.read_text())
        peaks = [r["peak_rss"] for r in sorted(data["ranks"], key=lambda r: r["rank"])]
        self.times[row].append(seconds)
        self.inner.setdefault(row, []).append(data["seconds"])
        self.keep_peak(row, peaks)
        print(f"    {row:<{self.width}} {seconds:8.2f} s  (own timer {data['seconds']:.2f} s, peak RSS per rank "
              f"{' / '.join(gb(p) for p in peaks)})", flush=True)

    def peer(self, row: str, cmd: list[str], dest: Path, summary: Path | None = None, own_in_line: bool = True,
             shown: str = "") -> None:
        """A merger that does not fsync: its wall time alone (row) and with a sync of what it wrote (row+sync).

        summary, when given, is its JSON: {"seconds": own timer} and, for several processes, "ranks" with
        "peak_rss" each (wait4 sees only the launcher then); shown replaces cmd in the printed commands.
        """
        if summary:
            summary.unlink(missing_ok=True)
        self.commands.setdefault(row, shown or shlex.join(cmd))
        ready()
        seconds, rss = run(cmd, self.work / "logs" / f"{slug(row)}.log")
        sync_s, _ = run(["sync", *(str(p) for p in dest.iterdir())], self.work / "logs" / "sync.log")
        self.commands.setdefault(f"{row}+sync", f"({row} as above) && sync {dest}/*")
        self.times[row].append(seconds)
        self.times[f"{row}+sync"].append(seconds + sync_s)
        data = json.loads(summary.read_text()) if summary else {}
        peaks = [r["peak_rss"] for r in sorted(data["ranks"], key=lambda r: r["rank"])] if "ranks" in data else [rss]
        self.keep_peak(row, peaks)
        own = ""
        if "seconds" in data:
            self.inner.setdefault(row, []).append(data["seconds"])
            own = f", own timer {data['seconds']:.2f} s" if own_in_line else ""
        what = "peak RSS" if len(peaks) == 1 else "peak RSS per rank"
        print(f"    {row:<{self.width}} {seconds:8.2f} s  (+ sync {sync_s:.2f} s{own}, {what} "
              f"{' / '.join(gb(p) for p in peaks)})", flush=True)

    def measure(self, actions: list[Callable[[], None]]) -> None:
        for i in range(self.args.repeats):
            print(f"  repeat {i + 1}/{self.args.repeats}", flush=True)
            # Rotate the start so each method takes every position in turn (first = coldest imports etc.);
            # neighbours stay the same, which is harmless as each method syncs what it wrote before the next.
            k = i % len(actions)
            for action in actions[k:] + actions[:k]:
                action()


def show(rows: list[list[str]], markdown: bool) -> str:
    if markdown:
        lines = ["| " + " | ".join(r) + " |" for r in rows]
        lines.insert(1, "|" + "|".join("---" if i == 0 else "---:" for i in range(len(rows[0]))) + "|")
        return "\n".join(lines)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    cells = (zip(r, widths, strict=True) for r in rows)
    return "\n".join("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(row)) for row in cells)


def cpu_name() -> str:
    with open("/proc/cpuinfo") as f:
        names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
    return names[0] if names else platform.machine()


def machine_line() -> str:
    """The '- date: ...' line of the Markdown block: what a reader needs to compare with their machine."""
    import torch

    # The parent never imports distmerge (it may not be installed): ask it.
    version = subprocess.run([PY, "-m", "distmerge", "--version"], capture_output=True, text=True, cwd=ROOT,
                             env=dict(os.environ, PYTHONPATH=str(ROOT))).stdout.split()[-1]
    return (f"- date: {datetime.date.today().isoformat()}; nproc: {len(os.sched_getaffinity(0))}; "
            f"RAM: {os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB; "
            f"CPU: {cpu_name()}; torch {torch.__version__}; distmerge {version}; "
            f"Python {platform.python_version()}")


def print_checks(checks: list[tuple[str, list[str]]]) -> bool:
    """Print each check's verdict and its first problems; True when none found any."""
    ok = True
    for title, problems in checks:
        print(f"check {title}: {'OK' if not problems else 'FAILED'}")
        for p in problems[:20]:
            print(f"    {p}")
        ok = ok and not problems
    return ok


def close_report(rows: list[list[str]], ok: bool, keep: bool, out: Path, kept_inputs: str) -> int:
    """The end both benchmarks print: the Markdown table, the verdict, what was kept; the exit status."""
    print(show(rows, markdown=True))
    print("----- end -----")
    print(f"\ncorrectness: {'OK' if ok else 'FAILED'}")
    if not keep:
        shutil.rmtree(out, ignore_errors=True)
    kept = f"kept in {out}" if keep else "deleted (--keep keeps them)"
    print(f"{kept_inputs}; merged outputs {kept}")
    return 0 if ok else 1


def print_results(bench: Bench, rows: list, what: str, note: str = "") -> None:
    """The results table (plain text) and the exact commands behind each row."""
    print(f"\nresults (median of {bench.args.repeats}; GB/s = {what} / s; hot page cache, nothing dropped):")
    print(show(rows, markdown=False))
    if note:
        print(note)
    print("\ncommands:")
    for row, cmd in bench.commands.items():
        print(f"  {row}: {cmd}")

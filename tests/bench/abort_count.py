"""Count aborts at exit ("terminate called without an active exception", SIGABRT) on every exit path of a
torchrun merge, and of the fixture save job, N runs each (issue #13 item 2; docs/reliability.md records the
result).

    python tests/bench/abort_count.py --runs 50 [--work DIR]

Paths (2 processes under torchrun, loopback gloo): success; input error (a missing --input: fails in
discovery, on rank 0, before any data moves); error on one rank (one rank's input file truncated: it fails
reading, mid-merge, the other rank does not); SIGINT (Ctrl-C to torchrun mid-merge, slowed down by a pause
per round: every rank ends with exit 130); the FSDP fixture save job (make_fsdp.py, 2 ranks, what the demo
runs first); fp8-channel (a successful merge with --quantize fp8-channel: rank 0 imports compressed-tensors,
and with it transformers and torch.distributed.nn.functional, while the group is up, at finalize); api-import
(tests/jobs/import_in_job.py: a job that starts its own group, calls distmerge.import_checkpoint twice, destroys
its group and exits; rank 0 imports torch.distributed.checkpoint for the `.metadata` while the job's group is up).
A run counts as an abort when its output names SIGABRT / "terminate called" / exit -6.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ABORT_SIGNS = ("terminate called", "SIGABRT", "Signal 6", "exitcode  : -6")


def torchrun_cmd(port: int, *args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--nnodes", "1",
            "--master-addr", "127.0.0.1", "--master-port", str(port), *args]


def run(cmd: list[str], env: dict[str, str], interrupt_when: Path | None = None) -> tuple[int, str]:
    """Run to the end; with `interrupt_when`, send SIGINT (Ctrl-C) once that folder holds a file, i.e. mid-merge
    (the merge has started writing), not while torchrun itself is still importing torch."""
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if interrupt_when is not None:
        deadline = time.monotonic() + 240
        while proc.poll() is None and time.monotonic() < deadline:
            if interrupt_when.is_dir() and any(interrupt_when.rglob("*")):
                time.sleep(0.5)
                proc.send_signal(signal.SIGINT)
                break
            time.sleep(0.05)
    out, _ = proc.communicate(timeout=300)
    return proc.returncode, out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--work", type=Path, default=None, help="scratch folder (default: a temp folder)")
    parser.add_argument("--paths",
                        default="success,input-error,one-rank-error,sigint,fixture-save,fp8-channel,api-import")
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="distmerge-aborts-"))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", PYTHONPATH=str(REPO))
    port = [29700]

    def next_port() -> int:
        port[0] = 29700 + (port[0] - 29699) % 200
        return port[0]

    def fixture_save(i: int) -> tuple[int, str]:
        out = work / "fixture"
        shutil.rmtree(out, ignore_errors=True)
        return run(torchrun_cmd(next_port(), "tests/fixtures/make_fsdp.py", "--out", str(out),
                                "--case", "fsdp2_llama_w2"), env)

    # One real checkpoint for the merge paths, made by the fixture job itself.
    code, log = fixture_save(0)
    if code != 0:
        print(log[-3000:])
        return 1
    ckpt = work / "ckpt"
    shutil.copytree(work / "fixture" / "fsdp2_llama_w2", ckpt, dirs_exist_ok=True)
    broken = work / "broken"
    shutil.copytree(ckpt, broken, dirs_exist_ok=True)
    victim = broken / "model_world_size_2_rank_1.pt"
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])

    def merge(inp: Path, extra_env: dict[str, str] | None = None, interrupt: bool = False, more: tuple = ()):
        out = work / "out"
        shutil.rmtree(out, ignore_errors=True)
        cmd = torchrun_cmd(next_port(), "-m", "distmerge", "merge", "--input", str(inp), "--output", str(out),
                           "--quiet", "--budget", "16KiB", *more)
        return run(cmd, {**env, **(extra_env or {})}, out if interrupt else None)

    def api_import(i: int) -> tuple[int, str]:
        if not (work / "hf").is_dir():
            sys.path.insert(0, str(REPO))
            from tests.helpers.importing import save_hf_model

            save_hf_model("llama4", work / "hf")
        out = work / "imported"
        shutil.rmtree(out, ignore_errors=True)
        return run(torchrun_cmd(next_port(), "tests/jobs/import_in_job.py", str(work / "hf"), str(out), "2", "2",
                                "2"), env)

    paths: dict[str, Callable[[int], tuple[int, str]]] = {
        "success": lambda i: merge(ckpt),
        "input-error": lambda i: merge(work / "nope"),
        "one-rank-error": lambda i: merge(broken),
        "sigint": lambda i: merge(ckpt, {"DISTMERGE_TEST_ROUND_DELAY": "0.2"}, interrupt=True),
        "fixture-save": fixture_save,
        "fp8-channel": lambda i: merge(ckpt, more=("--quantize", "fp8-channel")),
        "api-import": api_import,
    }
    # Ctrl-C: every worker ends with distmerge's one line and exit 130; torchrun itself then exits 1 with its own
    # SignalException traceback (torch's launcher, not distmerge: docs/reliability.md shows it).
    interrupted = "output file(s) are finished and kept; run the same command with --resume"
    expected: dict[str, Callable[[int, str], bool]] = {
        "success": lambda code, out: code == 0,
        # torchrun's summary quotes the line again ("traceback : distmerge: error: ..."): count whole lines
        "input-error": lambda code, out: code == 1 and out.splitlines().count(
            next((ln for ln in out.splitlines() if ln.startswith("distmerge: error:")), "-")) == 1,
        "one-rank-error": lambda code, out: code == 1 and "distmerge: error:" in out,
        "sigint": lambda code, out: code != 0 and out.count(interrupted) == 1,
        "fixture-save": lambda code, out: code == 0,
        "fp8-channel": lambda code, out: code == 0,
        "api-import": lambda code, out: code == 0 and out.count("process unchanged") == 2,
    }
    print(f"{'path':16} {'runs':>5} {'aborts':>7} {'unexpected exit':>16} {'median s':>9}", flush=True)
    total_aborts = 0
    for name in args.paths.split(","):
        aborts, odd, times = 0, 0, []
        for i in range(args.runs):
            start = time.perf_counter()
            code, out = paths[name](i)
            times.append(time.perf_counter() - start)
            if any(sign in out for sign in ABORT_SIGNS):
                aborts += 1
                (work / f"abort-{name}-{i}.log").write_text(out)
            elif not expected[name](code, out):
                odd += 1
                (work / f"odd-{name}-{i}.log").write_text(out)
        total_aborts += aborts
        times.sort()
        print(f"{name:16} {args.runs:>5} {aborts:>7} {odd:>16} {times[len(times) // 2]:>9.1f}", flush=True)
    print(f"logs of aborts / unexpected exits (if any): {work}")
    return 1 if total_aborts else 0


if __name__ == "__main__":
    sys.exit(main())

"""Bad input and bad output paths: one clear line, a non-zero exit, no index, the input untouched."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO, merge_inproc, torchrun, tree_bytes


@pytest.fixture
def ckpt(fsdp_ckpts, tmp_path) -> Path:
    """A private copy of a W=4 checkpoint that a test may damage."""
    return Path(shutil.copytree(fsdp_ckpts["fsdp2_llama_w4"], tmp_path / "ckpt"))


def error_line(capsys) -> str:
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1, lines
    assert lines[0].startswith("distmerge: error: ")
    return lines[0]


def test_missing_rank_file(ckpt, tmp_path, capsys):
    (ckpt / "model_world_size_4_rank_2.pt").unlink()
    assert merge_inproc("--input", ckpt, "--output", tmp_path / "out") == 1
    assert "rank files missing for ranks 2 of world size 4" in error_line(capsys)
    assert not (tmp_path / "out").exists()


def test_fsdp_config_disagrees(ckpt, tmp_path, capsys):
    (ckpt / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": 8}))
    assert merge_inproc("--input", ckpt, "--output", tmp_path / "out") == 1
    assert "says world_size 8 but the rank files are for world size 4" in error_line(capsys)


def test_missing_config_json(ckpt, tmp_path, capsys):
    shutil.rmtree(ckpt / "huggingface")
    assert merge_inproc("--input", ckpt, "--output", tmp_path / "out") == 1
    assert "pass --hf-config DIR" in error_line(capsys)


class Payload:
    """Unpickling this creates a file: proof that code ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_pickle_that_runs_code_is_refused(ckpt, tmp_path, capsys):
    marker = tmp_path / "ran"
    torch.save({"model.norm.weight": Payload(marker)}, ckpt / "model_world_size_4_rank_1.pt")
    assert merge_inproc("--input", ckpt, "--output", tmp_path / "out") == 1
    assert "never runs code" in error_line(capsys)
    assert not marker.exists()


def test_output_not_empty_needs_overwrite(ckpt, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    before = tree_bytes(ckpt)
    assert merge_inproc("--input", ckpt, "--output", out) == 1
    assert "pass --overwrite" in error_line(capsys)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    (out / "model-00009-of-00009.safetensors").write_text("stale")
    assert merge_inproc("--input", ckpt, "--output", out, "--overwrite") == 0
    assert sorted(p.name for p in out.glob("model*")) == ["model.safetensors", "model.safetensors.index.json"]
    assert (out / "keep.txt").read_text() == "mine"
    assert tree_bytes(ckpt) == before  # the input is never modified


def test_output_inside_input_is_refused(ckpt, capsys):
    assert merge_inproc("--input", ckpt, "--output", ckpt / "merged") == 1
    assert "inside the input" in error_line(capsys)
    assert not (ckpt / "merged").exists()


@pytest.mark.torchrun
def test_failure_on_one_rank_stops_every_rank(ckpt, tmp_path):
    """Rank 1 reads a truncated file: both ranks exit non-zero with the same message, no index."""
    victim = ckpt / "model_world_size_4_rank_1.pt"
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    run = torchrun(2, "merge", "--input", ckpt, "--output", tmp_path / "out", "--quiet", timeout=120, real=True)
    assert run.returncode != 0
    errors = [line for line in run.stderr.splitlines() if line.startswith("distmerge: error:")]
    assert len(errors) == 1 and "model_world_size_4_rank_1.pt" in errors[0], run.stderr[-2000:]
    assert not (tmp_path / "out" / "model.safetensors.index.json").exists()


@pytest.mark.torchrun
@pytest.mark.parametrize(("args", "line"), [
    (["--input", "/nope"], "distmerge: error: input /nope does not exist"),
    (["--input", "/nope", "--dtype", "fp8"], "distmerge merge: error: argument --dtype: invalid choice: 'fp8'"),
])
def test_torchrun_shows_the_error_once_and_as_its_root_cause(args, line, tmp_path):
    """Made to fail first: every rank printed the error (and argparse's usage), torchrun's summary said
    "To enable traceback see ...", and a third of failed runs aborted at exit (SIGABRT) instead of exit 1."""
    run = torchrun(2, "merge", *args, "--output", tmp_path / "out", timeout=120, real=True)
    assert run.returncode != 0
    ours = [s for s in run.stderr.splitlines() if "error:" in s and s.startswith("distmerge")]
    assert len(ours) == 1 and ours[0].startswith(line), run.stderr[-3000:]
    assert f"traceback : {line}" in run.stderr, run.stderr[-3000:]  # torchrun's root cause is our line
    assert "usage:" not in run.stderr or run.stderr.count("usage:") == 1
    assert "terminate called" not in run.stderr and "SIGABRT" not in run.stderr


ERROR_CASES = [(["--input", "/nope"], "distmerge: error: input /nope does not exist"),
               (["--input", "/nope", "--dtype", "fp8"], "distmerge merge: error: argument --dtype: invalid choice")]


def failing_job(k: int, out: Path, env: dict[str, str] | None = None) -> tuple[str, subprocess.CompletedProcess]:
    """Error case k % 2 under `torchrun --standalone` (a free port of its own: several may run at once)."""
    args, line = ERROR_CASES[k % 2]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "distmerge",
           "merge", *args, "--output", str(out / f"out{k}")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", **(env or {})}
    return line, subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=REPO)


def one_line_each(runs: list[tuple[str, subprocess.CompletedProcess]]) -> list[str]:
    """The stderr tails of the runs that did not print their error line exactly once, before torchrun's failure
    summary (or exited 0)."""
    return [run.stderr[-1500:] for line, run in runs if run.returncode == 0 or not said_first(line, run.stderr)]


def said_first(line: str, stderr: str) -> bool:
    lines = stderr.splitlines()
    ours = [i for i, s in enumerate(lines) if s.startswith(line)]
    summary = next((i for i, s in enumerate(lines) if "ChildFailedError" in s or "Root Cause" in s), len(lines))
    return len(ours) == 1 and ours[0] < summary


@pytest.mark.torchrun
def test_the_one_line_comes_even_when_rank_0_is_slow(tmp_path):
    """Rank 1 holds the same error and stays silent: it must not exit before rank 0 has printed it, or torchrun
    kills rank 0 first (issue 25 saw the line missing once in 625 tests on a loaded machine). Made deterministic
    by slowing rank 0 down by 3 s (the test seam DISTMERGE_TEST_RANK0_ERROR_DELAY), checked to happen: the seam
    says so on stderr. Seen failing with cli.let_rank_0_speak's wait set to 0: neither run printed the line."""
    with ThreadPoolExecutor(2) as pool:  # the two error cases side by side: each mostly waits out rank 0's delay
        runs = list(pool.map(lambda k: failing_job(k, tmp_path, {"DISTMERGE_TEST_RANK0_ERROR_DELAY": "3"}), range(2)))
    slowed = [run.stderr.count("distmerge test seam: rank 0 waits 3 s before its error") for _, run in runs]
    assert slowed == [1, 1], f"rank 0 was not slowed down once in each run: {slowed}"
    missed = one_line_each(runs)
    assert not missed, f"{len(missed)} of 2 runs without exactly one error line; first:\n{missed[0]}"


@pytest.mark.torchrun
@pytest.mark.skipif(not os.environ.get("DISTMERGE_STRESS_TESTS"),
                    reason="20 torchrun jobs under load (45-80 s): run with DISTMERGE_STRESS_TESTS=1")
def test_the_one_line_is_printed_every_time_under_load(tmp_path):
    """20 failing torchrun jobs, 4 at a time, beside two busy processes: the one line is on stderr every time,
    before torchrun's summary. On 2026-12-01 (load average 13), 20 of 20 with the fix, and 20 of 20 even without
    let_rank_0_speak's wait: this load does not bring the race out; the test above does, deterministically
    (docs/reliability.md, "The one line, whichever rank fails first")."""
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        with ThreadPoolExecutor(4) as pool:
            runs = list(pool.map(lambda k: failing_job(k, tmp_path), range(20)))
    finally:
        for proc in busy:
            proc.kill()
            proc.wait()
    missed = one_line_each(runs)
    assert not missed, f"{len(missed)} of 20 runs without exactly one error line; first:\n{missed[0]}"


def test_the_folder_above_the_checkpoint_names_it(fsdp_ckpts, tmp_path, capsys):
    """verl's global_step_N/ holds actor/ (and critic/): the message says which folder to pass."""
    step = tmp_path / "global_step_1"
    shutil.copytree(fsdp_ckpts["fsdp2_llama_w2"], step / "actor")
    (step / "data.pt").write_bytes(b"")
    assert merge_inproc("--input", step, "--output", tmp_path / "out") == 1
    assert f"holds one: pass {step / 'actor'} (fsdp)" in error_line(capsys)


def test_an_already_merged_model_is_named(fsdp_ckpts, tmp_path, capsys):
    assert merge_inproc("--input", fsdp_ckpts["fsdp2_llama_w2"], "--output", tmp_path / "merged") == 0
    assert merge_inproc("--input", tmp_path / "merged", "--output", tmp_path / "again") == 1
    assert "is already a Hugging Face model" in error_line(capsys)


def test_dtype_takes_torch_names_too(fsdp_ckpts, tmp_path):
    assert merge_inproc("--input", fsdp_ckpts["fsdp2_llama_w2"], "--output", tmp_path / "a", "--dtype", "bfloat16") == 0
    assert merge_inproc("--input", fsdp_ckpts["fsdp2_llama_w2"], "--output", tmp_path / "b", "--dtype", "bf16") == 0
    assert tree_bytes(tmp_path / "a") == tree_bytes(tmp_path / "b")


@pytest.mark.torchrun
def test_merge_sh_ends_with_the_error_line(tmp_path):
    """launch/merge.sh repeats distmerge's line after torchrun's own traceback and summary."""
    import subprocess

    from tests.conftest import REPO

    env = {**os.environ, "NPROC": "2", "OMP_NUM_THREADS": "1", "PYTHON": sys.executable}
    run = subprocess.run(["bash", str(REPO / "launch" / "merge.sh"), "--input", "/nope", "--output", tmp_path / "o"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 1
    assert run.stderr.strip().splitlines()[-1] == "distmerge: error: input /nope does not exist"

"""distmerge.merge() / distmerge.verify(): the CLI's options, its bytes, typed errors, silence, and a real
training-like torchrun job calling the API on every rank (tests/jobs/api_in_job.py)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

import distmerge
from distmerge.errors import InputError
from tests.conftest import REPO, free_port, input_untouched, merge_inproc, tree_bytes

# The API's options against the command line's, --help and the README: tests/test_options_agree.py


def test_merge_in_process_is_the_cli_bytes_and_silent(fsdp_ckpts, tmp_path, capsys):
    ckpt = fsdp_ckpts["fsdp2_llama_w4"]
    assert merge_inproc("--input", ckpt, "--output", tmp_path / "cli") == 0
    capsys.readouterr()
    with input_untouched(ckpt):
        result = distmerge.merge(ckpt, tmp_path / "api")
    assert capsys.readouterr() == ("", "")
    assert result.processes == 1 and result.tensors > 0
    assert tree_bytes(tmp_path / "api") == tree_bytes(tmp_path / "cli")
    checked = distmerge.verify(tmp_path / "api", tmp_path / "cli")
    assert checked.passed
    assert capsys.readouterr() == ("", "")


def test_errors_are_raised_typed_not_exited(tmp_path, capsys):
    with pytest.raises(InputError, match="missing"):
        distmerge.merge(tmp_path / "missing", tmp_path / "out")
    with pytest.raises(InputError, match="dtype"):
        distmerge.merge(tmp_path, tmp_path / "out", dtype="fp8")
    with pytest.raises(InputError, match="max_shard_size"):
        distmerge.merge(tmp_path, tmp_path / "out", max_shard_size="lots")
    with pytest.raises(InputError, match="budget=0"):
        distmerge.merge(tmp_path, tmp_path / "out", budget=0)
    with pytest.raises(InputError, match="overwrite='yes'"):
        distmerge.merge(tmp_path, tmp_path / "out", overwrite="yes")
    with pytest.raises(TypeError, match="max_shard"):
        distmerge.merge(tmp_path, tmp_path / "out", max_shard="5GB")
    assert capsys.readouterr() == ("", "")


def test_a_running_job_calls_the_api_on_every_rank(fsdp_ckpts, tmp_path):
    """tests/jobs/api_in_job.py, 2 processes with gloo: two merges and two verifies in the job's processes (the
    second pair through a gloo side group, as an NCCL job gets), each leaving the process as it found it, the same
    results on every rank, training steps before and after. Shown to fail: with Comm.close() leaving the side group
    up, "merge 2: groups: 1 -> 2" (and its sockets: "files: ..."); with the API installing a SIGTERM handler,
    "merge: signals: {<Signals.SIGTERM: 15>: <Handlers.SIG_DFL: 0>} -> {...}"; with the walk of the input kept
    (input_tree.forget not called), "merge: input_walks: 0 -> 1"; before api.as_found, "verify: rng: ..." (rich's
    import draws from Python's random)."""
    ckpt = fsdp_ckpts["fsdp2_llama_w4"]
    assert merge_inproc("--input", ckpt, "--output", tmp_path / "cli") == 0
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--nnodes", "1",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(REPO / "tests/jobs/api_in_job.py"),
           str(ckpt), str(tmp_path / "job"), str(tmp_path / "cli"), "gloo"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "PYTHONPATH": str(REPO)}
    with input_untouched(ckpt):
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=REPO)
    assert done.returncode == 0, done.stdout + done.stderr
    said = re.findall(r"^rank (\d): merged \d+ tensors into \d+ file\(s\) with 2 processes, twice; verify passed "
                      r"(\d+) \+ \2; training step after: .*; process unchanged$", done.stdout, re.MULTILINE)
    assert [rank for rank, _ in said] == ["0", "1"], done.stdout
    assert tree_bytes(tmp_path / "job" / "first") == tree_bytes(tmp_path / "job" / "second") == tree_bytes(
        tmp_path / "cli")

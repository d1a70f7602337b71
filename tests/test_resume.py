"""Never lose work: a killed or interrupted merge leaves no index, and --resume finishes it, keeping the
files that were complete and producing the same bytes as an uninterrupted run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, free_port, merge_inproc, tree_bytes

SPLIT = ["--max-shard-size", "60KB"]


@pytest.fixture(scope="module")
def clean(fsdp_ckpts, tmp_path_factory) -> Path:
    """The uninterrupted result every resumed run must equal, byte for byte."""
    out = tmp_path_factory.mktemp("clean") / "out"
    assert merge_inproc("--input", fsdp_ckpts["fsdp2_llama_w4"], "--output", out, *SPLIT, "--checksum") == 0
    return out


def model_files(out: Path) -> list[Path]:
    return sorted(out.glob("model-*-of-*.safetensors"))


def interrupted_copy(clean: Path, dest: Path, lose: int) -> Path:
    """What a killed run leaves: some files finished (with records), one half-written, no index."""
    dest.mkdir()
    for path in model_files(clean)[lose:]:
        (dest / path.name).write_bytes(path.read_bytes())
    (dest / ".distmerge").mkdir()
    for path in model_files(clean)[lose:]:
        record = clean / ".distmerge" / f"{path.name}.json"
        (dest / ".distmerge" / record.name).write_bytes(record.read_bytes())
    lost = model_files(clean)[0]
    (dest / f".{lost.name}.partial").write_bytes(lost.read_bytes()[:100])
    return dest


def resume(ckpt: Path, out: Path, *extra: str) -> dict:
    summary = out.parent / f"{out.name}.json"
    assert merge_inproc("--input", ckpt, "--output", out, *SPLIT, "--resume", "--json-summary", summary, *extra) == 0
    return json.loads(summary.read_text())


def test_resume_keeps_finished_files_and_matches_a_clean_run(fsdp_ckpts, clean, tmp_path):
    out = interrupted_copy(clean, tmp_path / "out", lose=2)
    summary = resume(fsdp_ckpts["fsdp2_llama_w4"], out, "--checksum")
    assert summary["resumed_files"] == len(model_files(clean)) - 2
    assert tree_bytes(out) == tree_bytes(clean)
    assert not list(out.glob(".*.partial"))


def test_resume_redoes_everything_when_the_input_changed(fsdp_ckpts, clean, tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.symlink_to(fsdp_ckpts["fsdp2_llama_w4"])
    out = interrupted_copy(clean, tmp_path / "out", lose=1)
    rank_file = fsdp_ckpts["fsdp2_llama_w4"] / "model_world_size_4_rank_0.pt"
    stat = rank_file.stat()
    os.utime(rank_file, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))
    try:
        assert resume(ckpt, out, "--checksum")["resumed_files"] == 0
    finally:
        os.utime(rank_file, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert tree_bytes(out) == tree_bytes(clean)


def test_resume_redoes_a_file_whose_bytes_changed(fsdp_ckpts, clean, tmp_path):
    out = interrupted_copy(clean, tmp_path / "out", lose=1)
    victim = model_files(out)[-1]
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF  # same size, same header: only the checksum can tell
    victim.write_bytes(bytes(data))
    summary = resume(fsdp_ckpts["fsdp2_llama_w4"], out, "--checksum")
    assert summary["resumed_files"] == len(model_files(clean)) - 2
    assert tree_bytes(out) == tree_bytes(clean)


def test_manifest_lists_tensors_sizes_and_checksums(clean):
    manifest = json.loads((clean / "distmerge.manifest.json").read_text())
    names = [f["name"] for f in manifest["files"]]
    assert names == [p.name for p in model_files(clean)]
    for entry in manifest["files"]:
        assert entry["bytes"] == (clean / entry["name"]).stat().st_size
        assert len(entry["sha256"]) == 64 and entry["tensors"]


@pytest.mark.torchrun
def test_sigkill_of_one_rank_then_resume(fsdp_ckpts, clean, tmp_path):
    """Kill rank 1 mid-merge: the job ends non-zero within seconds, no index exists, --resume finishes it."""
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--nnodes", "1",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "-m", "distmerge", "merge", "--quiet",
           "--input", str(fsdp_ckpts["fsdp2_llama_w4"]), "--output", str(out), *SPLIT, "--budget", "16KB",
           "--checksum"]
    env = {**os.environ, "DISTMERGE_TEST_ROUND_DELAY": "0.3", "OMP_NUM_THREADS": "1"}
    job = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not model_files(out) and time.monotonic() < deadline and job.poll() is None:
        time.sleep(0.05)
    assert model_files(out), "the merge finished no file before the deadline"
    victim = rank_pid(job.pid, rank=1)
    os.kill(victim, signal.SIGKILL)
    killed_at = time.monotonic()
    job.communicate(timeout=60)
    assert job.returncode != 0
    assert time.monotonic() - killed_at < 30
    assert not (out / "model.safetensors.index.json").exists()
    summary = resume(fsdp_ckpts["fsdp2_llama_w4"], out, "--checksum")
    assert summary["resumed_files"] >= 1
    assert tree_bytes(out) == tree_bytes(clean)


def rank_pid(torchrun_pid: int, rank: int) -> int:
    """The worker process of `rank` under a torchrun launcher (its environment says RANK=rank)."""
    for child in Path(f"/proc/{torchrun_pid}/task/{torchrun_pid}/children").read_text().split():
        environ = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
        if f"RANK={rank}".encode() in environ:
            return int(child)
    raise AssertionError(f"no worker with RANK={rank} under torchrun {torchrun_pid}")


def test_write_error_names_the_file_and_leaves_nothing(fsdp_ckpts, tmp_path):
    """A file-size limit makes writes fail as a full disk would (EFBIG instead of ENOSPC)."""
    import resource

    def limit() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # get EFBIG from write() instead of a signal
        resource.setrlimit(resource.RLIMIT_FSIZE, (150_000, 150_000))

    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "distmerge", "merge", "--quiet", "--input", str(fsdp_ckpts["fsdp2_llama_w4"]),
           "--output", str(out)]
    run = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, preexec_fn=limit, timeout=120)
    assert run.returncode == 1
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and "cannot write" in lines[0] and "model.safetensors" in lines[0], run.stderr
    assert sorted(p.name for p in out.iterdir()) == []  # no partial file, no index


@pytest.mark.torchrun
def test_input_truncated_during_the_merge_stops_every_rank(fsdp_ckpts, tmp_path):
    """A rank file cut short after discovery (a copy still running, a quota hit): the rank reading it fails
    while packing or copying, every rank exits with that one error, and no index is written."""
    import shutil

    ckpt = Path(shutil.copytree(fsdp_ckpts["fsdp2_llama_w4"], tmp_path / "ckpt"))
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--nnodes", "1",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "-m", "distmerge", "merge", "--quiet",
           "--input", str(ckpt), "--output", str(out), *SPLIT, "--budget", "16KB"]
    env = {**os.environ, "DISTMERGE_TEST_ROUND_DELAY": "0.3", "OMP_NUM_THREADS": "1"}
    job = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not model_files(out) and time.monotonic() < deadline and job.poll() is None:
        time.sleep(0.05)
    for r in range(4):  # whichever rank reads them, every later read comes up short
        victim = ckpt / f"model_world_size_4_rank_{r}.pt"
        os.truncate(victim, victim.stat().st_size // 2)
    _, stderr = job.communicate(timeout=120)
    assert job.returncode != 0
    errors = [line for line in stderr.splitlines() if line.startswith("distmerge: error:")]
    assert len(errors) == 1 and "truncated" in errors[0], stderr[-2000:]
    assert not (out / "model.safetensors.index.json").exists()


@pytest.mark.torchrun
def test_ctrl_c_says_how_to_finish_once(fsdp_ckpts, clean, tmp_path):
    """Ctrl-C on torchrun (SIGINT; torchrun passes SIGTERM on to its workers): one line that names --resume,
    no abort, no index; --resume then finishes byte-identical. Made to fail first: workers died silently."""
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--nnodes", "1",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "-m", "distmerge", "merge", "--quiet",
           "--input", str(fsdp_ckpts["fsdp2_llama_w4"]), "--output", str(out), *SPLIT, "--budget", "16KB", "--checksum"]
    env = {**os.environ, "DISTMERGE_TEST_ROUND_DELAY": "0.3", "OMP_NUM_THREADS": "1"}
    job = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not model_files(out) and time.monotonic() < deadline and job.poll() is None:
        time.sleep(0.05)
    assert model_files(out), "the merge finished no file before the deadline"
    job.send_signal(signal.SIGINT)
    _, err = job.communicate(timeout=60)
    assert job.returncode != 0
    said = [line for line in err.splitlines() if line.startswith("distmerge:")]
    assert said == ["distmerge: interrupted: the files it finished are kept; run the same command with --resume "
                    "to finish"], err[-3000:]
    assert "terminate called" not in err
    assert not (out / "model.safetensors.index.json").exists()
    resume(fsdp_ckpts["fsdp2_llama_w4"], out, "--checksum")
    assert tree_bytes(out) == tree_bytes(clean)

"""Never lose work: a killed or interrupted merge leaves no index, and --resume finishes it, keeping the
files that were complete and producing the same bytes as an uninterrupted run."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from distmerge.front.cli import main as distmerge_main
from distmerge.report import human_bytes
from tests.conftest import REPO, free_port, merge_inproc, torchrun, tree_bytes

SPLIT = ["--max-shard-size", "60KB"]


@pytest.fixture(scope="module")
def clean(fsdp_ckpts, tmp_path_factory) -> Path:
    """The uninterrupted result every resumed run must equal, byte for byte."""
    out = tmp_path_factory.mktemp("clean") / "out"
    assert merge_inproc("--input", fsdp_ckpts["fsdp2_llama_w4"], "--output", out, *SPLIT, "--checksum") == 0
    return out


@pytest.fixture(scope="module")
def clean_plain(fsdp_ckpts, tmp_path_factory) -> Path:
    """The same merge without --checksum: no sha256 anywhere."""
    out = tmp_path_factory.mktemp("plain") / "out"
    assert merge_inproc("--input", fsdp_ckpts["fsdp2_llama_w4"], "--output", out, *SPLIT) == 0
    return out


def stamps(paths) -> dict[str, tuple[int, int]]:
    """(inode, mtime_ns) of each file, as the file system tells them: a file written again, even with the
    same bytes, gets a new inode (written under a temporary name, then renamed over the old one)."""
    return {str(p): (p.stat().st_ino, p.stat().st_mtime_ns) for p in paths}


def every_file(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file())


def backdate(paths, seconds: int = 3600) -> None:
    """An hour older: a file written again in this test cannot share its mtime_ns."""
    for p in paths:
        st = p.stat()
        os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns - seconds * 10**9))


def model_files(out: Path) -> list[Path]:
    return sorted(out.glob("model-*-of-*.safetensors"))


def recorded_files(out: Path) -> list[Path]:
    """Finished files with their completion record: what an interrupted run leaves for --resume to keep (a file
    renamed into place whose record the interrupt beat is merged again)."""
    return [p for p in model_files(out) if (out / ".distmerge" / f"{p.name}.json").is_file()]


def interrupted_copy(clean: Path, dest: Path, lose: int) -> Path:
    """What a killed run leaves: some files finished (with records), one half-written, no index."""
    dest.mkdir()
    for path in model_files(clean)[lose:]:
        (dest / path.name).write_bytes(path.read_bytes())
    (dest / ".distmerge").mkdir()
    for path in model_files(clean)[lose:]:
        record = clean / ".distmerge" / f"{path.name}.json"
        (dest / ".distmerge" / record.name).write_bytes(record.read_bytes())
    (dest / ".distmerge" / "run.json").write_bytes((clean / ".distmerge" / "run.json").read_bytes())
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
    """One rank file's mtime moves: every file is redone and the line names that file. Made to fail first (the
    summary had no such line) and by comparing no input files in resume.differences."""
    ckpt = tmp_path / "ckpt"
    ckpt.symlink_to(fsdp_ckpts["fsdp2_llama_w4"])
    out = interrupted_copy(clean, tmp_path / "out", lose=1)
    rank_file = fsdp_ckpts["fsdp2_llama_w4"] / "model_world_size_4_rank_0.pt"
    stat = rank_file.stat()
    os.utime(rank_file, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))
    try:
        summary = resume(ckpt, out, "--checksum")
    finally:
        os.utime(rank_file, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert summary["resumed_files"] == 0
    assert summary["resume"] == ("resume: input model_world_size_4_rank_0.pt (changed) differs from the interrupted "
                                 f"run: redoing all {len(model_files(clean))} file(s)")
    assert tree_bytes(out) == tree_bytes(clean)


@pytest.mark.parametrize("change, what", [
    (["--max-shard-size", "120KB"], "--max-shard-size (60000 -> 120000) differs"),
    (["--dtype", "bf16"], "--dtype (keep -> bfloat16) differs"),
    (["--dtype", "bf16", "--max-shard-size", "120KB"], "--dtype (keep -> bfloat16), --max-shard-size (60000 -> "
                                                       "120000) differ"),
], ids=["shard-size", "dtype", "both"])
def test_resume_with_other_options_names_them_and_redoes_every_file(fsdp_ckpts, clean, tmp_path, change, what):
    """The run.json the interrupted run left records its options by flag: the line names each one that differs.
    Made to fail first: the only word was the note "--resume kept 0 finished file(s)"."""
    out = interrupted_copy(clean, tmp_path / "out", lose=1)
    summary = resume(fsdp_ckpts["fsdp2_llama_w4"], out, "--checksum", *change)
    total = len(summary["files"])
    assert summary["resume"] == f"resume: {what} from the interrupted run: redoing all {total} file(s)"
    assert summary["resumed_files"] == 0 and summary["bytes_written"] == summary["total_bytes"]
    assert [p.name for p in model_files(out)] == [f["name"] for f in summary["files"]]
    records = sorted(p.name for p in (out / ".distmerge").iterdir())  # none left of the earlier split
    assert records == sorted([f"{f['name']}.json" for f in summary["files"]] + ["run.json"])


def test_kept_files_are_untouched_and_redone_files_are_new(fsdp_ckpts, clean, tmp_path):
    """#16: what --resume keeps, proven by the file system rather than by distmerge's own count: every kept file
    keeps its inode and mtime_ns, the file whose bytes changed gets new ones. Made to fail by making
    resume.check_own_files find nothing (a run that redoes every file, same bytes): the kept files got new
    inodes, and this test failed while the byte comparison below still passed."""
    out = interrupted_copy(clean, tmp_path / "out", lose=2)
    victim = model_files(out)[-1]
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF  # same size, same header: only the checksum can tell
    victim.write_bytes(bytes(data))
    backdate(model_files(out))
    before = stamps(model_files(out))
    summary = resume(fsdp_ckpts["fsdp2_llama_w4"], out, "--checksum")
    after = stamps(model_files(out))
    untouched = [name for name in before if after[name] == before[name]]
    assert untouched == [str(p) for p in model_files(out)[2:-1]]
    (ino, mtime), (new_ino, new_mtime) = before[str(victim)], after[str(victim)]
    assert new_ino != ino and new_mtime > mtime
    assert summary["resumed_files"] == len(untouched)
    assert summary["resume"] == (f"resume: kept {len(untouched)} of {len(after)} file(s) the interrupted run wrote, "
                                 "redoing 3 (1 of them changed or gone since written)")
    assert tree_bytes(out) == tree_bytes(clean)


@pytest.mark.parametrize("checksum", [["--checksum"], []], ids=["checksum", "no-checksum"])
def test_resume_of_a_finished_merge_says_so_and_rewrites_nothing(fsdp_ckpts, clean, tmp_path, checksum):
    """Every file (model files, index, config.json, manifest, records) keeps its inode and mtime_ns. Without
    --checksum the recorded sha256 are still checked, and the manifest keeps them: nothing is rewritten.
    Made to fail first: the index was removed at the start, then config, manifest and index written again."""
    out = tmp_path / "out"
    shutil.copytree(clean, out)
    before = stamps(every_file(out))
    summary = resume(fsdp_ckpts["fsdp2_llama_w4"], out, *checksum)
    assert stamps(every_file(out)) == before
    assert summary["resume"] == (f"resume: {out} is already complete (same input and options, all "
                                 f"{len(model_files(clean))} file(s) checked): nothing to do, nothing rewritten")
    assert summary["resumed_files"] == len(model_files(clean)) and summary["bytes_written"] == 0


def test_checksum_on_a_finished_merge_without_them_hashes_the_kept_files(fsdp_ckpts, clean, clean_plain, tmp_path):
    """Not complete for a command that asks for checksums: the model files stay as they are (inode, mtime_ns),
    the records and manifest get every file's sha256, and the output is that of a clean --checksum run. Made to
    fail first: the kept files' manifest entries had no sha256 (and config, index were written again)."""
    out = tmp_path / "out"
    shutil.copytree(clean_plain, out)
    before = stamps(model_files(out))
    summary = resume(fsdp_ckpts["fsdp2_llama_w4"], out, "--checksum")
    assert stamps(model_files(out)) == before
    assert tree_bytes(out) == tree_bytes(clean)
    n = len(before)
    assert summary["resume"] == (f"resume: kept {n} of {n} file(s) the finished run wrote, redoing 0; hashed {n} "
                                 "kept file(s) for --checksum")


@pytest.mark.parametrize("written_with, resumed_with", [([], ["--checksum"]), (["--checksum"], [])],
                         ids=["hashes-added", "hashes-dropped"])
def test_manifest_has_checksums_for_every_file_or_none(fsdp_ckpts, clean, clean_plain, tmp_path, written_with,
                                                       resumed_with):
    """A resumed run's manifest and records follow its own --checksum, whatever the interrupted run used: the
    output is byte-identical to an uninterrupted run of the resuming command. Made to fail first: kept files
    kept their records as written, so the manifest mixed entries with and without sha256."""
    out = interrupted_copy(clean if written_with else clean_plain, tmp_path / "out", lose=2)
    resume(fsdp_ckpts["fsdp2_llama_w4"], out, *resumed_with)
    entries = json.loads((out / "distmerge.manifest.json").read_text())["files"]
    assert {"sha256" in e for e in entries} == {bool(resumed_with)}
    assert tree_bytes(out) == tree_bytes(clean if resumed_with else clean_plain)


def test_progress_and_summary_count_only_what_this_run_wrote(fsdp_ckpts, clean, tmp_path, capsys):
    """The bar, the per-rank table, the summary line and the JSON count the bytes this run wrote; the files it
    kept are named as kept. Made to fail first: the kept files' bytes were counted as written in no time
    ("5.63 TB/s"), and `bytes_written` per rank included them."""
    out = interrupted_copy(clean, tmp_path / "out", lose=2)
    summary_path = tmp_path / "summary.json"
    args = ["merge", "--input", str(fsdp_ckpts["fsdp2_llama_w4"]), "--output", str(out), *SPLIT, "--resume",
            "--checksum", "--json-summary", str(summary_path)]
    assert distmerge_main(args) == 0
    said = capsys.readouterr().out.splitlines()
    summary = json.loads(summary_path.read_text())
    total = len(summary["files"])
    lost = sum(f["bytes"] for f in summary["files"][:2])
    assert sum(r["bytes_written"] for r in summary["ranks"]) == lost
    assert sum(r["files_written"] for r in summary["ranks"]) == 2
    assert summary["bytes_written"] == lost < summary["total_bytes"]
    assert summary["gb_per_s"] == pytest.approx(lost / summary["seconds"] / 1e9)
    assert [line for line in said if line.startswith("resume:")] == [summary["resume"]]
    assert f"merging {human_bytes(lost)} into 2 of {total} file(s) ({total - 2} kept)" in said
    assert f"100.0%  {human_bytes(lost)} of {human_bytes(lost)}" in [line for line in said if "%" in line][-1]
    last = said[-1]
    assert f"({total - 2} file(s) kept from an earlier run, {human_bytes(lost)} written)" in last, last


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
    while not recorded_files(out) and time.monotonic() < deadline and job.poll() is None:
        time.sleep(0.05)
    assert recorded_files(out), "the merge finished no file before the deadline"
    victim = rank_pid(job.pid, rank=1)
    os.kill(victim, signal.SIGKILL)
    killed_at = time.monotonic()
    job.communicate(timeout=60)
    assert job.returncode != 0
    assert time.monotonic() - killed_at < 30
    assert not (out / "model.safetensors.index.json").exists()
    recorded = recorded_files(out)
    backdate(recorded)
    before = stamps(recorded)
    summary = resume(fsdp_ckpts["fsdp2_llama_w4"], out, "--checksum")
    assert stamps(recorded) == before  # the finished files were kept, not written again
    assert summary["resumed_files"] == len(recorded) >= 1
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
    assert not out.exists()  # no partial file, no index, not even the folder the merge made


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
    while not recorded_files(out) and time.monotonic() < deadline and job.poll() is None:
        time.sleep(0.05)
    assert recorded_files(out), "the merge finished no file before the deadline"
    job.send_signal(signal.SIGINT)
    _, err = job.communicate(timeout=60)
    assert job.returncode != 0
    said = [line for line in err.splitlines() if line.startswith("distmerge:")]
    finished = len(recorded_files(out))  # counted by the file system, not by distmerge
    assert said == [f"distmerge: interrupted: {finished} of 10 output file(s) are finished and kept; run the same "
                    "command with --resume to finish"], err[-3000:]
    assert "terminate called" not in err
    assert not (out / "model.safetensors.index.json").exists()
    assert not (out / ".distmerge.lock").exists()  # released (tests/test_output_lock.py)
    before = stamps(model_files(out))
    summary_path = tmp_path / "summary.json"
    run = torchrun(2, "merge", "--quiet", "--input", fsdp_ckpts["fsdp2_llama_w4"], "--output", out, *SPLIT,
                   "--resume", "--checksum", "--json-summary", summary_path)  # each rank checks the files it owns
    assert run.returncode == 0, run.stderr[-3000:]
    kept = [name for name, stamp in stamps(model_files(out)).items() if before.get(name) == stamp]
    assert json.loads(summary_path.read_text())["resumed_files"] == len(kept) >= 1
    assert tree_bytes(out) == tree_bytes(clean)

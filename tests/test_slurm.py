"""slurm/merge.sbatch as real SLURM jobs, on a local cluster that slurm/ci/setup.sh brings up.

The cluster is real (munged, slurmctld and two slurmd on this machine: nodes `<hostname>` and
`localhost`), so these tests submit with `sbatch --wait` exactly as a user would, and check each
job's outcome from its own log and from slurmctld, not only from sbatch's exit code: `sbatch --wait`
exits 0 for a job cancelled before it started.

Needs root (setup.sh installs the Debian packages with apt-get and starts daemons), so they run in CI
(CI=true) or when asked (DISTMERGE_SLURM_TESTS=1), never unasked on a developer's machine; skipped with
the reason otherwise. In CI a reason to skip is a failure: CI must prove what the README claims.
Everything is stopped again at the end of the session, unless the cluster was already up before it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import REPO, assert_exact, expected_tensors, load_merged

pytestmark = pytest.mark.slurm

SETUP = REPO / "slurm" / "ci" / "setup.sh"
TEARDOWN = REPO / "slurm" / "ci" / "teardown.sh"
SBATCH = REPO / "slurm" / "merge.sbatch"
WATCH_SBATCH = REPO / "slurm" / "watch.sbatch"
CASE = "fsdp2_llama_w4"
SLURM_BINARIES = ("slurmctld", "slurmd", "sbatch", "scontrol", "munged")


def _cannot_run_cluster() -> str | None:
    if os.environ.get("CI") != "true" and os.environ.get("DISTMERGE_SLURM_TESTS") != "1":
        return ("installs and starts a local SLURM cluster as root: runs in CI, or here with "
                "DISTMERGE_SLURM_TESTS=1 bash launch/test.sh")
    if os.geteuid() != 0:
        return "needs root: slurm/ci/setup.sh installs slurm and munge and starts their daemons"
    if not all(shutil.which(b) for b in SLURM_BINARIES) and not shutil.which("apt-get"):
        return "slurm is not installed and apt-get is not available to install it"
    return None


@pytest.fixture(scope="session")
def _cluster_setup(tmp_path_factory):
    """slurm/ci/setup.sh, started in the background: the cluster comes up while `ckpt` is built.

    Two nodes on this machine (two slurmd), so that multi-node jobs are tested too.
    """
    reason = _cannot_run_cluster()
    if reason and os.environ.get("CI") == "true":
        pytest.fail(f"CI must run the SLURM tests, but: {reason}")
    if reason:
        pytest.skip(reason)
    log_path = tmp_path_factory.mktemp("slurm-setup") / "setup.log"
    env = {**os.environ, "DISTMERGE_SLURM_NODES": "2"}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(["bash", str(SETUP)], env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
    yield proc, log_path
    if proc.poll() is None:  # the session ended before anyone waited for it
        proc.kill()
        proc.wait()
    # A cluster that was already up before the session (started by hand) stays up.
    if "reusing it" not in log_path.read_text():
        subprocess.run(["bash", str(TEARDOWN)], capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="session")
def slurm_cluster(_cluster_setup):
    proc, log_path = _cluster_setup
    try:
        # A fresh machine installs the packages first: allow for a slow mirror.
        rc = proc.wait(timeout=900)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        rc = "killed after 900 s"
    if rc != 0:
        pytest.fail(f"slurm/ci/setup.sh failed (exit {rc}):\n{log_path.read_text()}")


@pytest.fixture(scope="session")
def ckpt(request, tmp_path_factory, _cluster_setup) -> Path:
    """A real 4-rank FSDP2 checkpoint (asks for `_cluster_setup` only to build it while SLURM starts).

    Taken from the shared `fsdp_ckpts` when other tests of this session need those anyway; run alone,
    this file builds only the one case it uses (one torchrun job instead of nine cases).
    """
    shared = any(
        "fsdp_ckpts" in getattr(item, "fixturenames", ()) and item.get_closest_marker("slurm") is None
        for item in request.session.items
    )
    if shared:
        return request.getfixturevalue("fsdp_ckpts")[CASE]
    from tests.fixtures.build import FSDP_SCRIPT, build_cases
    from tests.fixtures.make_fsdp import CASES

    built = build_cases(FSDP_SCRIPT, tmp_path_factory.mktemp("fsdp"), {CASE: CASES[CASE].world_size}, "FSDP",
                        marker="{case}/fsdp_config.json")
    return built[CASE]


@dataclass
class Job:
    sbatch_rc: int
    job_id: str
    record: dict[str, str]  # `scontrol show job` fields; empty once slurmctld has forgotten the job
    log: str  # the job's stdout+stderr file

    def describe(self) -> str:
        return f"job {self.job_id}: sbatch exit {self.sbatch_rc}, record {self.record}\n--- job log ---\n{self.log}"


def job_record(job_id: str) -> dict[str, str]:
    """slurmctld's record of a finished job; {} if it is already forgotten (MinJobAge=5 keeps it ~5 s).

    sbatch --wait returns as soon as the job is finished, possibly while slurmd is still cleaning up
    (JobState=COMPLETING, ExitCode already final): wait a moment for the final state.
    """
    record: dict[str, str] = {}
    for _ in range(30):
        show = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True)
        if show.returncode != 0:
            break
        record = dict(f.split("=", 1) for f in show.stdout.split() if "=" in f)
        if record.get("JobState") != "COMPLETING":
            break
        time.sleep(0.1)
    return record


def submit(tmp_path: Path, *args: str, sbatch_opts: tuple[str, ...] = (), script: Path = SBATCH, wait: bool = True,
           **env: str) -> Job:
    """`sbatch --wait slurm/merge.sbatch ARGS` (or `script`) with DISTMERGE_* settings from **env, as root; without
    `wait`, the job id alone (its record and log empty: it runs on)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "DISTMERGE_"))}
    # The job does not inherit a PATH that finds this venv (it runs as root from slurmd): name it.
    base.update(PYTHON=sys.executable, PYTHONWARNINGS="ignore", **env)
    log_pattern = tmp_path / "job-%j.out"
    cmd = ["sbatch", *(["--wait"] if wait else []), "--parsable", f"--output={log_pattern}", "--time=5", *sbatch_opts,
           str(script), *args]
    proc = subprocess.run(cmd, env=base, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    job_id = proc.stdout.strip().split(";")[0]
    assert job_id.isdigit(), f"sbatch gave no job id: {proc.stdout!r} {proc.stderr!r}"
    if not wait:
        return Job(proc.returncode, job_id, {}, "")
    record = job_record(job_id)
    log_file = tmp_path / f"job-{job_id}.out"
    log = log_file.read_text() if log_file.is_file() else "(no log: the job never started)"
    return Job(proc.returncode, job_id, record, log)


def assert_succeeded(job: Job) -> None:
    """It ran to the end and every step succeeded: sbatch's exit 0 alone would also cover a cancelled job."""
    assert job.sbatch_rc == 0, job.describe()
    assert f"merge.sbatch: job {job.job_id} on " in job.log, job.describe()
    assert job.log.rstrip().splitlines()[-1] == "merge.sbatch: exit status 0", job.describe()
    if job.record:
        assert job.record["ExitCode"] == "0:0", job.describe()
        assert job.record["JobState"] in ("COMPLETED", "COMPLETING"), job.describe()


def assert_failed(job: Job, status: int) -> str:
    """The job failed with `status`; its log ends with the exit status, then the error line that says why
    (returned)."""
    assert job.sbatch_rc == status, job.describe()
    *_, said, why = job.log.rstrip().splitlines()
    assert said == f"merge.sbatch: exit status {status}", job.describe()
    assert why.startswith(("distmerge: error: ", "merge.sbatch: error: ")), job.describe()
    if job.record:
        assert job.record["ExitCode"] == f"{status}:0", job.describe()
        assert job.record["JobState"] in ("FAILED", "COMPLETING"), job.describe()
    return why


def test_one_node_two_processes(ckpt, slurm_cluster, tmp_path):
    out, summary = tmp_path / "merged", tmp_path / "summary.json"
    job = submit(tmp_path, sbatch_opts=("--nodes=1", "--cpus-per-task=2"), DISTMERGE_INPUT=str(ckpt),
                 DISTMERGE_OUTPUT=str(out), DISTMERGE_NPROC="2", DISTMERGE_ARGS=f"--json-summary {summary}")
    assert_succeeded(job)
    assert "on 1 node(s)" in job.log, job.describe()
    stats = json.loads(summary.read_text())
    assert (stats["processes"], stats["input_world_size"]) == (2, 4)
    assert_exact(load_merged(out), expected_tensors(ckpt))


def test_two_nodes_rendezvous(ckpt, slurm_cluster, tmp_path):
    """One torchrun per node, one process each: a world of 2 exists only if both met at the rendezvous."""
    out, summary = tmp_path / "merged", tmp_path / "summary.json"
    job = submit(tmp_path, "--input", str(ckpt), "--output", str(out), "--json-summary", str(summary), "--quiet",
                 sbatch_opts=("--nodes=2",), DISTMERGE_NPROC="1")
    assert_succeeded(job)
    assert "on 2 node(s)" in job.log, job.describe()
    assert json.loads(summary.read_text())["processes"] == 2
    assert_exact(load_merged(out), expected_tensors(ckpt))


def test_bad_input_fails_the_job(slurm_cluster, tmp_path):
    out = tmp_path / "merged"
    job = submit(tmp_path, sbatch_opts=("--nodes=1",), DISTMERGE_INPUT=str(tmp_path / "no-such-checkpoint"),
                 DISTMERGE_OUTPUT=str(out), DISTMERGE_NPROC="2")
    last = assert_failed(job, 1)
    errors = [line for line in job.log.splitlines() if line.startswith("distmerge: error: ")]
    # Printed once by rank 0, repeated by launch/merge.sh after torchrun's summary and by merge.sbatch last.
    assert len(set(errors)) == 1 and "no-such-checkpoint" in errors[0] and last == errors[0], job.describe()
    assert not (out / "model.safetensors.index.json").exists()


def test_arguments_win_over_the_environment(ckpt, slurm_cluster, tmp_path):
    """DISTMERGE_INPUT and --input after the script name both given: the arguments' is merged. Naming the same
    checkpoint, as a job resubmitted with its settings in both places does, nothing is said; naming two, the log
    says which was used. Seen failing with the environment's --input passed before the arguments' (argparse kept
    the last occurrence, until --input repeated for averaging): "2 inputs given (--input, repeated): pass
    --average"."""
    same = submit(tmp_path, "--input", str(ckpt), "--output", str(tmp_path / "same"), "--quiet",
                  sbatch_opts=("--nodes=1",), DISTMERGE_INPUT=str(ckpt), DISTMERGE_NPROC="1")
    assert_succeeded(same)
    assert "is used, not" not in same.log, same.describe()
    assert_exact(load_merged(tmp_path / "same"), expected_tensors(ckpt))
    elsewhere, out = tmp_path / "an-older-checkpoint", tmp_path / "differ"
    differ = submit(tmp_path, "--input", str(ckpt), "--quiet", sbatch_opts=("--nodes=1",),
                    DISTMERGE_INPUT=str(elsewhere), DISTMERGE_OUTPUT=str(out), DISTMERGE_NPROC="1")
    assert_succeeded(differ)
    assert f"merge.sbatch: --input {ckpt} (from the arguments) is used, not DISTMERGE_INPUT={elsewhere}\n" in \
        differ.log, differ.describe()
    assert_exact(load_merged(out), expected_tensors(ckpt))


def test_missing_input_is_refused_before_any_step(slurm_cluster, tmp_path):
    out = tmp_path / "merged"
    job = submit(tmp_path, DISTMERGE_OUTPUT=str(out))
    last = assert_failed(job, 2)
    assert last.startswith("merge.sbatch: error: no checkpoint to merge: set DISTMERGE_INPUT or pass --input")
    assert "srun" not in job.log and not out.exists()


# -- slurm/watch.sbatch: distmerge watch as a job after training (--once) and beside it ---------------------------
def verl_run(ckpt: Path, root: Path) -> Path:
    """A run folder as verl leaves it mid-training: global_step_1/actor finished (the marker names it),
    global_step_2/actor still being written."""
    run = root / "run"
    for step in (1, 2):
        shutil.copytree(ckpt, run / f"global_step_{step}" / "actor")
    (run / "latest_checkpointed_iteration.txt").write_text("1")
    return run


def assert_watch_succeeded(job: Job) -> None:
    assert job.sbatch_rc == 0, job.describe()
    assert job.log.rstrip().splitlines()[-1] == "watch.sbatch: exit status 0", job.describe()


def test_watch_once_after_training(ckpt, slurm_cluster, tmp_path):
    run, out = verl_run(ckpt, tmp_path), tmp_path / "merged"
    job = submit(tmp_path, "--once", script=WATCH_SBATCH, sbatch_opts=("--nodes=1", "--cpus-per-task=2"),
                 DISTMERGE_INPUT=str(run), DISTMERGE_OUTPUT=str(out), DISTMERGE_NPROC="2")
    assert_watch_succeeded(job)
    assert "watch.sbatch: distmerge watch --input" in job.log, job.describe()
    assert_exact(load_merged(out / "global_step_1" / "actor"), expected_tensors(ckpt))
    assert re.search(r"global_step_2/actor\s+│ still being written", job.log), job.describe()
    assert not (out / "global_step_2").exists()


def test_watcher_beside_training_then_the_last_pass(ckpt, slurm_cluster, tmp_path):
    """slurm/watch_example.sh's two jobs: a watcher that runs until cancelled, and a last pass (--once) that cancels
    it first (DISTMERGE_STOP_JOB) and merges what is left."""
    run, out = verl_run(ckpt, tmp_path), tmp_path / "merged"
    env = dict(DISTMERGE_INPUT=str(run), DISTMERGE_OUTPUT=str(out), DISTMERGE_NPROC="1")
    watcher = submit(tmp_path, "--poll", "1", script=WATCH_SBATCH, wait=False, sbatch_opts=("--nodes=1",), **env)
    first = out / "global_step_1" / "actor" / "model.safetensors.index.json"
    end = time.monotonic() + 240
    while not first.exists():
        assert time.monotonic() < end, f"the watcher merged nothing: {job_record(watcher.job_id)}"
        time.sleep(1)
    (run / "latest_checkpointed_iteration.txt").write_text("2")  # training saved its last step, and ended
    last = submit(tmp_path, "--once", script=WATCH_SBATCH, sbatch_opts=("--nodes=1",),
                  DISTMERGE_STOP_JOB=watcher.job_id, **env)
    assert_watch_succeeded(last)
    assert f"watch.sbatch: stopping job {watcher.job_id}" in last.log, last.describe()
    state = job_record(watcher.job_id).get("JobState")
    assert state in (None, "CANCELLED"), state
    for step in (1, 2):
        assert_exact(load_merged(out / f"global_step_{step}" / "actor"), expected_tensors(ckpt))

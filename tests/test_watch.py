"""`distmerge watch` as users run it (issue #36): a real FSDP2 training job (tests/jobs/train_verl.py, torchrun, 2
processes, gloo) saving verl's layout every 2 steps, with a watcher under torchrun beside it; each step's output equal
(torch.equal) to the state dict the job gathered at that step. Then, on that run: a second pass touches nothing, a
half-written step waits and is named, an interrupted merge is resumed, two racing watchers merge each step once, and
the hub gets a branch per step; and each trainer's marker on copies of the real fixtures.
"""

from __future__ import annotations

import _thread
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import distmerge
from distmerge.front.cli import main as distmerge_main
from distmerge.watcher import choose, markers
from distmerge.watcher.outcome import DONE, ELSEWHERE, MERGED, RESUMED, TOO_FEW, WAITING
from distmerge.watcher.steps import Step
from tests.conftest import REPO, assert_exact, free_port, load_merged, reference_dir, tree_bytes, tree_digest
from tests.helpers.verl_cli import FakeHub

TRAIN = REPO / "tests" / "jobs" / "train_verl.py"
STEPS = (2, 4, 6)
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
ROW = re.compile(r"│ (\S+)\s+│ ([^│]+?)\s+│")  # a table row: step, status


def torchrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--nnodes", "1", "--master-addr",
            "127.0.0.1", "--master-port", str(free_port()), *args]


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (torchrun's workers)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def wait_for(done, proc: subprocess.Popen, seconds: float) -> None:
    end = time.monotonic() + seconds
    while not done():
        assert proc.poll() is None, f"the watcher ended early ({proc.returncode})"
        assert time.monotonic() < end, f"not done in {seconds} s"
        time.sleep(0.2)


def rows(text: str) -> dict[str, str]:
    """Each step's status in the tables printed (the last one wins)."""
    return {m[1]: m[2] for m in ROW.finditer(text) if m[1] != "step"}


def linked(src: Path, dst: Path) -> Path:
    """A copy of a run whose files are hard links (the merge never writes its input); markers are rewritten only
    after unlinking them."""
    return Path(shutil.copytree(src, dst, copy_function=os.link))


def mark(run: Path, step: int) -> None:
    tracker = run / markers.TRACKER
    tracker.unlink(missing_ok=True)
    tracker.write_text(str(step))


def watch(*args) -> int:
    return distmerge_main(["watch", *map(str, args)])


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The run, the job's references, and the live watcher's output; the watcher's log."""
    root = tmp_path_factory.mktemp("watch")
    run, ref, out = root / "run", root / "ref", root / "out"
    run.mkdir()
    with open(root / "watcher.log", "w") as log:
        watcher = subprocess.Popen(torchrun("-m", "distmerge", "watch", "--input", str(run), "--output", str(out),
                                            "--poll", "0.3"), stdout=log, stderr=subprocess.STDOUT, env=ENV, cwd=REPO)
        try:
            job = subprocess.run(torchrun(str(TRAIN), str(run), str(ref), "6", "2", "1.0"), capture_output=True,
                                 text=True, timeout=300, env=ENV, cwd=REPO)
            assert job.returncode == 0, job.stdout[-2000:] + job.stderr[-4000:]
            log_path = root / "watcher.log"
            wait_for(lambda: rows(log_path.read_text()).get("global_step_6/actor") == MERGED, watcher, 120)
            for pid in children(watcher.pid):  # as scancel signals every process of the step
                os.kill(pid, signal.SIGTERM)
            code = watcher.wait(timeout=60)
        finally:
            if watcher.poll() is None:
                watcher.kill()
    return run, ref, out, code, (root / "watcher.log").read_text()


def test_live_watcher_beside_training_merges_each_step_exactly_once_finished(trained):
    """Every step the job saved is merged, equal to what the job gathered at that step, never before the job's
    marker named it; the torchrun watcher stops on SIGTERM, every process exiting 0 (so torchrun does)."""
    run, ref, out, code, log = trained
    assert code == 0, log[-3000:]
    assert "stopped by a signal" in log, log[-3000:]
    marked = {m["step"]: m["time"] for m in map(json.loads, (ref / "marks.jsonl").read_text().splitlines())}
    for step in STEPS:
        merged = out / f"global_step_{step}" / "actor"
        assert_exact(load_merged(merged), load_file(ref / f"global_step_{step}.safetensors"))
        assert (merged / "model.safetensors.index.json").stat().st_mtime >= marked[step], step
    assert rows(log).keys() == {f"global_step_{s}/actor" for s in STEPS} and set(rows(log).values()) == {MERGED}
    trained_twice = [load_file(ref / f"global_step_{s}.safetensors")["lm_head.weight"] for s in STEPS[:2]]
    assert not torch.equal(*trained_twice)  # the steps differ: each output is its own step's


def test_a_second_pass_touches_nothing(trained, capsys):
    run, _, out, _, _ = trained
    before = tree_digest(out)
    assert watch("--input", run, "--output", out, "--once") == 0
    assert tree_digest(out) == before
    said = capsys.readouterr().out
    assert rows(said) == {f"global_step_{s}/actor": DONE for s in STEPS}
    assert "0 step(s) merged in 1 pass(es)" in said


def test_each_step_starts_with_no_walk_of_an_input_kept(trained, tmp_path, monkeypatch):
    """A watch's step walks its input in a session of its own (input/source.py's fresh_session, entered by
    watcher/step.py): no step starts holding an earlier step's walk, nor one this process made before the watch.
    Seen failing with the step's fresh_session removed: [0, 1, 1]."""
    from distmerge.input import source as input_source
    from distmerge.watcher import step as watch_step

    run = trained[0]
    merge, held = watch_step.engine_merge, []

    def merge_counting_walks(opts, comm, progress):
        held.append(len(input_source.session().sources))
        return merge(opts, comm, progress)

    monkeypatch.setattr(watch_step, "engine_merge", merge_counting_walks)
    assert watch("--input", run, "--output", tmp_path / "out", "--once") == 0
    assert held == [0] * len(STEPS)


def test_a_half_written_step_waits_then_merges_and_an_interrupted_one_is_resumed(trained, tmp_path, capsys):
    run, _, out, _, _ = trained
    half = linked(run, tmp_path / "run")
    mark(half, 4)  # step 6's files are there, its marker not yet
    new = tmp_path / "out"
    assert watch("--input", half, "--output", new, "--once") == 0
    said = capsys.readouterr().out
    assert rows(said) == {"global_step_2/actor": MERGED, "global_step_4/actor": MERGED,
                          "global_step_6/actor": WAITING}
    assert re.search(r"│ global_step_6/actor\s+│ still being written", said)
    assert not (new / "global_step_6").exists()
    mark(half, 6)
    (new / "global_step_2" / "actor" / "model.safetensors.index.json").unlink()  # an interrupted merge
    result = distmerge.watch(half, new, once=True)
    assert {o.name: o.status for o in result.outcomes} == {"global_step_2/actor": RESUMED,
                                                            "global_step_4/actor": DONE, "global_step_6/actor": MERGED}
    for step in STEPS:
        assert tree_bytes(new / f"global_step_{step}" / "actor") == tree_bytes(out / f"global_step_{step}" / "actor")


def test_racing_watchers_merge_each_step_once(trained, tmp_path):
    """Two watchers started together on one run and one output: each exits 0, each step is merged by one of them
    (the other finds its lock held, or its merge done), and the output is the merge's. The pairs are compared as
    multisets: "merged earlier" sorts after "merged", so a sorted pair compared with [DONE, MERGED] failed whenever
    the second watcher found a step finished (correct; 1 run in the suite of a clean clone)."""
    run, _, out, _, _ = trained
    env = {**ENV, "DISTMERGE_TEST_ROUND_DELAY": "1.5"}  # each merge lasts long enough for the other to meet it
    cmd = [sys.executable, "-m", "distmerge", "watch", "--input", str(run), "--output", str(tmp_path / "out"),
           "--once"]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO)
             for _ in range(2)]
    said = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], said
    tables = [rows(s) for s in said]
    for step in STEPS:
        name = f"global_step_{step}/actor"
        statuses = sorted(t[name] for t in tables)
        assert statuses in (sorted([ELSEWHERE, MERGED]), sorted([DONE, MERGED])), (name, said)
        assert tree_bytes(tmp_path / "out" / name) == tree_bytes(out / name)
    assert any(ELSEWHERE in t.values() for t in tables), said  # they did meet


def test_each_trainers_marker(ds_ckpts, tt_ckpts, megatron_ckpts, dcp_ckpts, tmp_path, capsys):
    """The real saves of each trainer, in one run folder, with a later step of each half written: DeepSpeed's
    `latest` naming the earlier tag, an HF Trainer checkpoint without trainer_state.json, a torchtitan step and a DCP
    folder without .metadata, Megatron-LM's latest_checkpointed_iteration.txt naming the earlier iteration."""
    run = tmp_path / "run"
    linked(ds_ckpts["ds_z2_fp32_w2"], run / "ds")
    linked(run / "ds" / "global_step2", run / "ds" / "global_step4")
    linked(ds_ckpts["ds_trainer_z2_w2"] / "checkpoint-2", run / "hf" / "checkpoint-2")
    linked(run / "hf" / "checkpoint-2", run / "hf" / "checkpoint-4")
    (run / "hf" / "checkpoint-4" / "trainer_state.json").unlink()
    linked(tt_ckpts["tt_llama3_mha_w2"], run / "tt")
    (run / "tt" / "checkpoint" / "step-2" / ".metadata").unlink()
    mg = megatron_ckpts["megatron_tp2"]
    linked(mg, run / "mg")
    linked(mg / "iter_0000001", run / "mg" / "iter_0000002")
    linked(reference_dir(mg) / "huggingface", run / "mg" / "huggingface")  # Megatron saves no config
    linked(dcp_ckpts["dcp_llama_w2"], run / "dcp" / "a")
    linked(dcp_ckpts["dcp_llama_w2"], run / "dcp" / "b")
    (run / "dcp" / "b" / ".metadata").unlink()
    result = distmerge.watch(run, tmp_path / "out", once=True)
    assert {o.name: o.status for o in result.outcomes} == {
        "ds/global_step2": MERGED, "ds/global_step4": WAITING, "hf/checkpoint-2": MERGED, "hf/checkpoint-4": WAITING,
        "tt/checkpoint/step-1": MERGED, "tt/checkpoint/step-2": WAITING, "mg/iter_0000001": MERGED,
        "mg/iter_0000002": WAITING, "dcp/a": MERGED, "dcp/b": WAITING}
    assert distmerge_main(["merge", "-q", "--input", str(ds_ckpts["ds_trainer_z2_w2"] / "checkpoint-2"), "--output",
                           str(tmp_path / "plain")]) == 0
    assert tree_bytes(tmp_path / "out" / "hf" / "checkpoint-2") == tree_bytes(tmp_path / "plain")


# -- the parts, alone -------------------------------------------------------------------------------------------
def test_beside_markers_name_the_last_finished_step():
    verl, megatron, deepspeed = markers.MARKERS[:3]
    assert markers.finished(verl, Path("global_step_300"), [], "300\n")
    assert markers.finished(verl, Path("global_step_200"), [], "300")
    assert not markers.finished(verl, Path("global_step_400"), [], "300")
    assert not markers.finished(verl, Path("global_step_100"), [], None)  # no marker yet: the first save
    assert markers.finished(megatron, Path("iter_0000100"), [], "100")
    assert markers.finished(megatron, Path("release"), [], "release")
    assert not markers.finished(megatron, Path("iter_0000200"), [], "100")
    assert markers.finished(deepspeed, Path("global_step8"), [], "global_step8")
    assert not markers.finished(deepspeed, Path("global_step9"), [], "global_step8")
    assert markers.claiming(Path("x"), ["__0_0.distcp"]).trainer == "DCP"
    assert markers.claiming(Path("global_step_3"), []).trainer == "verl"


def test_steps_choose():
    found = [Step(rel=f"s{n}", number=n, trainer="verl", finished=n <= 30) for n in (10, 20, 30, 40)]
    found.append(Step(rel="plain", number=None, trainer="DCP", finished=True))

    def names(text: str) -> list[str]:
        return [s.rel for s in choose.chosen(choose.parse_steps(text), found)]

    assert names("all") == ["s10", "s20", "s30", "s40", "plain"]
    assert names("latest") == ["s30", "s40"]  # the last finished, and the one being written after it
    assert names("every:20") == ["s20", "s40"]
    assert names("10,30") == ["s10", "s30"]
    for bad in ("every:0", "some", "1,x", ""):
        with pytest.raises(Exception, match="not a choice of steps"):
            choose.parse_steps(bad)


def test_bad_places_are_refused_before_anything(tmp_path, capsys):
    assert watch("--input", tmp_path / "nothing", "--output", tmp_path / "out", "--once") == 1
    assert "is not a folder" in capsys.readouterr().err
    assert watch("--input", tmp_path, "--output", tmp_path, "--once") == 1
    assert "is the run folder" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


class BranchingHub(FakeHub):
    """The fake hub of test_verl_cli, which also makes branches (HfApi.create_branch)."""

    def do_POST(self):  # noqa: N802
        if "/branch/" not in self.path:
            return super().do_POST()
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.requests.append(("POST", self.path, b""))
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")


def test_each_step_goes_to_its_own_hub_branch_once(trained, tmp_path, monkeypatch, capsys):
    import http.server
    import threading

    run, _, out, _, _ = trained
    copy = Path(shutil.copytree(out, tmp_path / "out"))
    BranchingHub.requests = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), BranchingHub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{server.server_address[1]}")
    monkeypatch.setenv("HF_TOKEN", "hf_test")
    try:
        assert watch("--input", run, "--output", copy, "--once", "--hf_upload_path", "me/model") == 0
        sent = list(BranchingHub.requests)
        assert watch("--input", run, "--output", copy, "--once", "--hf_upload_path", "me/model") == 0
        assert BranchingHub.requests == sent  # each step is uploaded once
    finally:
        server.shutdown()
        server.server_close()
    branches = [p.rsplit("/", 1)[1] for m, p, _ in sent if "/branch/" in p]
    commits = [p.rsplit("/", 1)[1] for m, p, _ in sent if "/commit/" in p]
    assert branches == commits == [f"global_step_{s}-actor" for s in STEPS]
    for step in STEPS:
        record = json.loads((copy / f"global_step_{step}" / "actor" / ".distmerge" / "uploaded.json").read_text())
        assert record["repo"] == "me/model" and record["revision"] == f"global_step_{step}-actor"


def test_sigterm_in_a_merge_stops_cleanly_and_the_next_watch_resumes(trained, tmp_path):
    """A watcher stopped by SIGTERM in the middle of a step's merge exits 0, says so, leaves no lock; the next watch
    finishes that step."""
    run, _, out, _, _ = trained
    env = {**ENV, "DISTMERGE_TEST_ROUND_DELAY": "30"}  # the merge waits after its round: SIGTERM lands in it
    new = tmp_path / "out"
    watcher = subprocess.Popen([sys.executable, "-m", "distmerge", "watch", "--input", str(run), "--output", str(new),
                                "--poll", "0.5"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env=env, cwd=REPO)
    said = []
    for line in watcher.stdout:
        said.append(line)
        if line.startswith("watch: merging global_step_2/actor"):
            break
    time.sleep(1.0)
    watcher.send_signal(signal.SIGTERM)
    said.append(watcher.communicate(timeout=60)[0])
    said = "".join(said)
    assert watcher.returncode == 0, said
    assert re.search(r"│ global_step_2/actor\s+│ interrupted", said) and "stopped by a signal" in said, said
    assert not (new / "global_step_2" / "actor" / ".distmerge.lock").exists()
    result = distmerge.watch(run, new, once=True)
    assert result.last()["global_step_2/actor"].status in (RESUMED, MERGED)
    for step in STEPS:
        assert tree_bytes(new / f"global_step_{step}" / "actor") == tree_bytes(out / f"global_step_{step}" / "actor")


def test_sigterm_in_a_once_watch_exits_130_and_the_next_watch_resumes(trained, tmp_path, monkeypatch, capsys):
    """`watch --once` (a SLURM job's last pass) stopped by SIGTERM in the middle of a step's merge exits 130, not 0,
    so that a preempted job does not report success; it names the step, leaves no lock, and the next watch finishes.
    In this process: the signal is sent to it while the step's merge waits after its round. Seen failing with the
    interrupt of a --once watch returned as a stopped watch: exit 0."""
    run, _, out, _, _ = trained
    new = tmp_path / "out"
    lock = new / "global_step_2" / "actor" / ".distmerge.lock"
    monkeypatch.setenv("DISTMERGE_TEST_ROUND_DELAY", "30")  # the merge waits after its round: SIGTERM lands in it
    sent, watching = [], threading.Event()

    def terminate_mid_merge() -> None:
        end = time.monotonic() + 60
        while not lock.exists() and time.monotonic() < end and watching.is_set():
            time.sleep(0.05)
        time.sleep(0.5)
        if not lock.exists() or not watching.is_set():
            sent.append("nothing: the merge was not seen holding its lock")  # never interrupt pytest itself
        elif signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, signal.SIG_IGN, None):
            sent.append("no SIGTERM handler: Ctrl-C instead")  # the default action would end pytest
            _thread.interrupt_main()
        else:
            sent.append("SIGTERM")
            os.kill(os.getpid(), signal.SIGTERM)

    watching.set()
    threading.Thread(target=terminate_mid_merge, daemon=True).start()
    try:
        code = watch("--input", run, "--output", new, "--once")
    finally:
        watching.clear()
    said = capsys.readouterr()
    assert (sent, code) == (["SIGTERM"], 130), said.out[-2000:] + said.err[-2000:]
    assert re.search(r"^distmerge watch: interrupted in global_step_2/actor \(.+\); run it again to finish$",
                     said.err, re.MULTILINE), said.err
    assert not lock.exists()
    monkeypatch.delenv("DISTMERGE_TEST_ROUND_DELAY")
    result = distmerge.watch(run, new, once=True)
    assert result.last()["global_step_2/actor"].status in (RESUMED, MERGED)
    for step in STEPS:
        assert tree_bytes(new / f"global_step_{step}" / "actor") == tree_bytes(out / f"global_step_{step}" / "actor")


def test_a_failed_step_is_named_the_others_merge_and_it_is_retried_once_its_files_change(trained, tmp_path,
                                                                                         capsys):
    from distmerge import api, options
    from distmerge.watcher import passes

    run, _, out, _, _ = trained
    bad = linked(run, tmp_path / "run")
    rank_file = bad / "global_step_4" / "actor" / "model_world_size_2_rank_1.pt"
    data = rank_file.read_bytes()
    rank_file.unlink()
    rank_file.write_bytes(data[: len(data) // 2])  # cut short
    assert watch("--input", bad, "--output", tmp_path / "out", "--once") == 1
    said = capsys.readouterr().out
    assert rows(said)["global_step_4/actor"] == "failed"
    assert re.search(r"^global_step_4/actor: failed: .*model_world_size_2_rank_1\.pt", said, re.M), said
    assert rows(said)["global_step_2/actor"] == rows(said)["global_step_6/actor"] == MERGED
    assert "failed: global_step_4/actor" in said

    request = api.watch_request(options.with_defaults("watch", input=bad, output=tmp_path / "out"))
    memory = passes.Memory()
    failed = distmerge.watch(bad, tmp_path / "out", once=True).last()["global_step_4/actor"]
    memory.failed["global_step_4/actor"] = (steps_signature(bad / "global_step_4" / "actor"), failed)
    planned = {p.outcome.name if p.target is None else p.target.name: p for p in passes.decide(request, memory)}
    assert planned["global_step_4/actor"].outcome == failed  # the same files: not tried again
    rank_file.unlink()
    rank_file.write_bytes(data)  # the rest of it lands
    planned = {p.outcome.name if p.target is None else p.target.name: p for p in passes.decide(request, memory)}
    assert planned["global_step_4/actor"].target is not None


def steps_signature(folder: Path):
    from distmerge.watcher.steps import signature

    return signature(folder)


def test_an_output_inside_the_run_is_not_taken_for_steps(trained, tmp_path, capsys):
    run, _, out, _, _ = trained
    inner = linked(run, tmp_path / "run")
    assert watch("--input", inner, "--output", inner / "merged", "--once") == 0
    assert watch("--input", inner, "--output", inner / "merged", "--once") == 0
    said = capsys.readouterr().out.split("distmerge watch: 3 step(s) merged in 1 pass(es)")[1]
    assert rows(said) == {f"global_step_{s}/actor": DONE for s in STEPS}
    assert tree_bytes(inner / "merged" / "global_step_6" / "actor") == tree_bytes(out / "global_step_6" / "actor")


def formula(*states: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """issue #36's average, written out here: acc = 0 in float64, acc += float64(1/K) * float64(x_i) in step order,
    cast once to the tensor's dtype."""
    out = {}
    for name, first in states[0].items():
        acc = torch.zeros(first.shape, dtype=torch.float64)
        for state in states:
            acc += torch.tensor(1 / len(states), dtype=torch.float64) * state[name].to(torch.float64)
        out[name] = acc.to(first.dtype)
    return out


def test_average_last_k_follows_the_last_finished_steps(trained, tmp_path, capsys):
    """--average-last 2: waits while one step is finished; then the average of steps 2 and 4 (the formula over what
    the job gathered), untouched by a pass that finds the same two; steps 2 and 6 once 4 is gone and 6 finished (the
    first input the same, the second not); then 4 and 6."""
    run = linked(trained[0], tmp_path / "run")
    out, ref, avg = tmp_path / "out", trained[1], tmp_path / "out" / "average-last-2" / "actor"
    state = {s: load_file(ref / f"global_step_{s}.safetensors") for s in STEPS}
    mark(run, 2)
    assert watch("--input", run, "--output", out, "--once", "--average-last", "2") == 0
    said = capsys.readouterr().out
    assert rows(said)["average-last-2"] == f"{TOO_FEW}: 1 of 2 steps finished" and not avg.exists()
    mark(run, 4)
    assert watch("--input", run, "--output", out, "--once", "--average-last", "2") == 0
    assert rows(capsys.readouterr().out)["average-last-2/actor"] == MERGED
    assert_exact(load_merged(avg), formula(state[2], state[4]))
    before = tree_digest(out)
    assert watch("--input", run, "--output", out, "--once", "--average-last", "2") == 0
    assert rows(capsys.readouterr().out)["average-last-2/actor"] == DONE and tree_digest(out) == before
    shutil.move(run / "global_step_4", tmp_path / "step_4")  # a keep-the-last-N policy removed it: the last 2 are 2, 6
    mark(run, 6)
    assert watch("--input", run, "--output", out, "--once", "--average-last", "2") == 0
    assert rows(capsys.readouterr().out)["average-last-2/actor"] in (MERGED, RESUMED)
    assert_exact(load_merged(avg), formula(state[2], state[6]))
    shutil.move(tmp_path / "step_4", run / "global_step_4")
    assert watch("--input", run, "--output", out, "--once", "--average-last", "2") == 0
    assert rows(capsys.readouterr().out)["average-last-2/actor"] in (MERGED, RESUMED)
    assert_exact(load_merged(avg), formula(state[4], state[6]))

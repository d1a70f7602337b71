"""distmerge.merge() / distmerge.verify(): the CLI's options, its bytes, typed errors, silence, and a real
training-like torchrun job calling the API on every rank (tests/jobs/api_in_job.py)."""

from __future__ import annotations

import os
import random
import re
import subprocess
import sys

import pytest

import distmerge
from distmerge import options
from distmerge.errors import InputError, OutputError
from distmerge.front.cli import main as distmerge_main
from tests.conftest import REPO, free_port, input_untouched, merge_inproc, reference_dir, tree_bytes

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


def test_the_api_takes_a_source_object_as_its_input(fsdp_ckpts, tmp_path):
    """Other storage plugs in from outside: `input=` takes a Source (input/source.py, docs/extending.md), here a
    folder's that counts the files it opens; the merge is the folder's own, byte for byte."""
    from distmerge.input.local import LocalSource

    class Counting(LocalSource):
        opened: list[str] = []

        def open(self, path):
            found = super().open(path)
            if found is not None:
                Counting.opened.append(os.path.basename(path))
            return found

    ckpt = fsdp_ckpts["fsdp2_llama_w2"]
    assert merge_inproc("--input", ckpt, "--output", tmp_path / "cli") == 0
    result = distmerge.merge(Counting(ckpt), tmp_path / "api")
    assert result.tensors > 0 and {n for n in Counting.opened if n.endswith(".pt")} == \
        {p.name for p in ckpt.glob("model_world_size_2_rank_*.pt")}
    assert tree_bytes(tmp_path / "api") == tree_bytes(tmp_path / "cli")


def _counting_source():
    """A folder's Source that counts the rank files it opens (as the test above)."""
    from distmerge.input.local import LocalSource

    class Counting(LocalSource):
        opened: list[str] = []

        def open(self, path):
            found = super().open(path)
            if found is not None and str(path).endswith(".pt"):
                Counting.opened.append(os.path.basename(path))
            return found

    return Counting


def test_verify_and_inspect_take_a_source_object_for_a_checkpoint(fsdp_ckpts, tmp_path):
    """verify's sides and inspect's input are read as merge's: a Source given as --merged (or --reference) is a
    checkpoint merged in memory through it, and inspect describes it as it describes the folder."""
    from distmerge.front.cli import build_parser
    from distmerge.front.inspect import describe

    ckpt = fsdp_ckpts["fsdp2_llama_w2"]
    ranks = {p.name for p in ckpt.glob("model_world_size_2_rank_*.pt")}
    Counting = _counting_source()
    assert distmerge.verify(Counting(ckpt), reference_dir(ckpt)).passed
    assert set(Counting.opened) == ranks
    Counting.opened.clear()
    assert distmerge.verify(reference_dir(ckpt), Counting(ckpt)).passed
    assert set(Counting.opened) == ranks
    Counting.opened.clear()
    args = build_parser().parse_args(["inspect", str(ckpt)])
    by_folder = describe(args)
    args.input = Counting(ckpt)
    by_source = describe(args)
    assert set(Counting.opened) == ranks and by_source == by_folder


def test_the_api_takes_a_store_object_as_its_output(fsdp_ckpts, tmp_path):
    """The output's twin: `output=` takes a Store (output/store.py, docs/extending.md), here a folder's that counts
    the files it creates; the model is the folder's own, byte for byte, and the result names the store's url."""
    from distmerge.output.local import LocalStore

    class Counting(LocalStore):
        created: list[str] = []

        def create(self, layout, rank):
            Counting.created.append(layout.name)
            return super().create(layout, rank)

    ckpt = fsdp_ckpts["fsdp2_llama_w2"]
    assert merge_inproc("--input", ckpt, "--output", tmp_path / "cli") == 0
    store = Counting(tmp_path / "api")
    result = distmerge.merge(ckpt, store)
    assert result.output == store.url
    assert tree_bytes(tmp_path / "api") == tree_bytes(tmp_path / "cli")
    assert {n for n in Counting.created if n.endswith(".safetensors")} == \
        {p.name for p in (tmp_path / "cli").glob("*.safetensors")}


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


def test_errors_name_the_api_arguments_and_the_command_line_its_flags(fsdp_ckpts, tmp_path, capsys):
    """A refusal found past the keywords (by the output store, by verify) names the API's arguments when raised
    through the API, the flags through the command line (#35). Made to fail first: the API's said `pass --overwrite`
    and `--merged ... --dtype`."""
    ckpt, out = fsdp_ckpts["fsdp2_llama_w2"], tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(OutputError) as err:
        distmerge.merge(ckpt, out)
    assert f"output {out} is not empty: pass overwrite=True to replace its model files, or resume=True to finish" in (
        str(err.value))
    assert merge_inproc("--input", ckpt, "--output", out) == 1
    assert "pass --overwrite to replace its model files, or --resume to finish" in capsys.readouterr().err
    ref = reference_dir(ckpt)
    with pytest.raises(InputError) as err:
        distmerge.verify(ref, ref, dtype="bf16", lora_alpha=8)
    assert str(err.value) == (f"merged {ref} is a finished model; dtype, lora_alpha: options of the merge of a "
                              "training checkpoint, leave them out (or pass the checkpoint as merged)")
    assert distmerge_main(["verify", "--merged", str(ref), "--reference", str(ref), "--dtype", "bf16"]) == 1
    assert f"--merged {ref} is a finished model; --dtype: options" in capsys.readouterr().err


def test_api_spelling_leaves_the_flags_the_api_does_not_take():
    said = "--verify-against needs --output, and --quiet with --overwrite; --reference-format --resume-from"
    assert options.api_spelling(said, "merge") == ("--verify-against needs output, and --quiet with overwrite=True; "
                                                   "--reference-format --resume-from")
    assert options.api_spelling("--reference-format and --reference", "verify") == "reference_format and reference"


def test_a_script_merges_several_times_in_one_process(fsdp_ckpts, tmp_path):
    """tests/jobs/merges_in_one_process.py: five merges one after another in each of 2 processes under torchrun,
    each starting and ending distmerge's own group on torchrun's store: all succeed and write the CLI's bytes. Seen
    failing without comm._own_store's prefix (the second group read the first's gloo addresses: "Gloo
    connectFullMesh failed ... Connection refused", or a hang, in 3 of 4 runs of 3 merges)."""
    ckpt = fsdp_ckpts["fsdp2_llama_w4"]
    assert merge_inproc("--input", ckpt, "--output", tmp_path / "cli") == 0
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--nnodes", "1",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
           str(REPO / "tests/jobs/merges_in_one_process.py"), str(ckpt), str(tmp_path / "job"), "5"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "PYTHONPATH": str(REPO)}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env, cwd=REPO)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    said = sorted(re.findall(r"rank (\d): merge (\d): \d+ tensors with 2 processes", done.stdout))  # ranks interleave
    assert said == [(r, str(k)) for r in "01" for k in range(5)], done.stdout
    for k in range(5):
        assert tree_bytes(tmp_path / "job" / str(k)) == tree_bytes(tmp_path / "cli")


def test_a_running_job_calls_the_api_on_every_rank(fsdp_ckpts, tmp_path):
    """tests/jobs/api_in_job.py, 2 processes with gloo: two merges and two verifies in the job's processes (the
    second pair through a gloo side group, as an NCCL job gets), each leaving the process as it found it, the same
    results on every rank, training steps before and after. Shown to fail: with Comm.close() leaving the side group
    up, "merge 2: groups: 1 -> 2" (and its sockets: "files: ..."); with the API installing a SIGTERM handler,
    "merge: signals: {<Signals.SIGTERM: 15>: <Handlers.SIG_DFL: 0>} -> {...}"; with the walk of the input kept
    (input_source.fresh_session not entered), "merge: input_walks: 0 -> 1"; with the side-group seam not reached,
    "merge 2: side groups made [], not one gloo group". Python's random state is checked here too, but no
    call draws from it any more (rich's import once did): test_a_call_leaves_the_callers_random_stream_as_it_found_it
    is the test that fails without api.as_found's restore."""
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


# -- the caller's random stream as the call found it (api.as_found) ---------------------------------------------


def drawing(monkeypatch, module, name: str) -> list[float]:
    """`module.name` made to draw from Python's global random before it runs, as a library the call uses may (rich's
    import did, #25). No code draws today, so without this draw the restore is never exercised. Returns the draws."""
    real, draws = getattr(module, name), []

    def draws_then_runs(*args, **kwargs):
        draws.append(random.random())
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, draws_then_runs)
    return draws


def test_a_call_leaves_the_callers_random_stream_as_it_found_it(fsdp_ckpts, tmp_path, monkeypatch):
    """A seeded caller draws after each call what it would have drawn without the call, though the merge and the
    verify drew from `random` inside (the engine and verify entry points, looked up at call time). The job test above
    checks the RNG too, but nothing draws there any more. Shown to fail: without as_found's random.setstate,
    "merge moved the caller's random stream"."""
    from distmerge.engine import run as engine_run
    from distmerge.verifier import run as verify_run

    ckpt = fsdp_ckpts["fsdp2_llama_w2"]
    merge_draws = drawing(monkeypatch, engine_run, "merge")
    verify_draws = drawing(monkeypatch, verify_run, "verify_and_write")
    random.seed(34)
    expected = [random.random(), random.random()]
    random.seed(34)
    distmerge.merge(ckpt, tmp_path / "out")
    assert merge_draws and random.random() == expected[0], "merge moved the caller's random stream"
    assert distmerge.verify(tmp_path / "out", reference_dir(ckpt)).passed
    assert verify_draws and random.random() == expected[1], "verify moved the caller's random stream"


# -- a borrowed group's layout (comm.Comm.borrow), in one process: what an NCCL job gets, on a CPU ---------------


@pytest.fixture
def job_group():
    """A running job of one process: the default group, gloo, as a training script starts it."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


@pytest.fixture
def runs_nccl(job_group, monkeypatch):
    """The job's group says it runs NCCL (the backend is what borrow reads); its current GPU is cuda:1, and
    torch.cuda is counted on."""
    import torch
    import torch.distributed as dist

    real = dist.get_backend
    monkeypatch.setattr(dist, "get_backend", lambda g=None: "nccl" if g is job_group else real(g))
    asked = []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: asked.append(1) or 1)
    return asked


def groups() -> int:
    from torch.distributed import distributed_c10d

    return len(distributed_c10d._world.pg_map)


def test_an_nccl_job_gets_a_gloo_side_group_of_ours(runs_nccl, job_group):
    """Over NCCL the fragments travel in the job's group on its current GPU (read, never set), the small messages
    in a gloo group distmerge makes, and close() destroys that one only; with device='cpu' the fragments go in the
    side group too (NCCL carries no CPU tensor)."""
    from distmerge.distributed.comm import Comm

    start = groups()
    comm = Comm.borrow(None, device="auto", timeout_s=30)
    assert str(comm.device) == "cuda:1" and runs_nccl == [1]
    assert comm._data is job_group and comm._control is comm._side is not None and groups() == start + 1
    assert comm.gather(lambda: comm.rank) == [0] and comm.root_only(lambda: "rank 0's") == "rank 0's"
    comm.close()
    assert groups() == start and comm._side is None

    comm = Comm.borrow(None, device="cpu", timeout_s=30)
    assert comm.device.type == "cpu" and comm._data is comm._control is comm._side is not None
    comm.close()
    assert groups() == start and runs_nccl == [1]  # device='cpu': torch.cuda not asked


def test_a_gloo_job_keeps_the_cpu_and_torch_cuda_untouched(job_group, monkeypatch):
    """A gloo group carries everything on the CPU, in the job's group, no side group; torch.cuda is never asked;
    device='cuda' there is a clear error."""
    import torch

    from distmerge.distributed.comm import Comm

    monkeypatch.setattr(torch.cuda, "current_device", lambda: pytest.fail("torch.cuda asked"))
    start = groups()
    comm = Comm.borrow(None, device="auto", timeout_s=30)
    assert comm.device.type == "cpu" and comm._data is comm._control is job_group and comm._side is None
    comm.close()
    assert groups() == start
    with pytest.raises(InputError, match="device='cuda' in a job whose group runs gloo"):
        Comm.borrow(None, device="cuda", timeout_s=30)


def test_an_nccl_group_of_part_of_the_job_is_refused(runs_nccl, job_group, monkeypatch):
    """The side group must be made by every process of the job: an NCCL group of some of them cannot get one from
    distmerge alone, and the message says what to pass instead."""
    import torch.distributed as dist

    from distmerge.distributed.comm import Comm

    real = dist.get_world_size
    monkeypatch.setattr(dist, "get_world_size", lambda g=None: 1 if g is job_group else 4 if g is None else real(g))
    with pytest.raises(InputError, match=r"runs nccl on 1 of the job's 4 processes.*dist.new_group\(ranks, "
                                         r"backend='gloo'\).*group="):
        Comm.borrow(job_group, device="auto", timeout_s=30)


def test_the_api_in_a_one_process_job(job_group, fsdp_ckpts, tmp_path):
    """distmerge.merge in a running (one-process) job: the job's group, left up; the CLI's bytes."""
    import torch.distributed as dist

    ckpt = fsdp_ckpts["fsdp2_llama_w2"]
    assert merge_inproc("--input", ckpt, "--output", tmp_path / "cli") == 0
    result = distmerge.merge(ckpt, tmp_path / "api", group=job_group)
    assert result.processes == 1 and dist.is_initialized()
    assert tree_bytes(tmp_path / "api") == tree_bytes(tmp_path / "cli")


# -- library manners: nothing printed unless asked; the rest to the `distmerge` logger --------------------------

# The functions that may write to stdout/stderr: the command line's, and the progress, summary and report that
# the API shows only with progress=True.
PRINTERS = {
    "distmerge/front/cli.py": {"main", "_report_error", "report_silence", "_run_watch"},
    "distmerge/front/verl_cli.py": {"say_notes", "after_merge"},
    "distmerge/front/inspect.py": {"run_inspect"},
    "distmerge/api.py": {"run_import"},  # the import's one line, for the command and progress=True
    "distmerge/report.py": {"Progress.say", "Progress.start", "Progress.advance", "print_summary"},
    "distmerge/verifier/report.py": {"print_report"},
    "distmerge/watcher/summary.py": {"say_merging", "print_pass", "print_end"},
    "distmerge/testing_seams.py": {"_say"},  # only where a test set a DISTMERGE_TEST_ variable
}


def printing_functions() -> set[tuple[str, str]]:
    """(file, function) of every print(...), console.print(...) and sys.stdout/stderr.write(...) in distmerge/."""
    import ast

    found = set()

    def visit(node, path: str, where: list[str]) -> None:
        for child in ast.iter_child_nodes(node):
            inner = where + [child.name] if isinstance(child, ast.FunctionDef | ast.ClassDef) else where
            if isinstance(child, ast.Call):
                f = child.func
                name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
                stream = isinstance(f, ast.Attribute) and isinstance(f.value, ast.Attribute) and \
                    f.value.attr in ("stdout", "stderr")
                if name == "print" or (name == "write" and stream):
                    found.add((path, ".".join(where)))
            visit(child, path, inner)

    for file in sorted((REPO / "distmerge").rglob("*.py")):
        visit(ast.parse(file.read_text()), str(file.relative_to(REPO)), [])
    return found


def test_only_the_command_line_and_the_progress_print():
    """Shown to fail: with a print() added to engine.merge, this listed ('distmerge/engine/run.py', 'merge')."""
    allowed = {(path, func) for path, funcs in PRINTERS.items() for func in funcs}
    assert printing_functions() - allowed == set()


def test_a_resumed_merge_says_its_line_to_the_logger(fsdp_ckpts, tmp_path, capsys, caplog):
    ckpt = fsdp_ckpts["fsdp2_llama_w2"]
    distmerge.merge(ckpt, tmp_path / "out")
    with caplog.at_level("INFO", logger="distmerge"):
        distmerge.merge(ckpt, tmp_path / "out", resume=True)
    assert capsys.readouterr() == ("", "")
    assert [r.name for r in caplog.records] == ["distmerge"] * len(caplog.records)
    assert any(r.getMessage().startswith("resume: ") and "already complete" in r.getMessage() for r in caplog.records)

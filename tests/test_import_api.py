"""distmerge.import_checkpoint(): `distmerge import` as a Python function (api.py, docs/api.md). It writes the
command's bytes, prints nothing, raises typed errors in the API's spelling with nothing written, and runs inside a
running torchrun job on every rank (tests/jobs/import_in_job.py), where 2 processes write what the command writes
with one."""

from __future__ import annotations

import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import distmerge
from distmerge import options
from distmerge.errors import ConfigError
from tests.conftest import REPO, input_untouched
from tests.helpers.importing import folder_bytes, import_inproc, save_hf_model
from tests.helpers.ports import free_port

LAYOUT = {"tp": 2, "pp": 2, "vpp": 2}  # the tests' 4-layer Llama, interleaved


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory) -> Path:
    return save_hf_model("llama4", tmp_path_factory.mktemp("hf") / "llama4")


@pytest.fixture(scope="module")
def cli_folder(hf_model, tmp_path_factory) -> Path:
    """The command's import of the model at LAYOUT, by one process."""
    out = tmp_path_factory.mktemp("cli") / "out"
    flags = [a for key, value in LAYOUT.items() for a in (f"--{key}", value)]
    assert import_inproc("--input", hf_model, "--output", out, *flags) == 0
    return out


def test_import_in_process_is_the_cli_bytes_and_silent(hf_model, cli_folder, tmp_path, capsys):
    with input_untouched(hf_model):
        result = distmerge.import_checkpoint(hf_model, tmp_path / "api", **LAYOUT)
    assert folder_bytes(tmp_path / "api") == folder_bytes(cli_folder)
    assert capsys.readouterr() == ("", "")
    assert (result.files, result.processes) == (4, 1)


def test_torchtitan_by_the_api_is_the_cli_bytes(hf_model, tmp_path, capsys):
    assert import_inproc("--input", hf_model, "--output", tmp_path / "cli", "--to", "torchtitan") == 0
    distmerge.import_checkpoint(str(hf_model), str(tmp_path / "api"), to="torchtitan", progress=True)
    assert folder_bytes(tmp_path / "api") == folder_bytes(tmp_path / "cli")
    assert capsys.readouterr().out.startswith(f"distmerge import: wrote {tmp_path / 'api'}/step-0 (torchtitan DCP")


@pytest.mark.parametrize(("keywords", "error", "words"), [
    ({"pp": 2, "vpp": 3}, ConfigError, "vpp 3 does not divide the 2 layers of each pipeline rank"),
    ({"to": "torchtitan", "tp": 2}, ConfigError, "to torchtitan writes one folder that torchtitan loads at any "
     "parallelism: drop tp, pp, ep, vpp, decoder_first_pipeline_num_layers and decoder_last_pipeline_num_layers"),
    ({"tp": 0}, distmerge.errors.InputError, "tp=0: must be at least 1"),
])
def test_errors_are_raised_typed_in_the_api_spelling(hf_model, tmp_path, capsys, keywords, error, words):
    with pytest.raises(error, match=re.escape(words)) as raised:
        distmerge.import_checkpoint(hf_model, tmp_path / "out", **keywords)
    assert "\n" not in str(raised.value)
    assert not (tmp_path / "out").exists()
    assert capsys.readouterr() == ("", "")


def test_the_signature_is_the_import_tables():
    """import_checkpoint takes the options of `distmerge import --help` (but --quiet, --debug: the command line's
    only) by keyword with the same defaults, and the API's own progress and group."""
    params = inspect.signature(distmerge.import_checkpoint).parameters
    assert str(inspect.signature(distmerge.import_checkpoint)) == str(options.signature("import", "ImportResult"))
    flags = {r.name for r in options.cli_rows("import")}
    assert flags - set(params) == {"quiet", "debug"} and set(params) - flags == {"progress", "group"}
    assert [n for n, p in params.items() if p.kind is not p.KEYWORD_ONLY] == ["input", "output"]
    assert (params["tp"].default, params["pp"].default, params["vpp"].default, params["to"].default) == (
        1, 1, None, "megatron")


def test_a_running_job_imports_with_the_api_on_every_rank(hf_model, cli_folder, tmp_path):
    """2 processes of a gloo job each call import_checkpoint twice in the job's group: the process as it found it,
    the same result on both ranks, and both folders the bytes one process of the command writes."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--nnodes", "1",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(REPO / "tests/jobs/import_in_job.py"),
           str(hf_model), str(tmp_path / "job"), *(str(LAYOUT[k]) for k in ("tp", "pp", "vpp"))]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "PYTHONPATH": str(REPO)}
    with input_untouched(hf_model):
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=REPO)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    said = re.findall(r"^rank (\d): imported \d+ tensors in \d+ chunks into 4 file\(s\) with 2 processes, twice; "
                      r"training step after: .*; process unchanged$", done.stdout, re.MULTILINE)
    assert said == ["0", "1"], done.stdout
    assert folder_bytes(tmp_path / "job" / "first") == folder_bytes(tmp_path / "job" / "second") == folder_bytes(
        cli_folder)


def test_progress_prints_the_commands_line(hf_model, tmp_path, capsys):
    """progress=True: the line the command prints (without --quiet), the layout in it; nothing else."""
    from distmerge.front.cli import main as distmerge_main

    flags = [a for key, value in LAYOUT.items() for a in (f"--{key}", str(value))]
    assert distmerge_main(["import", "--input", str(hf_model), "--output", str(tmp_path / "out"), *flags]) == 0
    said = capsys.readouterr().out.splitlines()
    distmerge.import_checkpoint(hf_model, tmp_path / "out", **LAYOUT, overwrite=True, progress=True)
    again = capsys.readouterr().out.splitlines()
    timing = re.compile(r"; [\d.]+ s with")
    assert [timing.sub("", line) for line in said] == [timing.sub("", line) for line in again]
    assert len(said) == 1 and said[0].startswith(
        f"distmerge import: wrote {tmp_path / 'out'} (Megatron-LM torch_dist, TP=2 x PP=2 x VPP=2): "), said

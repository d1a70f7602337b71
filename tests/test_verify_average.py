"""`distmerge verify --merged A --merged B ... --average --reference REF` (docs/average.md): the checkpoints averaged
in memory exactly as `merge --input A --input B --average` writes them, nothing written, and compared with REF, a
finished model: merge --average's output, or the formula computed here in torch over the saving jobs' own state
dicts (tests/test_average.py) and saved as save_pretrained saves it. The refusals are merge's, naming --merged."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from safetensors.torch import save_file

import distmerge
from distmerge.front.cli import main as distmerge_main
from tests.conftest import expected_tensors, input_untouched, merge_inproc, torchrun
from tests.helpers.average import average, inputs

NAME = "model.layers.1.mlp.down_proj.weight"


def merged(*ckpts: Path) -> list[str]:
    return [a for c in ckpts for a in ("--merged", str(c))]


def verify(capsys, *args) -> tuple[int, list[str]]:
    """One process, the inputs untouched: the exit status and the verdict and error lines."""
    capsys.readouterr()
    ckpts = [Path(a) for a, flag in zip(args[1:], args, strict=False) if flag == "--merged"]
    with input_untouched(*ckpts):
        code = distmerge_main(["verify", *map(str, args)])
    out, err = capsys.readouterr()
    return code, [line for line in (out + err).splitlines() if line.startswith(("verify:", "distmerge: error"))]


def formula_model(ckpts: list[Path], folder: Path, weights: list[float] | None = None, bump: str = "") -> Path:
    """The average by the formula, saved as one model.safetensors with the first input's config (`bump`: one
    element of that tensor changed by 1e-2)."""
    state = average([expected_tensors(c) for c in ckpts], weights)
    if bump:
        state[bump] = state[bump].clone()
        state[bump].view(-1)[5] += 1e-2
    folder.mkdir()
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    shutil.copy(ckpts[0] / "huggingface" / "config.json", folder / "config.json")
    return folder


@pytest.fixture
def two(fsdp_ckpts, dcp_ckpts) -> list[Path]:
    """Two formats and world sizes of one architecture (different weights)."""
    return [fsdp_ckpts["fsdp2_llama_w2"], dcp_ckpts["dcp_llama_w2"]]


def test_an_average_in_memory_is_merge_averages_bytes(two, tmp_path, capsys):
    """Against merge --average's output, and against the formula: bit-exact, with weights too."""
    assert merge_inproc(*inputs(*two), "--output", tmp_path / "avg", "--average", "--average-weights", "0.3,0.7") == 0
    args = [*merged(*two), "--average", "--average-weights", "0.3,0.7"]
    code, lines = verify(capsys, *args, "--reference", tmp_path / "avg")
    assert (code, lines) == (0, ["verify: PASS 21 tensors bit-exact"])
    code, lines = verify(capsys, *args, "--reference", formula_model(two, tmp_path / "ref", [0.3, 0.7]))
    assert (code, lines) == (0, ["verify: PASS 21 tensors bit-exact"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["avg", "ref"]  # nothing written


def test_a_changed_tensor_fails_and_is_named(two, tmp_path, capsys):
    code, lines = verify(capsys, *merged(*two), "--average", "--reference",
                         formula_model(two, tmp_path / "bad", bump=NAME))
    assert code == 1 and len(lines) == 1, lines
    assert lines[0].startswith(f"verify: FAIL 1 of 21 tensors: {NAME} (values differ: max abs 0.01"), lines


def test_the_api_takes_a_list_of_checkpoints(two, tmp_path):
    """The notes are the average's (its weights as given), the format each input's."""
    ref = formula_model(two, tmp_path / "ref", [0.75, 0.25])
    result = distmerge.verify([str(c) for c in two], ref, average=True, average_weights=[0.75, 0.25])
    assert result.passed and result.format == "fsdp + dcp" and "average of 2 inputs, weights 0.75, 0.25" in result.notes
    assert not distmerge.verify(two, formula_model(two, tmp_path / "bad", bump=NAME), average=True).passed


@pytest.mark.parametrize("args, words", [
    (["--merged", "B"], "2 inputs given (--merged, repeated): pass --average to average them, or one --merged"),
    (["--average"], "--average needs two or more checkpoints: pass --merged once for each"),
    (["--merged", "B", "--average", "--average-weights", "1"], "--average-weights gives 1 weight(s) for 2 inputs"),
    (["--merged", "B", "--average", "--reference-format", "fsdp"], "--average checks the average of the --merged "
     "checkpoints against a finished model: pass a Hugging Face folder as --reference"),
], ids=["several-without-average", "average-of-one", "weights-count", "checkpoint-reference"])
def test_merged_and_average_must_agree(two, tmp_path, capsys, args, words):
    """Merge's refusals (average/units.check), naming --merged; one line, exit 1."""
    named = {"B": str(two[1])}
    code, lines = verify(capsys, "--merged", two[0], "--reference", two[0], *(named.get(a, a) for a in args))
    assert code == 1 and len(lines) == 1 and words in lines[0], lines


@pytest.mark.torchrun
def test_two_processes_name_the_changed_tensor(two, tmp_path):
    run = torchrun(2, "verify", *merged(*two), "--average", "--reference",
                   formula_model(two, tmp_path / "bad", bump=NAME), "--device", "cpu", "--budget", "64KiB")
    assert run.returncode != 0
    lines = [line for line in run.stdout.splitlines() if line.startswith("verify:")]
    assert lines == [f"verify: FAIL 1 of 21 tensors: {NAME} (values differ: max abs 0.01)"], run.stdout + run.stderr

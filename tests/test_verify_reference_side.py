"""verify's --reference side read as --merged is: a training checkpoint given as --reference of a finished model is
merged in memory (the roles swapped inside, the report in the user's sides), and --reference-format,
--reference-hf-config and the formats' own --reference- options read it as --format, --hf-config, --iteration ...
read --merged."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.conftest import merge_inproc, reference_dir, torchrun
from tests.helpers.verify_checkpoint import bumped_reference, nothing_written, one_error, settled, verdict, verify

NAME = "model.layers.1.mlp.down_proj.weight"


def checkpoint_and_options(request, family: str, case: str) -> tuple:
    ckpt = request.getfixturevalue(family)[case]
    own = (ckpt / "huggingface").is_dir()
    return ckpt, [] if own else ["--reference-hf-config", str(reference_dir(ckpt) / "huggingface"),
                                 "--reference-format", "megatron"]


@pytest.mark.parametrize("family, case", [("fsdp_ckpts", "fsdp2_llama_w4"), ("megatron_ckpts", "megatron_tp2pp2")])
def test_a_finished_model_against_a_checkpoint(family, case, request, tmp_path, capsys):
    """Passes bit-exact writing nothing; with one element of the model changed, fails naming it, with the records
    `verify` gives for the model against the checkpoint's merged folder (merged minus reference, its file names)."""
    ckpt, options = checkpoint_and_options(request, family, case)
    model = reference_dir(ckpt)
    with nothing_written(ckpt):
        assert verify("--merged", model, "--reference", ckpt, *options) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[-1] == "verify: PASS 21 tensors bit-exact", out
    assert f"{'megatron' if options else 'fsdp'} reference checkpoint merged in memory, nothing written" in out
    bad = bumped_reference(model, tmp_path / "bad", NAME)
    assert verify("--merged", bad, "--reference", ckpt, *options, "--json", tmp_path / "swapped.json") == 1
    assert verdict(capsys).startswith(f"verify: FAIL 1 of 21 tensors: {NAME} (values differ: max abs 0.01")
    config = ["--hf-config", options[1]] if options else []
    assert merge_inproc("--input", ckpt, "--output", tmp_path / "merged", *config) == 0
    assert verify("--merged", bad, "--reference", tmp_path / "merged", "--json", tmp_path / "folder.json") == 1
    swapped, folder = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("swapped", "folder"))
    assert swapped["merged"] == str(bad) and swapped["run"]["reference_checkpoint"]["format"] in ("fsdp", "megatron")
    assert "checkpoint" not in swapped["run"]
    for key in ("verdict", "summary", "counts", "tensors"):
        assert swapped[key] == folder[key], key


def test_reference_options_read_it_as_merge_reads_its_input(twin_ckpts, megatron_ckpts, tmp_path, capsys):
    """A Megatron save whose tracker names an iteration it lacks: --reference-iteration picks the one there."""
    original = megatron_ckpts["megatron_tp2"]
    ckpt = shutil.copytree(original, tmp_path / "megatron")
    (ckpt / "latest_checkpointed_iteration.txt").write_text("7")
    fsdp = twin_ckpts["fsdp2_from_megatron_w2"]
    args = ["--merged", fsdp, "--reference", ckpt, "--reference-hf-config", reference_dir(original) / "huggingface"]
    assert verify(*args) == 1
    assert "has no iter_0000007/ (iterations found: iter_0000001)" in one_error(capsys)
    assert verify(*args, "--reference-iteration", "1", "--reference-format", "megatron") == 0
    assert verdict(capsys) == "verify: PASS 21 tensors bit-exact"
    assert verify(*args, "--reference-iteration", "1", "--reference-format", "megatron-dist") == 1
    assert "is not a Megatron torch_dist save" in one_error(capsys)
    ref = reference_dir(fsdp)
    assert verify("--merged", fsdp, "--reference", ref, "--reference-iteration", "1") == 1
    assert f"--reference {ref} is a finished model; the format's own options for --reference" in one_error(capsys)


@pytest.mark.torchrun
def test_two_processes_a_finished_model_against_a_checkpoint(fsdp_ckpts, tmp_path):
    ckpt = fsdp_ckpts["fsdp2_llama_w4"]
    bad = bumped_reference(reference_dir(ckpt), tmp_path / "bad", NAME)
    args = ["--merged", bad, "--reference", ckpt, "--device", "cpu", "--json"]
    assert verify(*args, tmp_path / "one.json") == 1
    run = torchrun(2, "verify", *args, tmp_path / "two.json")
    assert run.returncode == 1, run.stdout + run.stderr[-3000:]
    one, two = (settled(json.loads((tmp_path / f"{n}.json").read_text())) for n in ("one", "two"))
    assert all(n > 0 for n in two["run"]["compared_per_rank"])
    one.pop("run"), two.pop("run")
    assert one == two and [t["name"] for t in two["tensors"] if not t["passed"]] == [NAME]

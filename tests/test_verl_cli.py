"""verl's model-merger command line, verbatim (distmerge/front/verl_cli.py, docs/verl.md): the merger guide's commands
with only the program name swapped, on real saves laid out as verl lays them out; each flag does what it did in
verl, is checked against the checkpoint (a contradiction is one line, exit 1), or is a note said once."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from distmerge.front.cli import build_parser
from distmerge.front.verl_cli import translate
from tests.conftest import (
    assert_exact,
    expected_tensors,
    input_untouched,
    load_merged,
    load_reference,
    reference_dir,
    torchrun,
    tree_bytes,
)
from tests.helpers.verl_cli import committed_files, expected_megatron, run

TIED_QWEN2 = "megatron_dist_qwen2_tp2pp2"  # torch_dist, TP2 x PP2, Qwen2 with tied embeddings, 4 heads, 2 kv heads
HEADS = ["--num-attention-heads", "4", "--num-key-value-heads", "2"]


def verl_v2(ckpt: Path, root: Path) -> Path:
    """verl 0.9's Megatron checkpoint manager (layout schema v2): global_step_N/actor/ with the model's torch_dist
    save in model/dist_ckpt/ (no iter_N folder), config and tokenizer in model/huggingface/, the optimizer's and
    the RNG's own torch_dist saves beside it (decoys here: a merge that read them would fail), transformer_config.json
    and, written last, ckpt_contents.json."""
    actor = root / "global_step_1" / "actor"
    shutil.copytree(ckpt / "iter_0000001", actor / "model" / "dist_ckpt")
    shutil.copytree(reference_dir(ckpt) / "huggingface", actor / "model" / "huggingface")
    for decoy in ("optimizer", "extra"):
        (actor / decoy / "dist_ckpt").mkdir(parents=True)
        (actor / decoy / "dist_ckpt" / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    (actor / "transformer_config.json").write_text('{"num_layers": 2}')
    contents = {"model": {"path": "model/dist_ckpt", "format": "megatron_dist_checkpoint"},
                "optimizer": {"path": "optimizer/dist_ckpt", "format": "megatron_dist_checkpoint"},
                "rng_state": {"path": "extra/dist_ckpt", "format": "megatron_dist_checkpoint", "key": "rng_state"},
                "transformer_config": {"path": "transformer_config.json", "format": "json"}}
    (actor / "ckpt_contents.json").write_text(json.dumps({"schema_version": 2, "framework": "megatron",
                                                          "role": "actor", "contents": contents}))
    (root / "latest_checkpointed_iteration.txt").write_text("1")
    return actor


def test_fsdp_guide_command(fsdp_ckpts, tmp_path, capsys, monkeypatch):
    """`merge --backend fsdp --local_dir .../actor --target_dir merged --low_cpu_mem_usage`: the exact model, and
    the note for the meaningless flag said once."""
    ckpt = fsdp_ckpts["fsdp2_llama_w4"]
    monkeypatch.chdir(tmp_path)
    with input_untouched(ckpt):
        assert run("merge", "--backend", "fsdp", "--local_dir", ckpt, "--target_dir", "merged",
                   "--low_cpu_mem_usage", "--quiet") == 0
    assert_exact(load_merged(tmp_path / "merged"), expected_tensors(ckpt))
    err = capsys.readouterr().err
    assert err.count("--low_cpu_mem_usage has no effect") == 1, err


@pytest.mark.torchrun
def test_megatron_guide_command_on_verl_v2_layout(megatron_ckpts, tmp_path):
    """`merge --backend megatron --tie-word-embedding --num-attention-heads N --num-key-value-heads K --local_dir
    .../actor --target_dir ...` on verl's schema-v2 folders: exact, and byte-identical with one process and two."""
    ckpt = megatron_ckpts[TIED_QWEN2]
    actor = verl_v2(ckpt, tmp_path / "ckpts")
    args = ["--backend", "megatron", "--tie-word-embedding", *HEADS, "--local_dir", actor, "--max-shard-size", "100KB"]
    with input_untouched(actor):
        assert run("merge", *args, "--target_dir", tmp_path / "n1", "--quiet") == 0
        job = torchrun(2, "merge", *args, "--target_dir", tmp_path / "n2", "--quiet")
    assert job.returncode == 0, job.stderr[-3000:]
    assert_exact(load_merged(tmp_path / "n1"), expected_megatron(ckpt))
    one, two = tree_bytes(tmp_path / "n1"), tree_bytes(tmp_path / "n2")
    assert len([n for n in one if n.endswith(".safetensors")]) > 2
    assert one == two


def test_megatron_legacy_with_hf_model_path(megatron_ckpts, tmp_path):
    """mp_rank_* files (verl's older Megatron saves) with the legacy merger's --hf_model_path for the config."""
    ckpt = megatron_ckpts["megatron_qwen2_tp2"]
    hf = reference_dir(ckpt) / "huggingface"
    assert run("merge", "--backend", "megatron", "--local_dir", ckpt, "--hf_model_path", hf, "--target_dir",
               tmp_path / "out", "--use_cpu_initialization", "--trust-remote-code", "--quiet") == 0
    assert_exact(load_merged(tmp_path / "out"), expected_megatron(ckpt))


def test_critic_with_is_value_model(critic_ckpts, tmp_path):
    """--is-value-model agrees with a Megatron critic (its one-row head): accepted, the model as without it."""
    ckpt = critic_ckpts["critic_megatron_bias_tp2"]
    assert run("merge", "--backend", "megatron", "--is-value-model", "--local_dir", ckpt, "--hf_model_path",
               reference_dir(ckpt) / "huggingface", "--target_dir", tmp_path / "out", "--quiet") == 0
    assert_exact(load_merged(tmp_path / "out"), load_reference(ckpt))


CONTRADICTIONS = [
    ("fsdp2_llama_w4", ["--is-value-model"], "--is-value-model, but the checkpoint is a language model"),
    ("megatron_dist_tp2", ["--tie-word-embedding"], "--tie-word-embedding, but config.json has tie_word_embeddings"),
    ("megatron_dist_tp2", ["--num-attention-heads", "32"], "--num-attention-heads 32, but config.json says "
                                                           "num_attention_heads 4"),
    ("megatron_mqa_tp2", ["--num-key-value-heads", "8"], "--num-key-value-heads 8, but config.json says "
                                                         "num_key_value_heads 1"),
    ("fsdp2_llama_w4", ["--backend", "megatron"], "holds a fsdp checkpoint"),
    ("megatron_tp2", ["--backend", "fsdp"], "holds a megatron checkpoint"),
]


@pytest.mark.parametrize(("case", "flags", "words"), CONTRADICTIONS)
def test_contradictions_are_refused_in_one_line(case, flags, words, fsdp_ckpts, megatron_ckpts, tmp_path, capsys):
    ckpt = {**fsdp_ckpts, **megatron_ckpts}[case]
    hf = reference_dir(ckpt) / "huggingface"
    config = ["--hf_model_path", hf] if hf.is_dir() and case.startswith("megatron") else []
    with input_untouched(ckpt):
        assert run("merge", *flags, "--local_dir", ckpt, *config, "--target_dir", tmp_path / "out", "--quiet") == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and words in lines[0], lines
    assert not (tmp_path / "out" / "model.safetensors.index.json").exists()


def test_verl_and_native_spelling_of_one_option_is_refused(fsdp_ckpts, tmp_path, capsys):
    ckpt = fsdp_ckpts["fsdp2_llama_w4"]
    with pytest.raises(SystemExit) as exit_:
        run("merge", "--local_dir", ckpt, "--input", ckpt, "--target_dir", tmp_path / "out")
    assert exit_.value.code == 2
    assert "--local_dir and --input both given" in capsys.readouterr().err


def test_every_verl_flag_is_in_docs_verl_md():
    """docs/verl.md's table has a row for each row of verl_cli.FLAGS, and no row for a flag it lacks."""
    from distmerge.front.verl_cli import FLAGS
    from tests.conftest import REPO

    text = (REPO / "docs" / "verl.md").read_text()
    rows = {line.split("`")[1].split()[0] for line in text.splitlines() if line.startswith("| `--")}
    assert rows == {f.spelling for f in FLAGS}


def test_help_shows_the_native_options_only():
    parsers = build_parser()._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    text = build_parser().format_help() + parsers["merge"].format_help()
    assert "--input" in text and "--local_dir" not in text and "--backend" not in text


def test_help_lists_test_as_verify_in_verls_spelling():
    """`test` is a command of `distmerge --help`, in one line saying what it is (#35); it is parsed as verify."""
    text = build_parser().format_help()
    assert re.search(r"\n    test +verify in verl's spelling: the flags of `python -m\s+verl\.model_merger test`", text)
    native, verl = translate(["test", "--local_dir", "a", "--test_hf_dir", "b"], build_parser())
    assert native[0] == "verify" and verl is not None and verl.command == "test"


# -- verl's `test`: the checkpoint against a Hugging Face model, no model written ------------------------------------


def test_test_passes_on_the_checkpoint_and_writes_nothing(fsdp_ckpts, tmp_path, monkeypatch):
    ckpt = fsdp_ckpts["fsdp2_llama_w4"]
    monkeypatch.chdir(tmp_path)
    with input_untouched(ckpt):
        assert run("test", "--backend", "fsdp", "--local_dir", ckpt, "--test_hf_dir", reference_dir(ckpt)) == 0
    assert list(tmp_path.iterdir()) == []


def test_test_names_the_tensor_that_differs(fsdp_ckpts, tmp_path, capsys, monkeypatch):
    import torch
    from safetensors.torch import load_file, save_file

    ckpt = fsdp_ckpts["fsdp2_llama_w4"]
    ref = shutil.copytree(reference_dir(ckpt), tmp_path / "ref")
    tensors = load_file(ref / "model.safetensors")
    name = "model.layers.1.mlp.down_proj.weight"
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[7] += torch.tensor(1e-2, dtype=tensors[name].dtype)
    save_file(tensors, ref / "model.safetensors", metadata={"format": "pt"})
    work = tmp_path / "cwd"
    work.mkdir()
    monkeypatch.chdir(work)
    assert run("test", "--backend", "fsdp", "--local_dir", ckpt, "--test_hf_dir", ref) != 0
    assert name in capsys.readouterr().out
    assert list(work.iterdir()) == []


def test_test_checks_claims_before_comparing(fsdp_ckpts, tmp_path, capsys):
    """A claim on `test` is checked on the checkpoint itself (verl's test takes the same flags)."""
    ckpt = fsdp_ckpts["fsdp2_llama_w4"]
    assert run("test", "--backend", "fsdp", "--is-value-model", "--local_dir", ckpt, "--test_hf_dir",
               reference_dir(ckpt)) == 1
    assert "--is-value-model, but the checkpoint is a language model" in capsys.readouterr().err


# -- --hf_upload_path: huggingface_hub's API against a hub on 127.0.0.1 --------------------------------------------


def test_upload_sends_the_finished_output(fsdp_ckpts, tmp_path, hub, capsys):
    ckpt = fsdp_ckpts["fsdp2_llama_w4"]
    out = tmp_path / "merged"
    assert run("merge", "--backend", "fsdp", "--local_dir", ckpt, "--target_dir", out, "--hf_upload_path",
               "me/model", "--private", "--quiet") == 0
    (create,) = [json.loads(b) for _, path, b in hub if path == "/api/repos/create"]
    assert (create["organization"], create["name"]) == ("me", "model")
    assert create.get("visibility") == "private" or create.get("private") is True  # huggingface_hub 1.x / older
    sent = committed_files(hub)
    on_disk = {str(p.relative_to(out)): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert sent == {k: v for k, v in on_disk.items() if not k.startswith(".distmerge/")}
    assert "model.safetensors.index.json" in sent


def test_upload_to_an_unreachable_hub_is_one_line(fsdp_ckpts, tmp_path, monkeypatch, capsys):
    from tests.conftest import free_port

    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{free_port()}")  # nothing listens there
    monkeypatch.setenv("HF_TOKEN", "hf_test")
    ckpt = fsdp_ckpts["fsdp2_llama_w4"]
    assert run("merge", "--local_dir", ckpt, "--target_dir", tmp_path / "out", "--hf_upload_path", "me/model",
               "--quiet") == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "cannot reach the Hugging Face Hub" in lines[0], lines
    assert (tmp_path / "out" / "model.safetensors.index.json").is_file()  # the merge itself is complete


def test_upload_without_huggingface_hub_says_what_to_install(fsdp_ckpts, tmp_path, monkeypatch, capsys):
    import sys

    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # `import huggingface_hub` raises ImportError
    ckpt = fsdp_ckpts["fsdp2_llama_w4"]
    assert run("merge", "--local_dir", ckpt, "--target_dir", tmp_path / "out", "--hf_upload_path", "me/model",
               "--quiet") == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "pip install 'distmerge[hub]'" in lines[0], lines

"""End to end on real Megatron-LM checkpoints saved by megatron-core (legacy mp_rank_* files and torch_dist
folders, see tests/fixtures/make_megatron.py): exact tensors under Hugging Face names, from_pretrained
logits, N-independence, and the folder layouts verl writes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from distmerge.input import source
from tests.conftest import (
    assert_exact,
    assert_reference_logits,
    load_merged,
    load_reference,
    merge_inproc,
    reference_dir,
    torchrun,
    tree_bytes,
)

# Llama (GQA), Qwen2 (qkv bias, tied embeddings, padded vocab), Qwen3 (q/k norm, head_dim != hidden/heads),
# Qwen3-MoE (4 experts), Qwen2-MoE (shared expert with its gate), Mixtral (block_sparse_moe names),
# Llama with one key/value head at TP=2 (a query group spans both TP ranks);
# TP, TP x PP, virtual pipeline stages, expert parallelism with and without TP.
LEGACY = ["megatron_tp2", "megatron_tp2pp2", "megatron_qwen2_tp2", "megatron_qwen3_tp2", "megatron_vpp",
          "megatron_moe_ep2", "megatron_moe_tp2ep2", "megatron_mqa_tp2", "megatron_qwen2_moe_tp2"]
DIST = ["megatron_dist_tp2", "megatron_dist_tp2pp2", "megatron_dist_qwen2_tp2pp2", "megatron_dist_qwen3_tp2",
        "megatron_dist_moe_ep2", "megatron_dist_vpp", "megatron_dist_mixtral_ep2"]
CASES = LEGACY + DIST


def hf_config(ckpt: Path) -> Path:
    return reference_dir(ckpt) / "huggingface"


def merge_megatron(ckpt: Path, out: Path, *extra: str) -> int:
    return merge_inproc("--input", ckpt, "--output", out, "--hf-config", hf_config(ckpt), *extra)


@pytest.fixture(scope="module")
def megatron_merged(megatron_ckpts, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("megatron_merged")
    for case in CASES:
        assert merge_megatron(megatron_ckpts[case], root / case) == 0, case
    return {case: root / case for case in CASES}


@pytest.mark.parametrize("case", CASES)
def test_megatron_merged_equals_reference(case, megatron_ckpts, megatron_merged):
    assert_exact(load_merged(megatron_merged[case]), load_reference(megatron_ckpts[case]))


@pytest.mark.parametrize("case", ["megatron_tp2pp2", "megatron_dist_tp2", "megatron_qwen2_tp2", "megatron_vpp",
                                  "megatron_dist_qwen3_tp2", "megatron_moe_tp2ep2", "megatron_dist_moe_ep2",
                                  "megatron_mqa_tp2", "megatron_qwen2_moe_tp2", "megatron_dist_mixtral_ep2"])
def test_megatron_from_pretrained_gives_reference_logits(case, megatron_ckpts, megatron_merged):
    assert_reference_logits(megatron_merged[case], megatron_ckpts[case])


def test_megatron_dtype_cast(megatron_ckpts, tmp_path):
    ckpt = megatron_ckpts["megatron_tp2pp2"]
    assert merge_megatron(ckpt, tmp_path / "out", "--dtype", "bf16") == 0
    merged = load_merged(tmp_path / "out")
    for key, ref in load_reference(ckpt).items():
        assert torch.equal(merged[key], ref.to(torch.bfloat16)), key


@pytest.mark.torchrun
@pytest.mark.parametrize("case", ["megatron_tp2pp2", "megatron_dist_tp2pp2", "megatron_moe_tp2ep2"])
def test_megatron_torchrun_output_is_byte_identical(case, megatron_ckpts, tmp_path):
    ckpt = megatron_ckpts[case]
    args = ["--input", ckpt, "--hf-config", hf_config(ckpt), "--max-shard-size", "150KB", "--quiet"]
    assert merge_inproc(*args[:-1], "--output", tmp_path / "n1", "--json-summary", tmp_path / "s1.json") == 0
    run = torchrun(2, "merge", *args, "--output", tmp_path / "n2", "--json-summary", tmp_path / "s2.json")
    assert run.returncode == 0, run.stderr[-3000:]
    one, two = tree_bytes(tmp_path / "n1"), tree_bytes(tmp_path / "n2")
    assert len([n for n in one if n.endswith(".safetensors")]) > 2
    assert one == two
    summaries = [json.loads((tmp_path / name).read_text()) for name in ("s1.json", "s2.json")]
    read = [sum(r["bytes_read"] for r in s["ranks"]) for s in summaries]
    inputs = sum(p.stat().st_size for p in (ckpt / "iter_0000001").rglob("*") if p.is_file())
    # every output byte is read, none twice; one process also skips the vocabulary padding of the files it
    # copies in the kernel, while a sent fragment travels whole
    assert summaries[0]["total_bytes"] <= read[0] <= read[1] < inputs


def save_folder(ckpt: Path) -> Path:
    return ckpt / "iter_0000001"


@pytest.mark.parametrize(("nested", "hf_name"), [("dist_ckpt", "huggingface"), ("model/dist_ckpt", "huggingface"),
                                                ("dist_ckpt", "hf_config_and_tokenizer")])
def test_verl_torch_dist_layouts(nested, hf_name, megatron_ckpts, tmp_path):
    """verl: actor/dist_ckpt/ + actor/huggingface/, and the newer actor/model/{dist_ckpt,huggingface}/."""
    ckpt = megatron_ckpts["megatron_dist_tp2pp2"]
    actor = tmp_path / "actor"
    shutil.copytree(save_folder(ckpt), actor / nested)
    shutil.copytree(hf_config(ckpt), actor / nested / ".." / hf_name)
    assert merge_inproc("--input", actor, "--output", tmp_path / "out") == 0
    assert_exact(load_merged(tmp_path / "out"), load_reference(ckpt))
    assert json.loads((tmp_path / "out" / "config.json").read_text())["model_type"] == "llama"


def test_verl_legacy_model_pt(megatron_ckpts, tmp_path):
    """Older verl saves model.pt in each mp_rank_* folder and no tracker file: pass the save folder."""
    ckpt = megatron_ckpts["megatron_tp2pp2"]
    save = shutil.copytree(save_folder(ckpt), tmp_path / "actor")
    for path in save.glob("mp_rank_*/model_optim_rng.pt"):
        path.rename(path.with_name("model.pt"))
    shutil.copytree(hf_config(ckpt), save / "huggingface")
    assert merge_inproc("--input", save, "--output", tmp_path / "out") == 0
    assert_exact(load_merged(tmp_path / "out"), load_reference(ckpt))


def test_iteration_option_and_tracker(megatron_ckpts, tmp_path, capsys):
    original = megatron_ckpts["megatron_tp2"]
    ckpt = Path(shutil.copytree(original, tmp_path / "ckpt"))
    config = ["--hf-config", hf_config(original)]
    (ckpt / "latest_checkpointed_iteration.txt").write_text("7")
    assert merge_inproc("--input", ckpt, "--output", tmp_path / "bad", *config) == 1
    assert "has no iter_0000007/ (iterations found: iter_0000001)" in capsys.readouterr().err
    assert merge_inproc("--input", ckpt, "--output", tmp_path / "out", *config, "--iteration", "1") == 0
    assert_exact(load_merged(tmp_path / "out"), load_reference(original))
    (ckpt / "latest_checkpointed_iteration.txt").unlink()
    assert merge_inproc("--input", ckpt, "--output", tmp_path / "none", *config) == 1
    assert "pass --iteration N (found iter_0000001)" in capsys.readouterr().err
    (ckpt / "iter_0000001").rename(ckpt / "release")  # a converted checkpoint: tracker says "release"
    (ckpt / "latest_checkpointed_iteration.txt").write_text("release")
    assert merge_inproc("--input", ckpt, "--output", tmp_path / "release", *config) == 0
    assert_exact(load_merged(tmp_path / "release"), load_reference(original))


def test_inspect_megatron(megatron_ckpts, capsys):
    from distmerge.front.cli import main

    ckpt = megatron_ckpts["megatron_tp2pp2"]
    assert main(["inspect", str(ckpt), "--hf-config", str(hf_config(ckpt)), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["format"] == "megatron" and info["world_size"] == 4
    assert info["tensors"] == len(load_reference(ckpt))
    assert any("TP=2 x PP=2" in n for n in info["notes"])
    assert any("1024 -> 1001" in n for n in info["notes"])


@pytest.mark.parametrize(("case", "second"), [("megatron_tp2pp2", "pp"), ("megatron_moe_ep2", "ep")])
def test_mp_rank_tt_nnn_without_args(case, second, megatron_ckpts, monkeypatch):
    """mp_rank_00_001: stage 1 or expert rank 1? Without `args`, the word embeddings tell (stage 0 only)."""
    from distmerge.formats.megatron import grid as megatron_grid

    monkeypatch.setattr(megatron_grid, "_args", lambda value: None)
    save = save_folder(megatron_ckpts[case])
    grid = megatron_grid.resolve_grid(source.looking_at(save), save)
    assert (grid.pp, grid.ep) == ((2, 1) if second == "pp" else (1, 2))


def test_replicas_that_drifted_apart_are_reported(megatron_ckpts, tmp_path):
    """A norm whose TP copies differ (a sequence-parallel run that did not all-reduce its grads): the merge
    keeps TP rank 0's copy, as Megatron's converters do, and says so; equal copies say nothing."""
    original = megatron_ckpts["megatron_tp2pp2"]
    ckpt = Path(shutil.copytree(original, tmp_path / "ckpt"))
    path = save_folder(ckpt) / "mp_rank_01_000" / "model_optim_rng.pt"
    state = torch.load(path, weights_only=False)  # megatron-core is importable here, as in the run that saved it
    state["model"]["decoder.layers.0.input_layernorm.weight"][3] += 1e-3
    torch.save(state, path)
    config = ["--hf-config", hf_config(original)]
    notes = {}
    for folder, out in ((ckpt, "drifted"), (original, "clean")):
        summary = tmp_path / f"{out}.json"
        assert merge_inproc("--input", folder, "--output", tmp_path / out, *config, "--json-summary", summary) == 0
        assert_exact(load_merged(tmp_path / out), load_reference(original))
        notes[out] = [n for n in json.loads(summary.read_text())["notes"] if "replicated copies differ" in n]
    assert notes["clean"] == []
    assert len(notes["drifted"]) == 1 and "1 tensor(s) (decoder.layers.0.input_layernorm.weight)" in notes["drifted"][0]


def test_one_rank_folder_is_not_the_checkpoint(megatron_ckpts, tmp_path, capsys):
    ckpt = megatron_ckpts["megatron_tp2"]
    rank = save_folder(ckpt) / "mp_rank_01"
    assert merge_inproc("--input", rank, "--output", tmp_path / "out", "--hf-config", hf_config(ckpt)) == 1
    assert "one rank's folder of a Megatron save: pass the folder that holds the mp_rank_*" in capsys.readouterr().err


def test_readers_are_spread_by_what_each_rank_file_is_read_for(megatron_ckpts, tmp_path):
    """An expert rank > 0 file repeats expert rank 0's dense tensors, which the plan reads from the lowest file
    only: the scan says what each file is read for (InputFile.reads), and readers are spread by that. Its sum is
    what a merge reads (within the small replica checks). Shown failing with _expected_reads returning the file
    unchanged (reads -1: every file weighed by its whole size)."""
    from distmerge.formats.registry import get

    ckpt = megatron_ckpts["megatron_moe_tp2ep2"]
    scan = get("megatron").scan(source.looking_at(ckpt), {})
    by_ep = {}
    for f in scan.files:
        by_ep.setdefault(scan.state.grid.coords[f.path][2], []).append(f)
    assert all(0 < f.reads < f.size for f in by_ep[1]), by_ep[1]
    assert min(f.reads for f in by_ep[0]) > 4 * max(f.reads for f in by_ep[1])  # experts only, beyond EP rank 0
    summary = tmp_path / "summary.json"
    hf = reference_dir(ckpt) / "huggingface"
    assert merge_inproc("--input", ckpt, "--output", tmp_path / "out", "--hf-config", hf,
                        "--json-summary", summary) == 0
    read = sum(r["bytes_read"] for r in json.loads(summary.read_text())["ranks"])
    assert read <= sum(f.reads for f in scan.files) <= 1.05 * read

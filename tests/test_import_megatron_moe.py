"""`distmerge import --to megatron --ep E` of MoE models (Qwen3-MoE, Qwen2-MoE with its gated shared expert,
Mixtral), judged by megatron-core: each folder loads strictly into a GPTModel with MoE layers (SequentialMLP experts)
at the written TP x PP x EP and at TP = PP = EP = 1, every parameter as megatron-core's recipe lays out the source
(tests/fixtures/megatron_moe.py: EP rank r holds experts r E/EP .. (r+1) E/EP - 1, split by the expert TP), and its
`.metadata` has the keys, shapes and chunks of megatron-core's own save of the loaded model. Merged back, each is
the source byte for byte; two processes write the bytes one writes; an EP the model cannot have is refused in one
line with nothing written."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import input_untouched, load_merged, merge_inproc, reference_dir, torchrun
from tests.fixtures import megatron_models as mm
from tests.helpers.importing import folder_bytes, import_inproc, load_with, padded_vocab

# (family, TP, PP, EP) each model is imported at: one expert per EP rank; over EP with the expert TP = TP = 2 and a
# shared expert split by TP; over EP with two pipeline stages (Mixtral's block_sparse_moe.experts.{e}.w1/w3/w2)
WRITTEN = (("qwen3_moe", 1, 1, 4), ("qwen2_moe", 2, 1, 2), ("mixtral", 1, 2, 2))
LOAD_WORLD = 4  # one megatron-core job: TP x PP x EP of each case divides it
# Any input (#45 item 3): megatron-core's legacy save (mp_rank_*) of Qwen3-MoE at TP=2 x EP=2, written as torch_dist
# at TP=1 x EP=4 by one command; its source is the fixture's reference (the model.safetensors it was made from)
LEGACY = "megatron_moe_tp2ep2"
LEGACY_LAYOUT = ("qwen3_moe", 1, 1, 4)


def written_name(family: str, tp: int, pp: int, ep: int) -> str:
    return f"{family}_tp{tp}pp{pp}ep{ep}"


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory) -> dict[str, Path]:
    """The fixtures' seeded tiny MoE models, as save_pretrained writes them (per-expert Hub names)."""
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for family, *_ in WRITTEN:
        out[family] = root / family
        mm.build_hf_model(mm.FAMILIES[family]).save_pretrained(out[family], safe_serialization=True)
    return out


@pytest.fixture(scope="module")
def imported(hf_models, tmp_path_factory) -> dict[str, Path]:
    """Each model imported by one process at its WRITTEN layout; the input left as it was."""
    root = tmp_path_factory.mktemp("imported")
    out = {}
    for family, tp, pp, ep in WRITTEN:
        name = written_name(family, tp, pp, ep)
        out[name] = root / name
        with input_untouched(hf_models[family]):
            assert import_inproc("--input", hf_models[family], "--output", out[name], "--tp", tp, "--pp", pp,
                                 "--ep", ep) == 0
    return out


def at_written(family: str, tp: int, pp: int, ep: int, imported: dict, hf_models: dict) -> str:
    return f"{family}:{tp}:{pp}:{ep}:{imported[written_name(family, tp, pp, ep)]}:{hf_models[family]}:save"


def at_one(family: str, tp: int, pp: int, ep: int, imported: dict, hf_models: dict) -> str:
    return f"{family}:1:1:1:{imported[written_name(family, tp, pp, ep)]}:{hf_models[family]}"


@pytest.fixture(scope="module")
def from_legacy(megatron_ckpts, tmp_path_factory) -> Path:
    """The legacy save imported at LEGACY_LAYOUT by one process, config.json from the fixture's reference."""
    out = tmp_path_factory.mktemp("from_legacy") / "imported"
    _, tp, pp, ep = LEGACY_LAYOUT
    with input_untouched(megatron_ckpts[LEGACY], reference_dir(megatron_ckpts[LEGACY])):
        assert import_inproc("--input", megatron_ckpts[LEGACY], "--output", out, "--tp", tp, "--pp", pp, "--ep", ep,
                             "--hf-config", reference_dir(megatron_ckpts[LEGACY]) / "huggingface") == 0
    return out


def legacy_cases(from_legacy: Path, megatron_ckpts: dict) -> tuple[str, str]:
    """The legacy import's cases: at its written layout (with megatron-core's own save), and at 1 x 1 x 1."""
    family, tp, pp, ep = LEGACY_LAYOUT
    source = reference_dir(megatron_ckpts[LEGACY])
    return f"{family}:{tp}:{pp}:{ep}:{from_legacy}:{source}:save", f"{family}:1:1:1:{from_legacy}:{source}"


@pytest.fixture(scope="module")
def loads(imported, hf_models, from_legacy, megatron_ckpts, tmp_path_factory) -> dict:
    """Every folder loaded by megatron-core at its written layout and at TP = PP = EP = 1: one torchrun job."""
    cases = [make(*w, imported, hf_models) for w in WRITTEN for make in (at_written, at_one)]
    cases += legacy_cases(from_legacy, megatron_ckpts)
    return load_with("load_megatron_import.py", LOAD_WORLD, cases, tmp_path_factory.mktemp("loads") / "result.json")


@pytest.mark.parametrize(("family", "tp", "pp", "ep"), WRITTEN)
def test_megatron_core_loads_it_at_the_written_layout(loads, imported, hf_models, family, tp, pp, ep):
    """Strict load with EP ranks holding their experts, every parameter as the recipe lays out the source, the
    args Megatron-LM reads, and the keys, shapes and chunks of megatron-core's own save."""
    got = loads[at_written(family, tp, pp, ep, imported, hf_models)]
    assert got["mismatched"] == []
    assert got["checked"] > 0
    padded = padded_vocab(mm.FAMILIES[family].hf["vocab_size"], tp, 128)
    assert got["args"] == {"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp,
                           "expert_model_parallel_size": ep, "padded_vocab_size": padded, "num_layers": 2,
                           "num_experts": 4}
    assert got["layout_differs"] == []


@pytest.mark.parametrize(("family", "tp", "pp", "ep"), WRITTEN)
def test_megatron_core_loads_it_without_parallelism(loads, imported, hf_models, family, tp, pp, ep):
    """The experts of every EP rank, TP shards and stages, put together by megatron-core's load into one model."""
    got = loads[at_one(family, tp, pp, ep, imported, hf_models)]
    assert got["mismatched"] == [] and got["checked"] > 0


@pytest.mark.parametrize(("family", "tp", "pp", "ep"), WRITTEN)
def test_merged_back_it_is_the_source(imported, hf_models, tmp_path, family, tp, pp, ep):
    out = tmp_path / "merged"
    folder = imported[written_name(family, tp, pp, ep)]
    assert merge_inproc("--input", folder, "--output", out, "--hf-config", hf_models[family]) == 0
    merged, source = load_merged(out), load_file(str(hf_models[family] / "model.safetensors"))
    assert sorted(merged) == sorted(source)
    for name, tensor in source.items():
        assert merged[name].dtype == tensor.dtype and torch.equal(merged[name], tensor), name
    assert (out / "model.safetensors").read_bytes() == (hf_models[family] / "model.safetensors").read_bytes()


def test_two_processes_write_what_one_writes(imported, hf_models, tmp_path):
    """TP=2 x EP=2: four training ranks' files, each rank's experts in its own; the same bytes from N=2."""
    family, tp, pp, ep = WRITTEN[1]
    two = tmp_path / "n2"
    done = torchrun(2, "import", "--quiet", "--input", str(hf_models[family]), "--output", str(two), "--tp", str(tp),
                    "--pp", str(pp), "--ep", str(ep))
    assert done.returncode == 0, done.stderr[-3000:]
    written = folder_bytes(imported[written_name(family, tp, pp, ep)])
    assert sorted(written) == ["latest_checkpointed_iteration.txt", "release/.metadata", "release/__0_0.distcp",
                               "release/__1_0.distcp", "release/__2_0.distcp", "release/__3_0.distcp",
                               "release/common.pt", "release/metadata.json"]
    assert folder_bytes(two) == written


@pytest.mark.parametrize(("family", "ep", "words"), [
    ("qwen3_moe", 3, "--ep 3 does not divide the model's 4 experts"),
    ("qwen3_moe", 8, "--ep 8 does not divide the model's 4 experts"),
    ("llama", 2, "--ep 2: the model has no experts to split"),
])
def test_an_ep_the_model_cannot_have_is_refused(hf_models, tmp_path, capsys, family, ep, words):
    source = hf_models.get(family)
    if source is None:
        source = tmp_path / family
        mm.build_hf_model(mm.FAMILIES[family]).save_pretrained(source, safe_serialization=True)
    out = tmp_path / "out"
    assert import_inproc("--input", source, "--output", out, "--ep", ep) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0], err
    assert not out.exists()


def test_a_model_mixing_dense_and_moe_layers_is_refused(tmp_path, capsys):
    """Qwen3-MoE's mlp_only_layers make layer 1 dense: megatron-core saves such a decoder layer by layer, which
    the import does not write yet."""
    fam = mm.FAMILIES["qwen3_moe"]
    mixed = mm.Family(fam.name, fam.config_class, dict(fam.hf, mlp_only_layers=[1]), qk_norm=True)
    mm.build_hf_model(mixed).save_pretrained(tmp_path / "mixed", safe_serialization=True)
    assert import_inproc("--input", tmp_path / "mixed", "--output", tmp_path / "out", "--ep", 2) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "mixing dense and MoE layers cannot be imported yet" in err[0], err
    assert not (tmp_path / "out").exists()


def test_a_legacy_save_is_written_at_another_layout(loads, from_legacy, megatron_ckpts):
    """A Megatron legacy TP=2 x EP=2 save in, torch_dist at TP=1 x EP=4 out: megatron-core loads it strictly at
    that layout and at 1 x 1 x 1, every parameter the source's, laid out as its own save lays it out."""
    written, single = (loads[c] for c in legacy_cases(from_legacy, megatron_ckpts))
    assert written["mismatched"] == [] and written["checked"] > 0 and written["layout_differs"] == []
    assert written["args"]["expert_model_parallel_size"] == 4 and written["args"]["tensor_model_parallel_size"] == 1
    assert single["mismatched"] == [] and single["checked"] > 0


def test_a_legacy_save_imported_merges_back_to_its_source(from_legacy, megatron_ckpts, tmp_path):
    """Merged back, the import of the legacy save is the model the save was made from, byte for byte; the folder
    the checkpoint was merged into on the way is gone."""
    source = reference_dir(megatron_ckpts[LEGACY])
    out = tmp_path / "merged"
    assert merge_inproc("--input", from_legacy, "--output", out, "--hf-config", source / "huggingface") == 0
    assert (out / "model.safetensors").read_bytes() == (source / "model.safetensors").read_bytes()
    assert sorted(p.name for p in from_legacy.parent.iterdir()) == ["imported"]


def test_a_legacy_save_two_processes_write_what_one_writes(from_legacy, megatron_ckpts, tmp_path):
    """Under torchrun the checkpoint is merged by both processes, then imported by both: the bytes of one."""
    _, tp, pp, ep = LEGACY_LAYOUT
    two = tmp_path / "n2"
    done = torchrun(2, "import", "--quiet", "--input", str(megatron_ckpts[LEGACY]), "--output", str(two),
                    "--hf-config", str(reference_dir(megatron_ckpts[LEGACY]) / "huggingface"), "--tp", str(tp),
                    "--pp", str(pp), "--ep", str(ep))
    assert done.returncode == 0, done.stderr[-3000:]
    assert folder_bytes(two) == folder_bytes(from_legacy)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["n2"]


def no_reading(monkeypatch) -> None:
    """The checkpoint may not be discovered in this process: a refusal must come before the import reads it."""
    from distmerge.errors import InputError

    def refused(*args, **kwargs):
        raise InputError("the checkpoint was read before the refusal")

    monkeypatch.setattr("distmerge.importer.source.discover_inputs", refused)


@pytest.mark.parametrize(("args", "words"), [
    (("--ep", "3"), "--ep 3 does not divide the model's 4 experts"),
    (("--tp", "3"), "--tp 3 does not divide the model's 4 attention heads"),
])
def test_a_legacy_save_at_a_layout_it_cannot_have_is_refused_before_it_is_read(megatron_ckpts, tmp_path, capsys,
                                                                              monkeypatch, args, words):
    """config.json (--hf-config) decides these before the checkpoint is read (a reading here would fail the test
    in other words): no output."""
    no_reading(monkeypatch)
    out = tmp_path / "out"
    config = reference_dir(megatron_ckpts[LEGACY]) / "huggingface"
    assert import_inproc("--input", megatron_ckpts[LEGACY], "--output", out, "--hf-config", config, *args) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0], err
    assert list(tmp_path.iterdir()) == []


def test_a_legacy_save_into_a_folder_in_use_is_refused_before_it_is_read(megatron_ckpts, tmp_path, capsys,
                                                                        monkeypatch):
    no_reading(monkeypatch)
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("someone's work")
    assert import_inproc("--input", megatron_ckpts[LEGACY], "--output", out, "--hf-config",
                         reference_dir(megatron_ckpts[LEGACY]) / "huggingface") == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is not empty: pass --overwrite" in err[0], err
    assert list(tmp_path.iterdir()) == [out] and [p.name for p in out.iterdir()] == ["notes.txt"]

"""`distmerge import --to megatron`, judged by megatron-core itself: the folder loads strictly into its GPTModel at
TP=1 and at the written TP x PP (tests/fixtures/load_megatron_import.py: dist_checkpointing.load, every parameter
equal to Megatron's documented layout of the source tensors), merges back to the source byte for byte, is the
same folder for N=1 and N=2, and a model or a TP it cannot be is refused in one line with nothing written.
Every dense family is also written at TP=2 x PP=2; megatron-core loads all the folders in one job of 4 processes."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from distmerge import catalog
from distmerge.families import transforms as tf
from distmerge.output import lock
from distmerge.output.names import LOCK
from tests.conftest import input_untouched, load_merged, merge_inproc, torchrun
from tests.fixtures import megatron_models as mm
from tests.helpers.importing import folder_bytes, import_inproc, load_with, padded_vocab

# (family, TP, PP) each model is imported at: GQA (4 heads, 2 groups) split over TP; tied embeddings and q/k/v
# biases over two pipeline stages; q/k layernorm with a head_dim that is not hidden/heads; and every family at
# TP=2 x PP=2 together (a stage's layers each split over TP, the tied embedding's copy on the last stage)
WRITTEN = (("llama", 2, 1), ("qwen2", 1, 2), ("qwen3", 2, 1), ("llama", 2, 2), ("qwen2", 2, 2), ("qwen3", 2, 2))
FAMILIES = sorted({f for f, _, _ in WRITTEN})
# --make-vocab-size-divisible-by, where not Megatron-LM's default 128: 96 x TP=2 pads 1001 rows to 1152 (96 alone,
# forgetting TP, would give 1056)
DIVISIBLE_BY = {"qwen3": 96}
LOAD_WORLD = 4  # one megatron-core job loads every case: TP x PP of each divides it, the rest is data parallel




def written_name(family: str, tp: int, pp: int) -> str:
    return f"{family}_tp{tp}pp{pp}"


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory) -> dict[str, Path]:
    """The fixtures' seeded tiny transformers models, as save_pretrained writes them."""
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for family in FAMILIES:
        out[family] = root / family
        mm.build_hf_model(mm.FAMILIES[family]).save_pretrained(out[family], safe_serialization=True)
    return out




@pytest.fixture(scope="module")
def imported(hf_models, tmp_path_factory) -> dict[str, Path]:
    """Each model imported by one process at each of its WRITTEN layouts; the input left as it was."""
    root = tmp_path_factory.mktemp("imported")
    out = {}
    for family, tp, pp in WRITTEN:
        name = written_name(family, tp, pp)
        out[name] = root / name
        with input_untouched(hf_models[family]):
            assert import_inproc("--input", hf_models[family], "--output", out[name], "--tp", tp, "--pp", pp,
                                 "--make-vocab-size-divisible-by", DIVISIBLE_BY.get(family, 128)) == 0
    return out




def at_written(family: str, tp: int, pp: int, imported: dict[str, Path], hf_models: dict[str, Path]) -> str:
    """The case that loads the folder at the layout it was written for, and compares it with megatron-core's own
    save of the loaded model."""
    return f"{family}:{tp}:{pp}:1:{imported[written_name(family, tp, pp)]}:{hf_models[family]}:save"


def at_tp1(family: str, tp: int, pp: int, imported: dict[str, Path], hf_models: dict[str, Path]) -> str:
    return f"{family}:1:1:1:{imported[written_name(family, tp, pp)]}:{hf_models[family]}"


@pytest.fixture(scope="module")
def loads(imported, hf_models, tmp_path_factory) -> dict:
    """Every folder loaded by megatron-core at its written layout and at TP=1 x PP=1: one torchrun job."""
    cases = [make(*w, imported, hf_models) for w in WRITTEN for make in (at_written, at_tp1)]
    return load_with("load_megatron_import.py", LOAD_WORLD, cases, tmp_path_factory.mktemp("loads") / "result.json")


@pytest.mark.parametrize(("family", "tp", "pp"), WRITTEN)
def test_megatron_core_loads_it_at_the_written_layout(loads, imported, hf_models, family, tp, pp):
    """Strict load, every parameter as the recipe lays out the source, the args Megatron-LM reads, and the same
    keys, shapes and chunks as megatron-core's own save of the model."""
    got = loads[at_written(family, tp, pp, imported, hf_models)]
    assert got["mismatched"] == []
    assert got["checked"] > 0
    padded = padded_vocab(mm.FAMILIES[family].hf["vocab_size"], tp, DIVISIBLE_BY.get(family, 128))
    assert got["args"] == {"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp,
                           "expert_model_parallel_size": 1, "padded_vocab_size": padded, "num_layers": 2,
                           "num_experts": None}
    assert got["layout_differs"] == []


@pytest.mark.parametrize(("family", "tp", "pp"), WRITTEN)
def test_megatron_core_loads_it_at_tp1(loads, imported, hf_models, family, tp, pp):
    """A torch_dist save reshards on load: each folder loads into one TP=1 x PP=1 model."""
    got = loads[at_tp1(family, tp, pp, imported, hf_models)]
    assert got["mismatched"] == [] and got["checked"] > 0


@pytest.mark.parametrize(("family", "tp", "pp"), WRITTEN)
def test_merged_back_it_is_the_source(imported, hf_models, tmp_path, family, tp, pp):
    out = tmp_path / "merged"
    folder = imported[written_name(family, tp, pp)]
    assert merge_inproc("--input", folder, "--output", out, "--hf-config", hf_models[family]) == 0
    merged, source = load_merged(out), load_file(str(hf_models[family] / "model.safetensors"))
    assert sorted(merged) == sorted(source)
    for name, tensor in source.items():
        assert merged[name].dtype == tensor.dtype and torch.equal(merged[name], tensor), name




def test_two_processes_write_what_one_writes(hf_models, tmp_path):
    one, two = tmp_path / "n1", tmp_path / "n2"
    args = ("--input", hf_models["llama"], "--tp", "2", "--pp", "2")
    assert import_inproc(*args, "--output", one) == 0
    done = torchrun(2, "import", "--quiet", *map(str, args), "--output", str(two))
    assert done.returncode == 0, done.stderr[-3000:]
    written = folder_bytes(one)
    assert sorted(written) == ["latest_checkpointed_iteration.txt", "release/.metadata", "release/__0_0.distcp",
                               "release/__1_0.distcp", "release/__2_0.distcp", "release/__3_0.distcp",
                               "release/common.pt", "release/metadata.json"]
    assert folder_bytes(two) == written


@pytest.mark.parametrize(("tp", "pp", "words"), [
    (3, 1, "--tp 3 does not divide the model's 4 attention heads"),
    (4, 1, "--tp 4 does not divide the model's 2 query groups"),
    (1, 3, "--pp 3 does not divide the model's 2 layers"),
])
def test_a_layout_the_model_cannot_have_is_refused(hf_models, tmp_path, capsys, tp, pp, words):
    out = tmp_path / "out"
    assert import_inproc("--input", hf_models["llama"], "--output", out, "--tp", tp, "--pp", pp) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0], err
    assert not out.exists()


def test_an_output_in_use_is_refused_with_what_import_takes(hf_models, tmp_path, capsys):
    """A folder holding files, then one holding the lock of an import that is gone: one line each, naming
    --overwrite, which import has, never merge's --resume, which it has not; nothing written."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("not ours")
    gone = dataclasses.replace(lock.this_process(str(hf_models["llama"])), pid=2**22 + 1, pid_start="0")
    for leftover in ("notes.txt", LOCK):
        if leftover == LOCK:
            (out / "notes.txt").unlink()
            (out / LOCK).write_bytes(gone.encode())
        before = sorted(p.name for p in out.iterdir())
        assert import_inproc("--input", hf_models["llama"], "--output", out, "--tp", "2") == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "--overwrite" in err[0] and "--resume" not in err[0], err
        assert sorted(p.name for p in out.iterdir()) == before


def test_a_folder_that_is_not_a_model_is_refused(tmp_path, capsys):
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "README.md").write_text("not a model")
    assert import_inproc("--input", tmp_path / "notes", "--output", tmp_path / "out") == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"distmerge: error: {tmp_path / 'notes'} is not a Hugging Face model folder: it has no config.json"]
    assert not (tmp_path / "out").exists()


def test_each_inverse_undoes_its_transform():
    """The import's inverses (catalog.INVERSES) against the export's transforms: forward(inverse(x)) == x, and a
    block of target rows read through `narrow` equals the same rows of the whole target."""
    from distmerge.families.megatron.transforms import MlaRopeHalves, SplitGateUp, SplitQkv

    catalog.install()
    gen = torch.Generator().manual_seed(0)
    cases = [("split_qkv", [(16, 3), (4, 3), (4, 3)], SplitQkv(heads=8, groups=2, head_dim=2), {}),
             ("split_gate_up", [(6, 3), (6, 3)], SplitGateUp(shards=1), {}),
             ("split_gate_up", [(6, 3), (6, 3)], SplitGateUp(shards=3), {}),
             ("trim_rows", [(5, 3)], tf.TrimRows(rows=5), {"padded": 8}),
             ("identity", [(5, 3)], tf.NO_PARAMS, {}),
             ("mla_rope_halves", [(2 * (3 + 4), 3)], MlaRopeHalves(heads=2, keep=3, rope=4), {})]
    for name, shapes, params, extra in cases:
        sources = [torch.randn(s, generator=gen) for s in shapes]
        segments = tf.inverse_segments(name, tuple(s[0] for s in shapes), params, **extra)
        fused = tf.gather_rows(sources, segments)
        assert all(torch.equal(a, b) for a, b in zip(tf.apply(name, [fused], params), sources, strict=True)), name
        for lo, hi in ((0, 1), (1, fused.shape[0] - 1), (2, fused.shape[0])):
            assert torch.equal(tf.gather_rows(sources, tf.narrow(segments, lo, hi)), fused[lo:hi]), (name, lo, hi)


def test_metadata_bytes_depend_only_on_the_entries():
    """pickle writes a string once and refers back to it where the same object comes again: entries that share
    their key strings (made by one process) and entries with equal copies (gathered from several) must still
    give the same `.metadata` bytes (N=2 writes what N=1 writes)."""
    from distmerge.formats.torch_private.dcp import write as dcp

    def entries(key_of) -> list:
        return [dcp.Entry(key=key_of(), file=f"__{i}_0.distcp", offset=0, length=8, dtype=torch.float32,
                          global_shape=(2, 4), offsets=(i, 0), lengths=(1, 4)) for i in range(2)]

    shared = "decoder.layers.mlp.linear_fc2.weight"
    copies = [entries(lambda: shared), entries(lambda: "".join(["decoder.layers.", "mlp.linear_fc2.weight"]))]
    assert copies[0][0].key is copies[0][1].key and copies[1][0].key is not copies[1][1].key
    assert dcp.metadata_bytes(copies[0]) == dcp.metadata_bytes(copies[1])

"""`distmerge import --to megatron` of DeepSeek-V3: multi-latent attention (q/kv LoRA projections and their norms),
a dense first layer before MoE layers (sigmoid routing with the router's expert bias, a shared expert), and a
multi-token prediction layer. Judged by megatron-core: each folder loads strictly into a GPTModel built with the
MLA spec (tests/fixtures/load_megatron_import_mla.py, its own recipe) at the written TP x PP x EP and at 1 x 1 x 1,
every parameter the source's, and its `.metadata` has the keys, shapes and chunks of megatron-core's own save of
the loaded model. Merged back, each folder is the source byte for byte; two processes write the bytes one writes; a
TP that does not divide the heads is refused in one line with nothing written.

The source: tests/helpers/importing.save_tiny_deepseek_v3, a seeded tiny DeepseekV3ForCausalLM saved by
save_pretrained plus one MTP layer under the names of DeepSeek-V3's published checkpoint.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.conftest import input_untouched, merge_inproc, torchrun
from tests.helpers.importing import folder_bytes, import_inproc, load_with, padded_vocab, save_tiny_deepseek_v3

# (TP, PP, EP) the model is imported at: whole; experts over EP beside TP; TP x PP with the MTP layer on the last
# stage
WRITTEN = ((1, 1, 1), (2, 1, 2), (2, 2, 1))
LOAD_WORLD = 4


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    return save_tiny_deepseek_v3(tmp_path_factory.mktemp("hf") / "deepseek_v3")


@pytest.fixture(scope="module")
def halves(tmp_path_factory) -> Path:
    """The same model with rope_interleave false: its rope rows rotate halves, megatron-core's pairs."""
    return save_tiny_deepseek_v3(tmp_path_factory.mktemp("hf") / "deepseek_v3_halves", rope_interleave=False)


def name(tp: int, pp: int, ep: int) -> str:
    return f"tp{tp}pp{pp}ep{ep}"


@pytest.fixture(scope="module")
def imported(source, halves, tmp_path_factory) -> dict[str, Path]:
    """The model imported by one process at each WRITTEN layout, and the halves model at TP=2; inputs untouched."""
    root = tmp_path_factory.mktemp("imported")
    out = {}
    for (tp, pp, ep), src in [*((w, source) for w in WRITTEN), ((2, 1, 1), halves)]:
        key = name(tp, pp, ep) + ("_halves" if src == halves else "")
        out[key] = root / key
        with input_untouched(src):
            assert import_inproc("--input", src, "--output", out[key], "--tp", tp, "--pp", pp, "--ep", ep) == 0
    return out


def cases(imported: dict[str, Path], source: Path, halves: Path) -> dict[str, str]:
    """The loader's cases: each WRITTEN folder at its layout with megatron-core's own save compared, TP2 x PP2's and
    TP2 x EP2's at 1 x 1 x 1, the halves model at 1 x 1 x 1."""
    out = {f"{name(*w)}": f"{':'.join(map(str, w))}:{imported[name(*w)]}:{source}:save" for w in WRITTEN}
    out |= {f"{name(*w)}@1": f"1:1:1:{imported[name(*w)]}:{source}" for w in WRITTEN[1:]}
    out["halves@1"] = f"1:1:1:{imported['tp2pp1ep1_halves']}:{halves}"
    return out


@pytest.fixture(scope="module")
def loads(imported, source, halves, tmp_path_factory) -> dict:
    """Every case loaded by megatron-core: one torchrun job."""
    named = cases(imported, source, halves)
    got = load_with("load_megatron_import_mla.py", LOAD_WORLD, list(named.values()),
                    tmp_path_factory.mktemp("loads") / "result.json")
    return {key: got[case] for key, case in named.items()}


@pytest.mark.parametrize(("tp", "pp", "ep"), WRITTEN)
def test_megatron_core_loads_it_at_the_written_layout(loads, tp, pp, ep):
    """Strict load into the MLA GPTModel, every parameter and expert bias as the recipe lays out the source, the
    keys, shapes, chunks and owners of megatron-core's own save, and the args Megatron-LM reads for MLA, the
    dense-then-MoE layers and MTP (values from the source's config.json, by hand)."""
    got = loads[name(tp, pp, ep)]
    assert got["mismatched"] == [] and got["checked"] > 0
    assert got["layout_differs"] == []
    assert got["args"] == {
        "tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp, "expert_model_parallel_size": ep,
        "padded_vocab_size": padded_vocab(1001, tp, 128), "num_layers": 4, "num_experts": 4,
        "multi_latent_attention": True, "q_lora_rank": 48, "kv_lora_rank": 32, "qk_head_dim": 16,
        "qk_pos_emb_head_dim": 8, "v_head_dim": 16, "qk_layernorm": True, "moe_layer_freq": [0, 1, 1, 1],
        "moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True,
        "moe_shared_expert_intermediate_size": 32, "moe_router_topk_scaling_factor": 2.5, "mtp_num_layers": 1}


@pytest.mark.parametrize("layout", ["tp2pp1ep1_halves", *map(lambda w: name(*w), WRITTEN[1:])])
def test_megatron_core_loads_it_without_parallelism(loads, layout):
    """The TP shards, EP ranks' experts and stages put together by megatron-core's load into one model; a model
    whose rope rows rotate halves is loaded with them as megatron-core's interleaved pairs."""
    got = loads["halves@1" if layout.endswith("_halves") else f"{layout}@1"]
    assert got["mismatched"] == [] and got["checked"] > 0


@pytest.mark.parametrize("layout", [*map(lambda w: name(*w), WRITTEN), "tp2pp1ep1_halves"])
def test_merged_back_it_is_the_source(imported, source, halves, tmp_path, layout):
    """The MTP layer's copies of the embedding and head included, and the rope halves put back."""
    src = halves if layout.endswith("_halves") else source
    out = tmp_path / "merged"
    assert merge_inproc("--input", imported[layout], "--output", out, "--hf-config", src) == 0
    assert (out / "model.safetensors").read_bytes() == (src / "model.safetensors").read_bytes()


def test_two_processes_write_what_one_writes(imported, source, tmp_path):
    tp, pp, ep = WRITTEN[1]
    two = tmp_path / "n2"
    done = torchrun(2, "import", "--quiet", "--input", str(source), "--output", str(two), "--tp", str(tp),
                    "--pp", str(pp), "--ep", str(ep))
    assert done.returncode == 0, done.stderr[-3000:]
    assert folder_bytes(two) == folder_bytes(imported[name(tp, pp, ep)])


def test_a_tp_that_does_not_divide_the_heads_is_refused(source, tmp_path, capsys):
    out = tmp_path / "out"
    with input_untouched(source):
        assert import_inproc("--input", source, "--output", out, "--tp", 3) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--tp 3 does not divide the model's 4 attention heads" in err[0], err
    assert not out.exists()


def edited(source: Path, dst: Path, config: dict, drop: str | None) -> Path:
    """A copy of the source with config.json's fields `config` changed and the tensor `drop` left out."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, dst)
    (dst / "config.json").write_text(json.dumps(json.loads((source / "config.json").read_text()) | config))
    tensors = load_file(str(dst / "model.safetensors"))
    save_file({n: t for n, t in tensors.items() if n != drop}, str(dst / "model.safetensors"),
              metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize(("config", "drop", "words"), [
    ({"first_k_dense_replace": 2}, None,
     "layer 1 has experts, but config.json's first_k_dense_replace 2 makes it dense"),
    ({"first_k_dense_replace": 0}, None, "layer 0 of the model has no experts while config.json has 4"),
    ({}, "model.layers.4.enorm.weight", "multi-token prediction layer 4 (model.layers.4.*) differs from the last "
                                        "decoder layer or lacks its own parts at enorm.weight"),
    ({"num_nextn_predict_layers": 0}, None, "config.json has 4 layers but the model's tensors have 5"),
])
def test_layers_that_do_not_route_as_config_json_says_are_refused(source, tmp_path, capsys, config, drop, words):
    """The dense/MoE boundary and the MTP layers are config.json's: a model whose tensors say otherwise is refused
    in one line, nothing written (a folder written would not load, or load another model)."""
    model = edited(source, tmp_path / "model", config, drop)
    out = tmp_path / "out"
    assert import_inproc("--input", model, "--output", out) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0], err
    assert not out.exists()

"""DeepSeek-V3 (multi-latent attention + MoE) on Megatron: real megatron-core saves (tests/fixtures/
make_megatron_mla.py: local spec, TP=2 and TP=2 x PP=2, legacy and torch_dist, with and without query LoRA, the
first layer dense, a shared expert, non-zero routing biases) merged into what save_pretrained writes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from distmerge.families.megatron.transforms import mla_rope_halves
from distmerge.formats.megatron import layout as mg
from distmerge.front.cli import main as distmerge_main
from tests.conftest import (
    assert_exact,
    assert_refused,
    load_merged,
    load_reference,
    merge_inproc,
    reference_dir,
    torchrun,
    tree_bytes,
)
from tests.helpers.families import metas

CASES = ["mla_tp2", "mla_dist_tp2_noqlora", "mla_tp2pp2_noqlora", "mla_dist_tp2pp2"]
MTP_CASES = ["mla_mtp_tp2pp2", "mla_dist_mtp_tp2"]  # mtp_num_layers=1: legacy TP=2 x PP=2, torch_dist TP=2
PP1 = ["mla_tp2", "mla_dist_tp2_noqlora"]  # megatron-core's forward ran on CPU in the job: its logits are kept


def hf_config(ckpt: Path) -> Path:
    return reference_dir(ckpt) / "huggingface"


@pytest.fixture(scope="module")
def mla_merged(mla_ckpts, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("mla_merged")
    for case in CASES:
        ckpt = mla_ckpts[case]
        assert merge_inproc("--input", ckpt, "--output", root / case, "--hf-config", hf_config(ckpt)) == 0, case
    return {case: root / case for case in CASES}


def load_hf(folder: Path):
    """from_pretrained, asserting that every tensor has its place and every place its tensor."""
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    return model.eval()


def logits_of(folder: Path, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return load_hf(folder)(ids).logits.float()


@pytest.mark.parametrize("case", CASES)
def test_mla_merged_equals_save_pretrained(case, mla_ckpts, mla_merged):
    """Every tensor torch.equal to save_pretrained's: MLA projections (split by the local spec, down projections
    included), norms, dense first layer, routed and shared experts, the routing bias. Shown to fail by mapping
    linear_kv_down_proj as replicated in megatron_layout (the legacy cases' kv_a_proj_with_mqa came out one TP
    rank's half: refused by the shape check), and by unstacking per-layer torch_dist experts no more (6 stacked
    expert tensors had no row: refused)."""
    ref = load_reference(mla_ckpts[case])
    biases = [v for k, v in ref.items() if k.endswith("e_score_correction_bias")]
    assert len(biases) == 3 and all(b.abs().min() > 0 for b in biases)  # not the zeros HF initialises
    assert "model.layers.0.mlp.gate_proj.weight" in ref and "model.layers.0.mlp.gate.weight" not in ref
    assert_exact(load_merged(mla_merged[case]), ref)


@pytest.mark.parametrize("case", CASES)
def test_mla_from_pretrained_gives_the_models_logits(case, mla_ckpts, mla_merged):
    """No missing or unexpected keys; the logits of the HF model the fixture started from and, at PP=1, of
    megatron-core's own forward of the saved model."""
    ref = torch.load(reference_dir(mla_ckpts[case]) / "logits.pt", weights_only=True)
    logits = logits_of(mla_merged[case], ref["input_ids"])
    torch.testing.assert_close(logits, ref["logits"], rtol=0, atol=1e-5)
    if case in PP1:
        megatron = torch.load(reference_dir(mla_ckpts[case]) / "megatron_logits.pt", weights_only=True)["logits"]
        torch.testing.assert_close(logits, megatron.float(), rtol=0, atol=1e-4)


def test_mla_dtype_cast_keeps_the_router_in_float32(mla_ckpts, tmp_path):
    """--dtype bf16 casts every tensor but the router weight and its routing bias, which transformers keeps in
    float32 (save_pretrained of a bf16 DeepseekV3 writes them F32). Shown to fail without FLOAT32_TARGETS."""
    ckpt = mla_ckpts["mla_dist_tp2pp2"]
    assert merge_inproc("--input", ckpt, "--output", tmp_path / "out", "--hf-config", hf_config(ckpt),
                        "--dtype", "bf16") == 0
    merged = load_merged(tmp_path / "out")
    kept = {k for k in merged if k.endswith((".mlp.gate.weight", ".mlp.gate.e_score_correction_bias"))}
    assert len(kept) == 6
    for key, ref in load_reference(ckpt).items():
        assert torch.equal(merged[key], ref if key in kept else ref.to(torch.bfloat16)), key


def test_mla_rope_interleave_false_is_permuted(mla_ckpts, tmp_path):
    """A config that says rope_interleave: false gets its rope rows in halves order and gives the same logits.
    Shown to fail by resolving every MLA row to identity: the merge loaded and its logits differed by 4e-3."""
    ckpt = mla_ckpts["mla_tp2"]
    config_dir = shutil.copytree(hf_config(ckpt), tmp_path / "hf")
    config = json.loads((config_dir / "config.json").read_text())
    (config_dir / "config.json").write_text(json.dumps(dict(config, rope_interleave=False)))
    assert merge_inproc("--input", ckpt, "--output", tmp_path / "out", "--hf-config", config_dir) == 0
    merged, ref = load_merged(tmp_path / "out"), load_reference(ckpt)
    permuted = {k for k in ref if not torch.equal(merged[k], ref[k])}
    assert permuted == {f"model.layers.{i}.self_attn.{p}.weight" for i in range(4)
                        for p in ("q_b_proj", "kv_a_proj_with_mqa")}
    expected = torch.load(reference_dir(ckpt) / "logits.pt", weights_only=True)
    torch.testing.assert_close(logits_of(tmp_path / "out", expected["input_ids"]), expected["logits"],
                               rtol=0, atol=1e-5)


def test_mla_rope_halves_matches_transformers_rotation():
    """The permutation turns Hugging Face's interleaved rotation of the original rows into its halves rotation
    of the permuted rows (heads x [nope | rope]). Shown to fail with a transform that returns the rows as they
    are."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        apply_rotary_pos_emb,
        apply_rotary_pos_emb_interleave,
    )

    torch.manual_seed(0)
    heads, nope, rope, hidden, seq = 3, 4, 8, 5, 6
    w, x = torch.randn(heads * (nope + rope), hidden), torch.randn(seq, hidden)
    angles = torch.arange(seq)[:, None] * torch.rand(rope // 2)[None]
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)

    def rope_part(weight: torch.Tensor) -> torch.Tensor:  # [1, heads, seq, rope]
        return (x @ weight.T).view(seq, heads, nope + rope)[..., nope:].transpose(0, 1)[None]

    (permuted,) = mla_rope_halves([w], heads=heads, keep=nope, rope=rope)
    inter, _ = apply_rotary_pos_emb_interleave(rope_part(w), rope_part(w), cos[None], sin[None])
    halves, _ = apply_rotary_pos_emb(rope_part(permuted), rope_part(permuted), cos[None], sin[None])
    torch.testing.assert_close(inter, halves, rtol=0, atol=1e-6)
    keep = w.view(heads, nope + rope, hidden)[:, :nope]
    assert torch.equal(permuted.view(heads, nope + rope, hidden)[:, :nope], keep)


def test_mla_down_projection_split_follows_the_spec():
    """Local spec: ColumnParallelLinear, split on dim 0; a file whose MLA layers carry TE's fused kv norm:
    duplicated TELinear, a copy per rank. The up projections are column-parallel either way."""
    for name in ("decoder.layers.2.self_attention.linear_q_down_proj.weight",
                 "decoder.layers.2.self_attention.linear_kv_down_proj.weight"):
        assert mg.tp_split_dim(name) == 0
        assert mg.tp_split_dim(name, te_mla=True) is None
    for name in ("linear_q_proj", "linear_q_up_proj", "linear_kv_up_proj"):
        assert mg.tp_split_dim(f"decoder.layers.2.self_attention.{name}.weight", te_mla=True) == 0
    assert mg.tp_split_dim("decoder.layers.2.self_attention.linear_kv_up_proj.layer_norm_weight") is None
    assert mg.tp_split_dim("decoder.layers.2.mlp.router.expert_bias") is None


def te_spelled(ckpt: Path, dest: Path) -> Path:
    """The legacy TP=2 save as megatron-core's Transformer Engine spec names and splits it (no TE here to build
    one): the q/kv norms fused into the up projections (`linear_{q,kv}_up_proj.layer_norm_weight`), the dense
    layer's pre-MLP norm into `mlp.linear_fc1.layer_norm_weight`, and the down projections duplicated TELinear
    copies, whole on every TP rank (the local spec's two slices, concatenated)."""
    renames = {".self_attention.q_layernorm.weight": ".self_attention.linear_q_up_proj.layer_norm_weight",
               ".self_attention.kv_layernorm.weight": ".self_attention.linear_kv_up_proj.layer_norm_weight",
               "layers.0.pre_mlp_layernorm.weight": "layers.0.mlp.linear_fc1.layer_norm_weight"}
    dest = shutil.copytree(ckpt, dest)
    paths = sorted(dest.glob("iter_0000001/mp_rank_*/model_optim_rng.pt"))
    saved = [torch.load(p, weights_only=False) for p in paths]  # args holds a megatron-core enum
    whole = {k: torch.cat([s["model"][k] for s in saved]) for k in saved[0]["model"] if k.endswith(mg.MLA_DOWN)}
    for state in saved:
        model = state["model"]
        for key in list(model):
            value = model.pop(key)
            new = next((key.replace(a, b) for a, b in renames.items() if key.endswith(a)), key)
            model[new] = whole[key].clone() if key in whole else value
    for state, path in zip(saved, paths, strict=True):
        torch.save(state, path)
    return dest


def test_mla_transformer_engine_spelling(mla_ckpts, tmp_path):
    """TE's names and whole down projections (te_spelled) merge to the same tensors: the legacy reader reads
    the copies once. Shown to fail by hiding the TE mark from megatron_legacy (the two copies were stacked into
    an [80, 64] kv_a_proj_with_mqa: refused by the shape check)."""
    ckpt = mla_ckpts["mla_tp2"]
    te = te_spelled(ckpt, tmp_path / "te")
    assert merge_inproc("--input", te, "--output", tmp_path / "out", "--hf-config", hf_config(ckpt)) == 0
    assert_exact(load_merged(tmp_path / "out"), load_reference(ckpt))


def test_mla_incomplete_mtp_layer_is_refused(mla_ckpts, tmp_path, capsys):
    """A save with a partial MTP block (an mtp.layers.0.enorm norm alone, added to both rank files of a save
    without MTP): one line naming what the MTP layer lacks, not a merge that writes half a layer. Shown to fail
    without mtp._check_layer (the merge wrote model.layers.4.enorm.weight alone and exited 0)."""
    save = shutil.copytree(mla_ckpts["mla_tp2"], tmp_path / "mtp")
    for path in save.glob("iter_0000001/mp_rank_*/model_optim_rng.pt"):
        state = torch.load(path, weights_only=False)
        state["model"]["mtp.layers.0.enorm.weight"] = torch.ones(64)
        torch.save(state, path)
    capsys.readouterr()  # unpickling args imported megatron-core, which warns on stderr
    assert_refused(save, tmp_path / "out", "multi-token prediction layer 4: hnorm.weight is missing", capsys,
                   "--hf-config", hf_config(mla_ckpts["mla_tp2"]))


def test_mla_config_without_query_lora_is_refused(mla_ckpts, tmp_path, capsys):
    """A save with a query LoRA against a config without one (the other fixture's): one line, nothing written.
    Shown to fail by dropping the reason from megatron_mla.SHAPES (the generic shape line does not name it)."""
    ckpt = mla_ckpts["mla_tp2"]
    assert_refused(ckpt, tmp_path / "out", "no q_lora_rank", capsys,
                   "--hf-config", hf_config(mla_ckpts["mla_dist_tp2_noqlora"]))


def assert_n1_equals_n2(ckpt, tmp_path) -> None:
    """One process and two under torchrun write the same bytes (several output files)."""
    args = ["--input", ckpt, "--hf-config", hf_config(ckpt), "--max-shard-size", "200KB", "--quiet"]
    assert merge_inproc(*args[:-1], "--output", tmp_path / "n1") == 0
    run = torchrun(2, "merge", *args, "--output", tmp_path / "n2")
    assert run.returncode == 0, run.stderr[-3000:]
    one, two = tree_bytes(tmp_path / "n1"), tree_bytes(tmp_path / "n2")
    assert len([n for n in one if n.endswith(".safetensors")]) > 2
    assert one == two


@pytest.mark.torchrun
def test_mla_torchrun_output_is_byte_identical(mla_ckpts, tmp_path):
    assert_n1_equals_n2(mla_ckpts["mla_dist_tp2pp2"], tmp_path)


# -- multi-token prediction (mtp_num_layers=1): megatron-core's MTP block on the last pipeline stage ---------------
MTP = "model.layers.4."  # num_hidden_layers (4) + j (0): where DeepSeek-V3's checkpoint keeps MTP module 0
T = "mtp.layers.0.transformer_layer."
MTP_NAMES = {  # megatron-core's name (of the live tensor) -> the Hugging Face name it must be written under
    "mtp.layers.0.enorm.weight": "enorm.weight",
    "mtp.layers.0.hnorm.weight": "hnorm.weight",
    "mtp.layers.0.eh_proj.weight": "eh_proj.weight",
    "mtp.layers.0.final_layernorm.weight": "shared_head.norm.weight",
    T + "input_layernorm.weight": "input_layernorm.weight",
    T + "self_attention.linear_q_down_proj.weight": "self_attn.q_a_proj.weight",
    T + "self_attention.q_layernorm.weight": "self_attn.q_a_layernorm.weight",
    T + "self_attention.linear_q_up_proj.weight": "self_attn.q_b_proj.weight",
    T + "self_attention.linear_kv_down_proj.weight": "self_attn.kv_a_proj_with_mqa.weight",
    T + "self_attention.kv_layernorm.weight": "self_attn.kv_a_layernorm.weight",
    T + "self_attention.linear_kv_up_proj.weight": "self_attn.kv_b_proj.weight",
    T + "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    T + "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    T + "mlp.router.weight": "mlp.gate.weight",
    T + "mlp.router.expert_bias": "mlp.gate.e_score_correction_bias",
    T + "mlp.shared_experts.linear_fc2.weight": "mlp.shared_experts.down_proj.weight",
    **{T + f"mlp.experts.local_experts.{e}.linear_fc2.weight": f"mlp.experts.{e}.down_proj.weight" for e in range(4)},
}
FC1 = {T + "mlp.shared_experts.linear_fc1.weight": "mlp.shared_experts.",  # -> gate_proj, up_proj
       **{T + f"mlp.experts.local_experts.{e}.linear_fc1.weight": f"mlp.experts.{e}." for e in range(4)}}
OWN = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight", "embed_tokens.weight",
       "shared_head.head.weight")


@pytest.fixture(scope="module")
def mtp_merged(mla_ckpts, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("mtp_merged")
    for case in MTP_CASES:
        ckpt = mla_ckpts[case]
        assert merge_inproc("--input", ckpt, "--output", root / case, "--hf-config", hf_config(ckpt)) == 0, case
    return {case: root / case for case in MTP_CASES}


def gate_up(fc1: torch.Tensor, tp: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """A live linear_fc1 gathered over TP ([gate_0; up_0; gate_1; up_1] at TP=2: each rank's column-parallel slice
    is its gate rows, then its up rows) -> the whole gate and up."""
    halves = fc1.view(tp, 2, -1, fc1.shape[1])
    return halves[:, 0].reshape(-1, fc1.shape[1]), halves[:, 1].reshape(-1, fc1.shape[1])


def mtp_layer_names(ref: dict[str, torch.Tensor]) -> set[str]:
    """The MTP layer as DeepSeek-V3's checkpoint has it: the last decoder layer's tensors (save_pretrained's layer
    3, whose spec megatron-core builds it from) plus its own parts and the two shared copies."""
    return {MTP + k.removeprefix("model.layers.3.") for k in ref if k.startswith("model.layers.3.")} | {
        MTP + part for part in OWN}


@pytest.mark.parametrize("case", MTP_CASES)
def test_mtp_layer_holds_the_live_megatron_tensors(case, mla_ckpts, mtp_merged):
    """The main model torch.equal to save_pretrained's; every MTP tensor torch.equal to the live megatron-core
    tensor it came from (gathered over TP by megatron-core's own partition_dim in the job), under the name this test
    gives it, with the embedding and output head repeated in the layer. Shown to fail by mapping final_layernorm to
    hnorm.weight (two sources on one target: refused), by swapping enorm and hnorm in megatron_tables.MTP_OWN
    (enorm.weight differed), and without the copies (two names missing)."""
    ckpt = mla_ckpts[case]
    ref, merged = load_reference(ckpt), load_merged(mtp_merged[case])
    live = torch.load(reference_dir(ckpt) / "mtp_reference.pt", weights_only=True)
    assert set(live) == set(MTP_NAMES) | set(FC1) | {"embedding.word_embeddings.weight"}  # each one checked below
    mtp = {k: v for k, v in merged.items() if k.startswith(MTP)}
    assert_exact({k: v for k, v in merged.items() if k not in mtp}, ref)
    expected = {MTP + hf: live[name] for name, hf in MTP_NAMES.items()}
    for name, prefix in FC1.items():
        expected[MTP + prefix + "gate_proj.weight"], expected[MTP + prefix + "up_proj.weight"] = gate_up(live[name])
    expected[MTP + "embed_tokens.weight"] = ref["model.embed_tokens.weight"]
    expected[MTP + "shared_head.head.weight"] = ref["lm_head.weight"]
    assert set(expected) == mtp_layer_names(ref)
    assert_exact(mtp, expected)
    # the MTP stage's own copy of the word embeddings (legacy PP=2: saved again in the last stage's files)
    assert torch.equal(live["embedding.word_embeddings.weight"][: ref["lm_head.weight"].shape[0]],
                       merged["model.embed_tokens.weight"])
    assert json.loads((mtp_merged[case] / "config.json").read_text())["num_nextn_predict_layers"] == 1


@pytest.mark.parametrize("case", MTP_CASES)
def test_mtp_from_pretrained_leaves_only_the_mtp_layer_unexpected(case, mla_ckpts, mtp_merged):
    """transformers' DeepseekV3 has no module for the MTP layer: from_pretrained misses nothing, leaves exactly the
    MTP layer's tensors unexpected (as transformers names a layer once loaded: its experts fused, so the names of
    the loaded model's layer 3, plus the MTP parts), and gives the HF model's logits. Shown to fail without the
    copies (embed_tokens and shared_head.head missing from the unexpected set)."""
    from transformers import AutoModelForCausalLM

    ckpt = mla_ckpts[case]
    model, info = AutoModelForCausalLM.from_pretrained(mtp_merged[case], output_loading_info=True)
    assert not info["missing_keys"]
    layer = {MTP + k.removeprefix("model.layers.3.") for k in model.state_dict() if k.startswith("model.layers.3.")}
    assert set(info["unexpected_keys"]) == layer | {MTP + part for part in OWN}
    expected = torch.load(reference_dir(ckpt) / "logits.pt", weights_only=True)
    with torch.no_grad():
        logits = model.eval()(expected["input_ids"]).logits.float()
    torch.testing.assert_close(logits, expected["logits"], rtol=0, atol=1e-5)


def test_mtp_count_set_when_config_lacks_it_refused_when_it_disagrees(mla_ckpts, tmp_path, capsys):
    """A config.json without num_nextn_predict_layers gets the count found (vLLM and SGLang read it to find the MTP
    layer); one that says another count is one error line, nothing written. Shown to fail by leaving config_updates
    out of megatron.py's result (the key stayed absent) and by dropping the count check (the merge wrote 1 layer
    under a config that says 2)."""
    ckpt = mla_ckpts["mla_dist_mtp_tp2"]
    config = json.loads((hf_config(ckpt) / "config.json").read_text())
    for name, value in (("absent", None), ("two", 2)):
        folder = tmp_path / name
        folder.mkdir()
        changed = {k: v for k, v in config.items() if k != "num_nextn_predict_layers"}
        (folder / "config.json").write_text(json.dumps(changed if value is None else dict(changed, **{
            "num_nextn_predict_layers": value})))
    assert merge_inproc("--input", ckpt, "--output", tmp_path / "out", "--hf-config", tmp_path / "absent") == 0
    assert json.loads((tmp_path / "out" / "config.json").read_text())["num_nextn_predict_layers"] == 1
    capsys.readouterr()
    assert_refused(ckpt, tmp_path / "out2", "num_nextn_predict_layers is 2", capsys, "--hf-config", tmp_path / "two")


def test_mtp_layer_spelled_as_megatron_core_0_19_merges_the_same(mla_ckpts, mtp_merged, tmp_path):
    """megatron-core 0.19 names the MTP block's layer `mtp_model_layer` (0.16: `transformer_layer`): the legacy PP=2
    save re-spelled so (keys renamed in the MTP stage's files) merges to the same tensors. A real 0.19 save of this
    model (make_megatron_new.py --dsv3-mtp, not kept: 320 KB) merged equal too. Shown to fail with only the 0.16
    spelling in megatron_tables.MTP_LAYERS (21 tensors had no mapping: refused)."""
    ckpt = mla_ckpts["mla_mtp_tp2pp2"]
    save = shutil.copytree(ckpt, tmp_path / "new")
    renamed = 0
    for path in save.glob("iter_0000001/mp_rank_*_001/model_optim_rng.pt"):
        state = torch.load(path, weights_only=False)  # args holds a megatron-core enum
        model = state["model"]
        for key in [k for k in model if ".transformer_layer." in k]:
            model[key.replace(".transformer_layer.", ".mtp_model_layer.")] = model.pop(key)
            renamed += 1
        torch.save(state, path)
    assert renamed > 40
    assert merge_inproc("--input", save, "--output", tmp_path / "out", "--hf-config", hf_config(ckpt)) == 0
    assert_exact(load_merged(tmp_path / "out"), load_merged(mtp_merged["mla_mtp_tp2pp2"]))


def test_mtp_under_an_architecture_without_mtp_rows_is_refused():
    """`mtp.layers.*` tensors in a Qwen3 save (a table with no MTP rows): one error that says MTP is mapped for
    DeepSeek-V3 only, not the generic no-mapping line. Shown to fail by passing has_rows=True for every
    architecture (the generic "have no mapping for Qwen3ForCausalLM" line)."""
    from distmerge.errors import InputError
    from distmerge.families.base import FamilyContext, claim
    from distmerge.formats.base import Hints
    from tests.helpers.families import hf_state, megatron_sources

    config, state = hf_state("Qwen3ForCausalLM")
    sources = {**megatron_sources("Qwen3ForCausalLM", "local", state),
               **metas({"mtp.layers.0.enorm.weight": (16,)})}
    hints = Hints(naming="megatron")
    family = claim(list(sources), config, hints)
    with pytest.raises(InputError, match="maps Megatron's MTP layers for DeepSeek-V3 only"):
        family.units(sources, FamilyContext(config=config, cast=None, hints=hints))


def test_copies_transform_applies_its_transform_once():
    """transforms.copies: the named transform's one result, `count` times (the MTP layer's embedding copy is the
    trimmed vocabulary, like the main one)."""
    from distmerge.families.transforms import copies

    padded = torch.arange(12.0).view(4, 3)
    out = copies([padded], of="trim_rows", count=3, rows=2)
    assert len(out) == 3 and all(torch.equal(t, padded[:2]) for t in out)


@pytest.mark.torchrun
def test_mtp_torchrun_output_is_byte_identical(mla_ckpts, tmp_path):
    """N=1 and N=2 write the same bytes for the legacy PP=2 MTP save (the MTP stage's embedding copy is read from
    one file; the embedding's and the head's units write two names each). Not broken on purpose: what it guards
    is the engine's independence of N, with units of several targets spread over owners."""
    assert_n1_equals_n2(mla_ckpts["mla_mtp_tp2pp2"], tmp_path)


def test_mtp_verify_passes_against_save_pretrained(mla_ckpts, mtp_merged, capsys):
    """`distmerge verify` against save_pretrained's model, which has no MTP layer (transformers builds no module
    for it): the MTP layer's tensors are listed as not in the reference, which is no failure, and every other
    tensor is bit-exact. Shown to fail without the MTP rule in verifier/listing.py ("verify: FAIL 32 of 125
    tensors: model.layers.4.eh_proj.weight (extra in merged), ...")."""
    case = "mla_dist_mtp_tp2"
    reference = reference_dir(mla_ckpts[case]) / "model.safetensors"
    assert distmerge_main(["verify", "--merged", str(mtp_merged[case]), "--reference", str(reference)]) == 0
    verdict = [line for line in capsys.readouterr().out.splitlines() if line.startswith("verify:")][-1]
    layer = 32  # its decoder layer, the MTP parts and the two copies
    assert verdict == (f"verify: PASS 125 tensors ({125 - layer} bit-exact, {layer} not in the reference: its "
                       "multi-token-prediction layer)"), verdict

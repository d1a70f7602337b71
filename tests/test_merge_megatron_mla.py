"""DeepSeek-V3 (multi-latent attention + MoE) on Megatron: real megatron-core saves (tests/fixtures/
make_megatron_mla.py: local spec, TP=2 and TP=2 x PP=2, legacy and torch_dist, with and without query LoRA, the
first layer dense, a shared expert, non-zero routing biases) merged into what save_pretrained writes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from distmerge.formats import megatron_layout as mg
from distmerge.transforms import mla_rope_halves
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

CASES = ["mla_tp2", "mla_dist_tp2_noqlora", "mla_tp2pp2_noqlora", "mla_dist_tp2pp2"]
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


def test_mla_multi_token_prediction_is_refused(mla_ckpts, tmp_path, capsys):
    """A save with MTP layers (an mtp.layers.0.* norm added to both rank files): one line that says so, not a
    merge without them. Shown to fail without megatron_mla.refuse_mtp (the generic no-mapping line)."""
    save = shutil.copytree(mla_ckpts["mla_tp2"], tmp_path / "mtp")
    for path in save.glob("iter_0000001/mp_rank_*/model_optim_rng.pt"):
        state = torch.load(path, weights_only=False)
        state["model"]["mtp.layers.0.enorm.weight"] = torch.ones(64)
        torch.save(state, path)
    capsys.readouterr()  # unpickling args imported megatron-core, which warns on stderr
    assert_refused(save, tmp_path / "out", "multi-token prediction", capsys,
                   "--hf-config", hf_config(mla_ckpts["mla_tp2"]))


def test_mla_config_without_query_lora_is_refused(mla_ckpts, tmp_path, capsys):
    """A save with a query LoRA against a config without one (the other fixture's): one line, nothing written.
    Shown to fail by dropping the reason from megatron_mla.SHAPES (the generic shape line does not name it)."""
    ckpt = mla_ckpts["mla_tp2"]
    assert_refused(ckpt, tmp_path / "out", "no q_lora_rank", capsys,
                   "--hf-config", hf_config(mla_ckpts["mla_dist_tp2_noqlora"]))


@pytest.mark.torchrun
def test_mla_torchrun_output_is_byte_identical(mla_ckpts, tmp_path):
    ckpt = mla_ckpts["mla_dist_tp2pp2"]
    args = ["--input", ckpt, "--hf-config", hf_config(ckpt), "--max-shard-size", "200KB", "--quiet"]
    assert merge_inproc(*args[:-1], "--output", tmp_path / "n1") == 0
    run = torchrun(2, "merge", *args, "--output", tmp_path / "n2")
    assert run.returncode == 0, run.stderr[-3000:]
    one, two = tree_bytes(tmp_path / "n1"), tree_bytes(tmp_path / "n2")
    assert len([n for n in one if n.endswith(".safetensors")]) > 2
    assert one == two

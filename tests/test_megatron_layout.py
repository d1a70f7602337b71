"""Megatron naming and layout rules, one by one (the end-to-end tests use real megatron-core saves)."""

from __future__ import annotations

import pytest

from distmerge.errors import InputError, LayoutError
from distmerge.families.base import FamilyContext, SourceMeta
from distmerge.families.megatron import family as megatron
from distmerge.formats.base import Fragment, Hints
from distmerge.formats.megatron import layout as mg
from distmerge.formats.megatron.dist import unstack
from distmerge.input import source

QWEN3_MOE = {"architectures": ["Qwen3MoeForCausalLM"], "num_attention_heads": 4, "num_key_value_heads": 2,
             "head_dim": 8, "hidden_size": 16, "vocab_size": 100, "num_hidden_layers": 1,
             "tie_word_embeddings": False}


def test_split_dims_follow_megatron_parallel_linears():
    assert mg.tp_split_dim("decoder.layers.3.self_attention.linear_qkv.weight") == 0
    assert mg.tp_split_dim("decoder.layers.3.self_attention.linear_qkv.bias") == 0
    assert mg.tp_split_dim("decoder.layers.3.self_attention.linear_proj.weight") == 1
    assert mg.tp_split_dim("decoder.layers.3.mlp.experts.linear_fc2.weight7") == 1
    assert mg.tp_split_dim("decoder.layers.3.self_attention.linear_qkv.layer_norm_weight") is None
    assert mg.tp_split_dim("decoder.layers.3.self_attention.linear_proj.bias") is None
    assert mg.tp_split_dim("decoder.layers.3.mlp.router.weight") is None


def test_renumber_layers_and_experts():
    assert mg.renumber("decoder.layers.1.mlp.linear_fc1.weight", 6, 0) == "decoder.layers.7.mlp.linear_fc1.weight"
    sequential = "decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.weight"
    assert mg.renumber(sequential, 2, 4) == "decoder.layers.2.mlp.experts.local_experts.5.linear_fc2.weight"
    assert mg.renumber("decoder.layers.0.mlp.experts.linear_fc1.weight1", 0, 4) == (
        "decoder.layers.0.mlp.experts.linear_fc1.weight5")
    assert mg.renumber("embedding.word_embeddings.weight", 6, 4) == "embedding.word_embeddings.weight"


def fragment(name, shape, offsets, lengths, byte_offset=1000):
    return Fragment(name=name, dtype="F32", global_shape=shape, offsets=offsets, lengths=lengths, file_index=0,
                    byte_offset=byte_offset, key=name)


def test_unstack_names_each_layer_and_keeps_bytes_in_place():
    stacked = fragment("decoder.layers.mlp.linear_fc1.weight", (4, 256, 64), (2, 128, 0), (2, 64, 64))
    first, second = unstack(stacked)
    assert first.name == "decoder.layers.2.mlp.linear_fc1.weight"
    assert second.name == "decoder.layers.3.mlp.linear_fc1.weight"
    assert first.global_shape == (256, 64) and first.offsets == (128, 0) and first.lengths == (64, 64)
    assert second.byte_offset - first.byte_offset == 64 * 64 * 4


def test_unstack_experts_and_leaves_other_names():
    experts = fragment("decoder.layers.mlp.experts.local_experts.linear_fc2.weight", (2, 4, 16, 8), (1, 2, 0, 0),
                       (1, 2, 16, 8))
    assert [f.name for f in unstack(experts)] == [
        "decoder.layers.1.mlp.experts.local_experts.2.linear_fc2.weight",
        "decoder.layers.1.mlp.experts.local_experts.3.linear_fc2.weight",
    ]
    plain = fragment("decoder.final_layernorm.weight", (64,), (0,), (64,))
    assert unstack(plain) == [plain]
    per_layer = fragment("decoder.layers.5.mlp.linear_fc2.weight", (64, 128), (0, 64), (64, 64))  # non-homogeneous
    assert unstack(per_layer) == [per_layer]


def metas(shapes):
    return {n: SourceMeta(name=n, dtype="F32", shape=s) for n, s in shapes.items()}


def qwen3_moe_sources(experts: str) -> dict[str, SourceMeta]:
    layer = "decoder.layers.0."
    shapes = {
        "embedding.word_embeddings.weight": (128, 16), "output_layer.weight": (128, 16),
        "decoder.final_layernorm.weight": (16,), layer + "self_attention.linear_qkv.layer_norm_weight": (16,),
        layer + "self_attention.linear_qkv.weight": (64, 16), layer + "self_attention.linear_proj.weight": (16, 32),
        layer + "self_attention.q_layernorm.weight": (8,), layer + "self_attention.k_layernorm.weight": (8,),
        layer + "pre_mlp_layernorm.weight": (16,), layer + "mlp.router.weight": (2, 16),
    }
    for e in range(2):
        fc1, fc2 = experts.format(e=e, n=1), experts.format(e=e, n=2)
        shapes |= {layer + fc1: (12, 16), layer + fc2: (16, 6)}
    return metas(shapes)


@pytest.mark.parametrize("experts", ["mlp.experts.local_experts.{e}.linear_fc{n}.weight",
                                     "mlp.experts.linear_fc{n}.weight{e}"])
def test_qwen3_moe_table(experts):
    ctx = FamilyContext(config=QWEN3_MOE, cast=None, hints=Hints(fc1_shards=2, expert_fc1_shards=1))
    result = megatron.units(qwen3_moe_sources(experts), ctx)
    names = {t.name: t for u in result.units for t in u.targets}
    assert names["model.layers.0.mlp.gate.weight"].shape == (2, 16)
    assert names["model.layers.0.mlp.experts.1.up_proj.weight"].shape == (6, 16)
    assert names["model.layers.0.mlp.experts.1.down_proj.weight"].shape == (16, 6)
    assert names["model.layers.0.self_attn.k_proj.weight"].shape == (16, 16)
    assert names["model.layers.0.self_attn.q_norm.weight"].shape == (8,)
    assert names["model.embed_tokens.weight"].shape == (100, 16)
    fc1 = next(u for u in result.units if u.targets[0].name == "model.layers.0.mlp.experts.0.gate_proj.weight")
    assert dict(fc1.params) == {"shards": 1}  # experts take the expert TP size, not the dense one


def test_unmapped_tensor_is_an_error_not_a_drop():
    sources = qwen3_moe_sources("mlp.experts.local_experts.{e}.linear_fc{n}.weight")
    sources |= metas({"decoder.layers.0.mlp.mystery.weight": (4,)})
    with pytest.raises(InputError, match="no mapping for Qwen3MoeForCausalLM .*mystery"):
        megatron.units(sources, FamilyContext(config=QWEN3_MOE, cast=None))


def test_config_that_does_not_fit_the_tensors():
    config = {**QWEN3_MOE, "num_key_value_heads": 4}
    with pytest.raises(LayoutError, match="wrong config.json"):
        megatron.units(qwen3_moe_sources("mlp.experts.linear_fc{n}.weight{e}"), FamilyContext(config=config, cast=None))


def test_missing_layers_are_named():
    config = {**QWEN3_MOE, "num_hidden_layers": 3}
    with pytest.raises(LayoutError, match=r"missing \[1, 2\]"):
        megatron.units(qwen3_moe_sources("mlp.experts.linear_fc{n}.weight{e}"), FamilyContext(config=config, cast=None))


def test_mixtral_and_qwen2_moe_tables():
    """Mixtral and Qwen2-MoE rows by name (end to end: megatron_dist_mixtral_ep2, megatron_qwen2_moe_tp2),
    including the grouped-GEMM spelling no fixture writes (MixtralForCausalLM's saved names:
    block_sparse_moe.experts.{e}.w1/w2/w3; Qwen2MoeForCausalLM: mlp.shared_expert.*, shared_expert_gate)."""
    layer = "decoder.layers.0."
    shapes = {layer + "mlp.router.weight": (2, 16), layer + "mlp.experts.local_experts.1.linear_fc1.weight": (12, 16),
              layer + "mlp.experts.local_experts.1.linear_fc2.weight": (16, 6)}
    mixtral = {"architectures": ["MixtralForCausalLM"], "vocab_size": 100}
    names = {t.name for u in megatron.units(metas(shapes), FamilyContext(config=mixtral, cast=None)).units
             for t in u.targets}
    moe = "model.layers.0.block_sparse_moe."
    assert names == {moe + "gate.weight", moe + "experts.1.w1.weight", moe + "experts.1.w3.weight",
                     moe + "experts.1.w2.weight"}
    shared = {layer + "mlp.shared_experts.linear_fc1.weight": (24, 16),
              layer + "mlp.shared_experts.gate_weight": (1, 16)}
    qwen2_moe = {"model_type": "qwen2_moe", "vocab_size": 100}
    units = megatron.units(metas(shared), FamilyContext(config=qwen2_moe, cast=None)).units
    assert {t.name: t.shape for u in units for t in u.targets} == {
        "model.layers.0.mlp.shared_expert.gate_proj.weight": (12, 16),
        "model.layers.0.mlp.shared_expert.up_proj.weight": (12, 16),
        "model.layers.0.mlp.shared_expert_gate.weight": (1, 16),
    }


def test_torch_save_reader_finds_bf16_bytes_in_place(tmp_path):
    """Megatron's --bf16 saves: the reader must name the dtype and the exact bytes of each tensor, views too."""
    import os

    import torch

    from distmerge.formats.torch_private import torch_save

    weights = torch.randn(6, 4).to(torch.bfloat16)
    torch.save({"model": {"w": weights, "row": weights[2]}, "iteration": 7}, tmp_path / "model_optim_rng.pt")
    saved = torch_save.read(source.of(tmp_path), tmp_path / "model_optim_rng.pt")
    fd = os.open(tmp_path / "model_optim_rng.pt", os.O_RDONLY)
    try:
        for key, expected in saved.value["model"].items():
            assert expected.storage.dtype == torch.bfloat16
            start = saved.storage_offsets[expected.storage.key] + expected.storage_offset * 2
            data = os.pread(fd, 2 * expected.size[0] * (expected.size[1] if len(expected.size) > 1 else 1), start)
            got = torch.frombuffer(bytearray(data), dtype=torch.bfloat16).view(expected.size)
            assert torch.equal(got, weights if key == "w" else weights[2]), key
    finally:
        os.close(fd)
    assert saved.value["iteration"] == 7

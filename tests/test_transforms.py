"""Layout transforms on tensors whose layout is built the way Megatron-core lays them out: the fused QKV
interleaves query groups ([q heads of group g, k_g, v_g] for each g: megatron/core/transformer/attention.py,
SelfAttention.get_query_key_value_tensors splits mixed_qkv per query group), and SwiGLU's linear_fc1 is
[gate_i; up_i] per TP shard in legacy files and [gate; up] in torch_dist (megatron/core/transformer/mlp.py;
observed in a real megatron-core 0.16.1 save, tests/fixtures/make_megatron.py)."""

from __future__ import annotations

import pytest
import torch

from distmerge.families.transforms import apply


def fused_qkv(q, k, v, heads, groups, head_dim):
    per = heads // groups
    parts = []
    for g in range(groups):
        parts += [q[g * per * head_dim : (g + 1) * per * head_dim], k[g * head_dim : (g + 1) * head_dim],
                  v[g * head_dim : (g + 1) * head_dim]]
    return torch.cat(parts)


@pytest.mark.parametrize(("heads", "groups"), [(4, 2), (8, 1), (4, 4)])
@pytest.mark.parametrize("bias", [False, True])
def test_split_qkv_inverts_the_group_interleave(heads, groups, bias):
    head_dim, hidden = 16, 64
    shape = () if bias else (hidden,)
    q = torch.randn(heads * head_dim, *shape)
    k, v = torch.randn(groups * head_dim, *shape), torch.randn(groups * head_dim, *shape)
    fused = fused_qkv(q, k, v, heads, groups, head_dim)
    out = apply("split_qkv", [fused], (("heads", heads), ("groups", groups), ("head_dim", head_dim)))
    assert all(torch.equal(a, b) for a, b in zip(out, (q, k, v), strict=True))


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_split_gate_up_per_tp_shard(tp):
    gate, up = torch.randn(128, 64), torch.randn(128, 64)
    shards = [torch.cat([g, u]) for g, u in zip(gate.chunk(tp), up.chunk(tp), strict=True)]
    out = apply("split_gate_up", [torch.cat(shards)], (("shards", tp),))
    assert torch.equal(out[0], gate) and torch.equal(out[1], up)


def test_trim_padded_vocab():
    padded = torch.cat([torch.randn(1001, 8), torch.zeros(23, 8)])
    assert torch.equal(apply("trim_rows", [padded], (("rows", 1001),))[0], padded[:1001])

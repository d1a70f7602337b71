"""Megatron's fused and rotated layouts -> Hugging Face's (the rows of tables.py, mla.py name them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from distmerge.families.transforms import Params, Segment


@dataclass(frozen=True)
class SplitQkv(Params):
    heads: int  # query heads
    groups: int  # key/value heads
    head_dim: int


@dataclass(frozen=True)
class SplitGateUp(Params):
    shards: int  # the TP shards the fused rows were saved from


@dataclass(frozen=True)
class MlaRopeHalves(Params):
    heads: int
    keep: int  # each head's rows before its rotary part
    rope: int  # qk_rope_head_dim


def split_qkv(sources: list[torch.Tensor], heads: int, groups: int, head_dim: int) -> list[torch.Tensor]:
    """Megatron's fused linear_qkv (TP shards already concatenated on dim 0) -> q, k, v.

        rows, group by group:  [ q heads of group 0 | k_0 | v_0 | q heads of group 1 | k_1 | v_1 | ... ]
                                 (heads/groups)*head_dim  head_dim  head_dim
    TP splits these rows evenly: a shard holds whole groups, or (TP > groups) part of one; concatenating
    the shards restores the order either way. Weights and biases alike.
    """
    (fused,) = sources
    per = heads // groups
    rest = tuple(fused.shape[1:])
    blocks = fused.reshape(groups, (per + 2) * head_dim, *rest)
    q = blocks[:, : per * head_dim].reshape(heads * head_dim, *rest)
    k = blocks[:, per * head_dim : (per + 1) * head_dim].reshape(groups * head_dim, *rest)
    v = blocks[:, (per + 1) * head_dim :].reshape(groups * head_dim, *rest)
    return [q.contiguous(), k.contiguous(), v.contiguous()]


def fuse_qkv_rows(sizes: tuple[int, ...], heads: int, groups: int, head_dim: int) -> tuple[Segment, ...]:
    """split_qkv's inverse: q, k, v (sources 0, 1, 2) -> the fused rows, group by group (split_qkv's drawing):
    group g is q rows [g*per*head_dim, (g+1)*per*head_dim), then k's and v's rows [g*head_dim, (g+1)*head_dim)."""
    per = heads // groups
    out: list[Segment] = []
    for g in range(groups):
        out += [Segment(source=0, start=g * per * head_dim, count=per * head_dim),
                Segment(source=1, start=g * head_dim, count=head_dim),
                Segment(source=2, start=g * head_dim, count=head_dim)]
    return tuple(out)


def split_gate_up(sources: list[torch.Tensor], shards: int) -> list[torch.Tensor]:
    """SwiGLU linear_fc1 -> gate, up.

        legacy files (shards = TP):  [ gate_0; up_0 | gate_1; up_1 | ... ]   each TP shard is [gate_i; up_i]
        torch_dist   (shards = 1):   [ gate; up ]                           already global halves
    """
    (fused,) = sources
    rest = tuple(fused.shape[1:])
    halves = fused.reshape(shards, 2, fused.shape[0] // (2 * shards), *rest)
    gate = halves[:, 0].reshape(-1, *rest)
    up = halves[:, 1].reshape(-1, *rest)
    return [gate.contiguous(), up.contiguous()]


def fuse_gate_up_rows(sizes: tuple[int, ...], shards: int) -> tuple[Segment, ...]:
    """split_gate_up's inverse: gate, up (sources 0, 1) -> [gate_0; up_0 | gate_1; up_1 | ...] for `shards` TP
    shards (a torch_dist save: shards = 1, [gate; up])."""
    part = sizes[0] // shards
    out: list[Segment] = []
    for s in range(shards):
        out += [Segment(source=0, start=s * part, count=part), Segment(source=1, start=s * part, count=part)]
    return tuple(out)


def mla_rope_halves(sources: list[torch.Tensor], heads: int, keep: int, rope: int) -> list[torch.Tensor]:
    """Multi-latent attention rows whose rope part rotates interleaved pairs (megatron-core's MLA, Hugging Face
    DeepseekV3 with rope_interleave=True) -> rotating halves (rope_interleave=False). Per head (`heads` blocks
    of `keep + rope` rows; the kv down projection is one block, keep = kv_lora_rank):

        [ keep rows | x0 y0 x1 y1 ... ]   ->   [ keep rows | x0 x1 ... | y0 y1 ... ]

    The keep rows (no position embedding, or the kv latent) stay as they are.
    """
    (weight,) = sources
    rest = tuple(weight.shape[1:])
    blocks = weight.reshape(heads, keep + rope, *rest)
    pairs = blocks[:, keep:].reshape(heads, rope // 2, 2, *rest).transpose(1, 2).reshape(heads, rope, *rest)
    return [torch.cat([blocks[:, :keep], pairs], dim=1).reshape(weight.shape).contiguous()]


def mla_rope_pairs_rows(sizes: tuple[int, ...], heads: int, keep: int, rope: int) -> tuple[Segment, ...]:
    """mla_rope_halves' inverse: a Hugging Face projection whose rope rows rotate halves (source 0) -> megatron-core's
    interleaved pairs. Per head, the keep rows as they are, then rope row 2i from half row i and 2i + 1 from
    half row rope/2 + i:

        [ keep rows | x0 x1 ... | y0 y1 ... ]   ->   [ keep rows | x0 y0 x1 y1 ... ]
    """
    block, half = keep + rope, rope // 2
    out: list[Segment] = []
    for h in range(heads):
        rope_at = h * block + keep
        out.append(Segment(source=0, start=h * block, count=keep))
        for i in range(half):
            out += [Segment(source=0, start=rope_at + i, count=1), Segment(source=0, start=rope_at + half + i, count=1)]
    return tuple(out)

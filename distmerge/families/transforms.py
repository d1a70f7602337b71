"""Layout transforms: small pure functions from assembled source tensors to target tensors.

Each is looked up by name from a `Unit`; families declare which one applies to which names.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from distmerge import dtypes
from distmerge.quantize import fp8

Transform = Callable[..., list[torch.Tensor]]


def identity(sources: list[torch.Tensor]) -> list[torch.Tensor]:
    """One source, one target, same layout."""
    return list(sources)


def lora_fuse(sources: list[torch.Tensor], scale: float) -> list[torch.Tensor]:
    """W + (B @ A) * scale, computed in float32 and returned in W's dtype (PEFT's merge_and_unload order).

        W (out, in)   A (r, in)   B (out, r)     all whole tensors on the unit's owner

    Always on the CPU, even with --device cuda: cuBLAS sums the product in another order than the CPU does,
    and the merged bytes must not depend on the device.
    """
    base, lora_a, lora_b = (t.to("cpu", torch.float32) for t in sources)
    fused = base + (lora_b @ lora_a) * scale
    return [fused.to(sources[0].dtype)]


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


def trim_rows(sources: list[torch.Tensor], rows: int) -> list[torch.Tensor]:
    """Padded vocabulary (Megatron rounds it up to a multiple of 128 x TP) -> the config's vocab_size rows."""
    (padded,) = sources
    return [padded[:rows].contiguous()]


def rope_permute(sources: list[torch.Tensor], heads: int) -> list[torch.Tensor]:
    """Rotary embedding on interleaved pairs (Meta's Llama, torchtitan's llama3) -> on halves (Hugging Face Llama).

    Both rotate pairs of a head's rows by the same angle; only which rows form a pair differs. Per head
    (hd rows, i < hd/2, c the pair member):

        interleaved:  [ x0 y0 | x1 y1 | ... ]          row 2i + c
        halves:       [ x0 x1 ... | y0 y1 ... ]        row c * hd/2 + i

    so tt.view(heads, hd/2, 2, cols).transpose(1, 2) is the Hugging Face order. wq takes the query heads,
    wk the key/value heads; wv and wo are not rotated and keep their rows.
    """
    (weight,) = sources
    rows, rest = weight.shape[0], tuple(weight.shape[1:])
    pairs = weight.reshape(heads, rows // heads // 2, 2, *rest)
    return [pairs.transpose(1, 2).reshape(rows, *rest).contiguous()]


def with_zero_bias(sources: list[torch.Tensor]) -> list[torch.Tensor]:
    """A linear layer saved without a bias -> its weight and a zero bias, for a class whose layer has one
    (verl's Megatron value head, Linear(hidden, 1, bias=False) -> ...ForTokenClassification's score):

        weight (rows, in)   ->   weight (rows, in), bias (rows,) = 0     (x @ W.T + 0: the same outputs)
    """
    (weight,) = sources
    return [weight, weight.new_zeros(weight.shape[0])]


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


def copies(sources: list[torch.Tensor], of: str, count: int, **params: object) -> list[torch.Tensor]:
    """One target that a checkpoint also carries under other names (DeepSeek-V3's MTP layers repeat the embedding
    and the output head, families/megatron/mtp.py): the transform `of` applied once, its one result given `count` times.

        source -> of(source) = t   ->   [t, t, ...]   (count targets, the same bytes)
    """
    (out,) = TRANSFORMS[of](sources, **params)
    return [out] * count


def quantized(sources: list[torch.Tensor], inner: str, inner_params: tuple[tuple[str, object], ...], scheme: str,
              weights: tuple[tuple[int, str], ...]) -> list[torch.Tensor]:
    """`inner`'s targets with some weights in FP8 (--quantize, fp8.py), each followed by its scales:

        inner(sources) = [t0, t1, t2]   weights ((1, "BF16"),)   ->   [t0, fp8(t1), scale(t1), t2]

    A weight is first cast to the dtype it would have had unquantized (the merge's --dtype), so the FP8 output is
    the quantization of the model the same merge writes without --quantize. On the device the unit was assembled on.
    """
    out = TRANSFORMS[inner](sources, **dict(inner_params))
    dtype_of = dict(weights)
    result: list[torch.Tensor] = []
    for i, tensor in enumerate(out):
        if i in dtype_of:
            result.extend(fp8.SCHEMES[scheme].quantize(tensor.to(dtypes.torch_dtype(dtype_of[i]))))
        else:
            result.append(tensor)
    return result


TRANSFORMS: dict[str, Transform] = {
    "identity": identity,
    "lora_fuse": lora_fuse,
    "split_qkv": split_qkv,
    "split_gate_up": split_gate_up,
    "trim_rows": trim_rows,
    "rope_permute": rope_permute,
    "with_zero_bias": with_zero_bias,
    "mla_rope_halves": mla_rope_halves,
    "copies": copies,
    "quantized": quantized,
}


def apply(name: str, sources: list[torch.Tensor], params: tuple[tuple[str, object], ...]) -> list[torch.Tensor]:
    return TRANSFORMS[name](sources, **dict(params))

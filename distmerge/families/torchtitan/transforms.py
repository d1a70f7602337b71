"""torchtitan's layouts -> Hugging Face's (the rows of tables.py name them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from distmerge.families.transforms import Params, Segment


@dataclass(frozen=True)
class RopePermute(Params):
    heads: int


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


def rope_interleave_rows(sizes: tuple[int, ...], heads: int) -> tuple[Segment, ...]:
    """rope_permute's inverse: Hugging Face's rotary halves -> torchtitan's interleaved pairs, as rows of the Hugging
    Face tensor. Per head of hd rows, torchtitan's row 2i + c is Hugging Face's row c * hd/2 + i (rope_permute's
    table read the other way):

        [ x0 x1 ... | y0 y1 ... ]   ->   [ x0 y0 | x1 y1 | ... ]

    One segment per row: the pairs are not contiguous in either layout, so a row is the largest run there is.
    """
    (rows,) = sizes
    hd = rows // heads
    half = hd // 2
    return tuple(Segment(source=0, start=h * hd + c * half + i, count=1)
                 for h in range(heads) for i in range(half) for c in (0, 1))

"""Fragments and input files for plans made in memory (test_plan.py, test_spread.py, test_average_rounds.py)."""

from __future__ import annotations

from distmerge.formats.base import Fragment, InputFile


def frag(name, shape, offsets, lengths, file_index, dtype="F32"):
    return Fragment(
        name=name, dtype=dtype, global_shape=shape, offsets=offsets, lengths=lengths,
        file_index=file_index, byte_offset=0, key=name,
    )


def files(n, size=100):
    return tuple(InputFile(index=i, path=f"f{i}", size=size, rank=i) for i in range(n))

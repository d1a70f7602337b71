"""The flat fragment kind (formats/base.Fragment with flat=True): elements start..start+count of a tensor
flattened in row-major order, starting mid-row. DeepSpeed ZeRO-1/2 partitions cut each parameter group's
flat buffer into equal slices with no regard for rows (deepspeed/runtime/zero/stage_1_and_2.py,
`get_data_parallel_partitions`), so a tensor's elements are split across ranks at arbitrary points; no
format registered yet writes such files, so the bytes here are laid out by hand as a partition would be.

The engine must plan, read, exchange and assemble them like blocks: coverage checked, direct copies where
no cast is asked, tensor assembly (view by flat range) where one is.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from distmerge.engine.assemble import UnitBuild
from distmerge.engine.plan import make_plan, merge_inventories
from distmerge.engine.reader import Reader
from distmerge.errors import LayoutError
from distmerge.families.base import Target, Unit
from distmerge.formats.base import Fragment, InputFile, Scan
from distmerge.output.writer import ShardWriter

SHAPE = (5, 7)  # 35 elements: cut at 13 and 20, mid-row both times


def flat(start: int, count: int, file_index: int, byte_offset: int = 0) -> Fragment:
    return Fragment(name="w", dtype="F32", global_shape=SHAPE, offsets=(start,), lengths=(count,),
                    file_index=file_index, byte_offset=byte_offset, key="w", flat=True)


def partitions(tmp_path: Path, cuts: list[int]) -> tuple[torch.Tensor, list[Fragment], tuple[InputFile, ...]]:
    """One file per rank holding its slice of the flat tensor after 16 bytes of something else."""
    full = torch.arange(math.prod(SHAPE), dtype=torch.float32).reshape(SHAPE) * 0.5
    frags, files = [], []
    for i, (a, b) in enumerate(zip(cuts, cuts[1:], strict=False)):
        path = tmp_path / f"rank{i}.bin"
        path.write_bytes(b"\0" * 16 + full.view(-1)[a:b].numpy().tobytes())
        frags.append(flat(a, b - a, i, byte_offset=16))
        files.append(InputFile(index=i, path=path.name, size=path.stat().st_size, rank=i))
    return full, frags, tuple(files)


def test_flat_ranges_cover_a_tensor_mid_row(tmp_path):
    _, frags, files = partitions(tmp_path, [0, 13, 20, 35])
    source = merge_inventories(frags, files)["w"]
    assert [f.flat_start() for f in source.fragments] == [0, 13, 20]


@pytest.mark.parametrize(("runs", "error"), [
    ([(0, 13), (13, 7), (20, 14)], "hold 34 of its 35"),  # the last element is missing
    ([(0, 13), (12, 8), (20, 15)], "blocks at \\[0\\] and \\[12\\] overlap"),
])
def test_gaps_and_overlaps_of_flat_ranges_are_refused(runs, error):
    frags = [flat(start, count, i) for i, (start, count) in enumerate(runs)]
    files = tuple(InputFile(index=i, path=f"f{i}", size=100) for i in range(len(frags)))
    with pytest.raises(LayoutError, match=error):
        merge_inventories(frags, files)


def test_a_flat_range_and_a_block_are_compared_as_runs():
    block = Fragment(name="w", dtype="F32", global_shape=SHAPE, offsets=(2, 0), lengths=(3, 7), file_index=1,
                     byte_offset=0, key="w")  # elements 14..34
    assert flat(0, 15, 0).overlaps(block) and not flat(0, 14, 0).overlaps(block)


@pytest.mark.parametrize("cast", [None, "BF16"])  # None: direct copies into the file; BF16: tensor assembly
def test_flat_fragments_assemble_exactly(tmp_path, cast):
    full, frags, files = partitions(tmp_path, [0, 13, 20, 35])
    sources = merge_inventories(frags, files)
    dtype = cast or "F32"
    unit = Unit(sources=("w",), targets=(Target(name="w", shape=SHAPE, dtype=dtype),))
    plan = make_plan(sources=sources, units=[unit], files=files, world=1, max_shard_bytes=10**9, budget_bytes=10**9)
    scan = Scan(format="test", root=str(tmp_path), files=files, hf_dir=None, world_size=3)
    reader = Reader(scan, fmt=None)
    out = tmp_path / "out"
    writer = ShardWriter(out, plan.files[0].name, plan.files[0].targets)
    build = UnitBuild(unit, plan, writer, torch.device("cpu"))
    assert build.direct == (cast is None)
    for name, frag in build.fragments():
        build.place_local(name, frag, reader)
    build.finish()
    writer.finish()
    reader.close()
    with safe_open(out / plan.files[0].name, framework="pt") as f:
        assert torch.equal(f.get_tensor("w"), full.to(torch.bfloat16 if cast else torch.float32))

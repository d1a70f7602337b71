"""The planner at scale keeps its answers: packed inventories carry exactly the fragments the formats found, the
one-pass coverage check accepts only what the general check accepts, and the heap-based balancing picks the
same ranks as the least-loaded scan it replaced (tests/bench/bench_scale.py measures why they exist)."""

from __future__ import annotations

import dataclasses
import pickle
import random
from pathlib import Path

import pytest

from distmerge.engine import inventory
from distmerge.engine.coverage import check_coverage, tiled_in_order
from distmerge.engine.plan import assign_owners, assign_readers
from distmerge.errors import LayoutError
from distmerge.formats import registry
from distmerge.formats.base import Fragment, InputFile
from distmerge.input import source

SAVES = [("fsdp", "fsdp2_llama_bf16_w4"), ("fsdp", "fsdp1_llama_nomesh_w4"), ("fsdp", "fsdp2_llama_hsdp_2x2"),
         ("dcp", "dcp_llama_wrapped_w4"), ("megatron", "megatron_moe_tp2ep2"), ("megatron", "megatron_dist_vpp")]


def opened(root: Path) -> list[Fragment]:
    src = source.looking_at(root)  # the folder as it is: a format used on its own
    fmt = registry.pick(src, "auto")
    scan = fmt.scan(src, {})
    return [f for file in scan.files for f in fmt.open(src, scan, file).fragments]


@pytest.mark.parametrize("family,case", SAVES)
def test_packed_inventories_unpack_to_the_same_fragments(family, case, request):
    """Real saves' fragments (DTensor and ShardedTensor blocks, DCP chunks, Megatron TP/EP slices and unstacked
    layers, views with byte offset -1 if any) survive pack -> pickle -> unpack equal and in order, split over
    ranks as the all-gather splits them, and the packed form is smaller than the pickled objects.
    Shown to fail: unpacking lengths from the offsets' slots (or dropping the empty part's rank) fails it."""
    ckpts = request.getfixturevalue(f"{family}_ckpts")
    fragments = opened(ckpts[case])
    cut = len(fragments) // 3
    parts = [fragments[:cut], [], fragments[cut:]]
    sent = [pickle.dumps(inventory.pack(p)) for p in parts]
    assert inventory.unpack([pickle.loads(s) for s in sent]) == fragments
    # the size gain shows at a rank's scale (its string tables are paid once): 50 copies, other byte offsets
    many = [dataclasses.replace(f, byte_offset=f.byte_offset + i) for i in range(50) for f in fragments]
    assert len(pickle.dumps(inventory.pack(many))) < len(pickle.dumps(many))


def test_every_fragment_field_travels():
    """A field added to Fragment must be added to the packing too, or it would silently arrive as its default.
    Shown to fail: dropping "flat" from inventory.CARRIED."""
    assert sorted(inventory.CARRIED) == sorted(f.name for f in dataclasses.fields(Fragment) if f.init)


def test_packing_keeps_flat_ranges_scalars_and_large_offsets():
    """ZeRO's flat ranges, 0-d tensors and offsets past 2**31 (a 405B rank file) keep their exact values.
    Shown to fail: a column forced to 32-bit integers loses the 2**40 offset."""
    made = [Fragment(name="a", dtype="F32", global_shape=(3, 5), offsets=(7,), lengths=(8,), file_index=2,
                     byte_offset=2**40 + 3, key="m.a", flat=True),
            Fragment(name="s", dtype="I64", global_shape=(), offsets=(), lengths=(), file_index=0, byte_offset=-1,
                     key="s"),
            Fragment(name="b", dtype="BF16", global_shape=(2**33, 2), offsets=(2**32, 0), lengths=(5, 2),
                     file_index=70000, byte_offset=0, key="b")]
    assert inventory.unpack([pickle.loads(pickle.dumps(inventory.pack(made)))]) == made


def rows(shape, cuts, flat=False):
    """Blocks of `shape` between consecutive cut points (rows, or flat elements when `flat`)."""
    out = []
    for i, (a, b) in enumerate(zip(cuts, cuts[1:], strict=False)):
        offsets, lengths = ((a,), (b - a,)) if flat else ((a, *[0] * (len(shape) - 1)), (b - a, *shape[1:]))
        out.append(Fragment(name="w", dtype="F32", global_shape=shape, offsets=offsets, lengths=lengths,
                            file_index=i, byte_offset=0, key="w", flat=flat))
    return tuple(sorted(out, key=lambda f: f.region))


def general_accepts(shape, blocks) -> bool:
    try:
        check_coverage("w", shape, blocks)
    except LayoutError:
        return False
    return True


def test_one_pass_coverage_accepts_only_what_the_general_check_accepts():
    """Random row and flat partitions, with empty shards, gaps, overlaps and blocks outside the tensor: whenever
    the one-pass check says "tiled", the general check agrees, and every valid partition of runs is recognised
    (so the fast path is taken where it should be and never lets a bad layout through).
    Shown to fail: without the `start != end` test a gap or an overlap passes as tiled."""
    rng = random.Random(14)
    for _ in range(3000):
        shape, flat = (rng.randint(1, 40), rng.randint(1, 3)), rng.random() < 0.3
        total = shape[0] * shape[1] if flat else shape[0]
        cuts = sorted([0, total] + [rng.randint(0, total) for _ in range(rng.randint(0, 6))])
        blocks = rows(shape, cuts, flat)
        if rng.random() < 0.6:  # damage one block: move it (same size: a gap and an overlap), grow it, drop it
            pick = rng.randrange(len(blocks))
            b, how = blocks[pick], rng.choice(["move", "grow", "drop"])
            offsets = (b.offsets[0] + rng.choice([-2, -1, 1, 2]) * (how == "move"), *b.offsets[1:])
            lengths = (b.lengths[0] + rng.choice([-1, 1, 3]) * (how == "grow"), *b.lengths[1:])
            kept = [] if how == "drop" else [Fragment(name="w", dtype="F32", global_shape=shape, offsets=offsets,
                                                      lengths=lengths, file_index=b.file_index, byte_offset=0,
                                                      key="w", flat=flat)]
            blocks = tuple(sorted([*blocks[:pick], *kept, *blocks[pick + 1:]], key=lambda f: f.region))
        fast, general = tiled_in_order(shape, blocks), general_accepts(shape, blocks)
        assert not fast or general, blocks
        if general:
            assert fast, blocks


def test_blocks_split_on_a_later_dimension_take_the_general_check():
    blocks = tuple(Fragment(name="w", dtype="F32", global_shape=(4, 8), offsets=(0, c), lengths=(4, 2), file_index=c,
                            byte_offset=0, key="w") for c in (0, 2, 4, 6))
    assert not tiled_in_order((4, 8), blocks) and general_accepts((4, 8), blocks)


def least_loaded(weights: list[int], world: int, most: int | None = None) -> list[int]:
    """The balancing the heap replaced: largest first, onto min(range(world)) by (load, rank); with `most`, only
    over the ranks that hold fewer items."""
    load, count, owners = [0] * world, [0] * world, [0] * len(weights)
    for i in sorted(range(len(weights)), key=lambda i: (-weights[i], i)):
        rank = min((r for r in range(world) if most is None or count[r] < most), key=lambda r: (load[r], r))
        owners[i], load[rank] = rank, load[rank] + weights[i]
        count[rank] += 1
    return owners


def test_heap_balancing_picks_the_ranks_the_scan_picked():
    """Owners and readers are part of the output's contract across versions (--resume fingerprints the plan):
    equal sizes (ties) and random ones, more and fewer items than ranks.
    Shown to fail: a heap ordered by (rank, load) gives other owners; readers follow it and the file cap."""
    rng = random.Random(7)
    for _ in range(200):
        world = rng.randint(1, 12)
        sizes = [rng.choice([5, 5, 7, rng.randint(0, 50)]) for _ in range(rng.randint(0, 30))]
        assert assign_owners(sizes, world) == least_loaded(sizes, world)
        files = tuple(InputFile(index=i, path=f"f{i}", size=s, rank=i) for i, s in enumerate(sizes))
        readers = assign_readers(files, world)
        assert list(readers) == least_loaded(sizes, world, -(-len(sizes) // world) + 1)
        assert max((readers.count(r) for r in range(world)), default=0) <= -(-len(sizes) // world) + 1


def test_no_rank_opens_more_than_its_share_of_files_plus_one():
    """Files of very different weights (Megatron: EP rank 0's file holds the dense tensors everyone else only
    copies) would pile the light ones on few ranks; at most ceil(W/N) + 1 per rank.
    Shown to fail: without the cap, rank 1 opens all 8 light files."""
    weights = [100] + [1] * 8
    files = tuple(InputFile(index=i, path=f"f{i}", size=w, rank=i) for i, w in enumerate(weights))
    readers = assign_readers(files, 2)
    assert max(readers.count(r) for r in (0, 1)) == 6

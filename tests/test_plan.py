"""The plan is pure: these tests feed it fragments directly (the layouts are torch.chunk's, as FSDP2
and DTensor shard them) and check coverage rules, file splitting, ownership and rounds."""

from __future__ import annotations

import pytest

from distmerge.engine.plan import assign_owners, assign_readers, make_plan, merge_inventories, natural_key
from distmerge.errors import LayoutError
from distmerge.families.base import FamilyContext, SourceMeta
from distmerge.families.hf import HF
from distmerge.options import parse_size
from distmerge.output.names import model_file_names as file_names
from tests.helpers.plan import files, frag


def chunked(name, rows, cols, world):
    """torch.chunk along dim 0, as FSDP2 shards: 1001 rows over 4 ranks -> 251, 251, 251, 248."""
    chunk = -(-rows // world)
    out = []
    for r in range(world):
        start = min(r * chunk, rows)
        n = max(0, min(rows, start + chunk) - start)
        out.append(frag(name, (rows, cols), (start, 0), (n, cols), r))
    return out


def test_uneven_chunks_cover_the_tensor():
    merged = merge_inventories(chunked("w", 1001, 16, 4), files(4))
    assert [f.lengths[0] for f in merged["w"].fragments] == [251, 251, 251, 248]


def test_missing_rank_is_a_coverage_error():
    pieces = [f for f in chunked("w", 1001, 16, 4) if f.file_index != 2]
    with pytest.raises(LayoutError, match="hold 12000 of its 16016 elements"):
        merge_inventories(pieces, files(4))


def test_overlapping_blocks_are_refused():
    pieces = [frag("w", (8, 4), (0, 0), (5, 4), 0), frag("w", (8, 4), (4, 0), (4, 4), 1)]
    with pytest.raises(LayoutError, match="overlap"):
        merge_inventories(pieces, files(2))


def test_shape_disagreement_names_both_files():
    pieces = [frag("w", (8, 4), (0, 0), (4, 4), 0), frag("w", (9, 4), (4, 0), (4, 4), 1)]
    with pytest.raises(LayoutError, match="f0 has shape .8, 4. F32 but f1 has .9, 4."):
        merge_inventories(pieces, files(2))


def test_replicas_read_once_from_the_lowest_file():
    # HSDP 2x2: files 0,1 and 2,3 hold the same two halves.
    halves = chunked("w", 8, 4, 2)
    pieces = halves + [frag("w", (8, 4), f.offsets, f.lengths, f.file_index + 2) for f in halves]
    merged = merge_inventories(pieces, files(4))
    assert [f.file_index for f in merged["w"].fragments] == [0, 1]


def test_shard_along_dim1_is_checked_on_that_dim():
    pieces = [frag("w", (4, 8), (0, c), (4, 2), c // 2) for c in (0, 2, 4, 6)]
    assert len(merge_inventories(pieces, files(4))["w"].fragments) == 4


def test_natural_order_and_file_names():
    names = ["model.layers.10.w", "model.layers.2.w", "lm_head.weight"]
    assert sorted(names, key=natural_key) == ["lm_head.weight", "model.layers.2.w", "model.layers.10.w"]
    assert file_names(1) == ["model.safetensors"]
    assert file_names(3)[2] == "model-00003-of-00003.safetensors"


def test_owners_and_readers_balance_bytes():
    assert assign_owners([10, 40, 30, 20], 2) == [0, 0, 1, 1]  # 40+10 and 30+20
    assert assign_readers(files(5), 2) == (0, 1, 0, 1, 0)


def plan_of(names_sizes, world, max_bytes, budget):
    pieces = [frag(n, (rows, 4), (0, 0), (rows, 4), 0) for n, rows in names_sizes]
    sources = merge_inventories(pieces, files(1))
    untied = FamilyContext(config={"tie_word_embeddings": False}, cast=None)
    units = HF.units({n: s.meta for n, s in sources.items()}, untied).units
    return make_plan(sources=sources, units=units, files=files(1), world=world, max_shard_bytes=max_bytes,
                     budget_bytes=budget)


def test_split_by_size_in_name_order_and_rounds_fit_budget():
    plan = plan_of([(f"layers.{i}.w", 10) for i in range(12)], world=2, max_bytes=400, budget=200)
    assert [len(f.targets) for f in plan.files] == [2, 2, 2, 2, 2, 2]  # 160 bytes each, 400 max
    assert plan.files[0].targets[0].name == "layers.0.w" and plan.files[-1].targets[-1].name == "layers.11.w"
    assert sorted(f.owner for f in plan.files) == [0, 0, 0, 1, 1, 1]
    for units in plan.rounds:
        for rank in (0, 1):
            mine = [i for i in units if plan.owner_of_unit[i] == rank]
            assert sum(plan.units[i].targets[0].nbytes for i in mine) <= 200
    assert sorted(i for r in plan.rounds for i in r) == list(range(12))


def test_tied_head_dropped_only_when_config_ties():
    metas = {
        "lm_head.weight": SourceMeta(name="lm_head.weight", dtype="F32", shape=(10, 4)),
        "model.embed_tokens.weight": SourceMeta(name="model.embed_tokens.weight", dtype="F32", shape=(10, 4)),
    }
    tied = HF.units(metas, FamilyContext(config={"tie_word_embeddings": True}, cast=None)).units
    untied = HF.units(metas, FamilyContext(config={"tie_word_embeddings": False}, cast="BF16")).units
    assert [u.targets[0].name for u in tied] == ["model.embed_tokens.weight"]
    assert {u.targets[0].dtype for u in untied} == {"BF16"}


@pytest.mark.parametrize(("text", "value"), [("5GB", 5 * 10**9), ("512MiB", 512 * 2**20), ("1000", 1000),
                                             ("1.5KB", 1500), ("2gib", 2 * 2**30)])
def test_parse_size(text, value):
    assert parse_size(text) == value

"""Output files written by several ranks (distmerge/engine/spread.py): when whole files cannot balance the
writing, units are spread over the ranks of a host, mostly onto the rank that read them. The merges of every
N=2/N=3 test with one output file go through shared files; these tests check the plan's promises directly."""

from __future__ import annotations

import json
import random

import pytest

from distmerge.engine import exchange, spread
from distmerge.engine.discover import discover
from distmerge.engine.plan import make_plan, merge_inventories
from distmerge.engine.prepare import OutputSettings, prepare_merge
from distmerge.families.base import FamilyContext
from distmerge.families.hf import HF
from distmerge.formats import registry
from distmerge.input import source
from tests.conftest import merge_inproc, torchrun
from tests.helpers.plan import files, frag


def layer_plan(rows: list[int], *, world: int, max_bytes: int, hosts=None, inputs: int = 1):
    """One tensor per entry of `rows` (4 fp32 columns), tensor i saved whole in input file i % inputs."""
    pieces = [frag(f"layers.{i}.w", (n, 4), (0, 0), (n, 4), i % inputs) for i, n in enumerate(rows)]
    sources = merge_inventories(pieces, files(inputs))
    units = HF.units({n: s.meta for n, s in sources.items()}, FamilyContext(config={}, cast=None)).units
    return make_plan(sources=sources, units=units, files=files(inputs), world=world, max_shard_bytes=max_bytes,
                     budget_bytes=1 << 30, hosts=hosts)


def crossing_bytes(plan) -> int:
    """Bytes the exchange moves between ranks over the whole merge."""
    return sum(f.nbytes for k in range(len(plan.rounds)) for frags in exchange.lanes(plan, plan.brings(k)).values()
               for f in frags)


def test_whole_files_are_kept_when_they_balance():
    """Four equal files over two ranks: two each, nothing shared (shown to fail with TOLERANCE = -1)."""
    plan = layer_plan([10] * 8, world=2, max_bytes=320)
    assert len(plan.files) == 4 and not any(f.shared for f in plan.files)
    assert [plan.written_by(r) for r in (0, 1)] == [640, 640]


def test_one_file_is_shared_within_one_unit_of_the_mean():
    """Random unit sizes, one output file, 8 ranks: every unit has one writer, every rank writes within one
    unit of the mean (the largest-first bound), and the file's owner is one of its writers. Shown to fail with
    the locality pass allowed past the mean (`load[r] + size <= 2 * mean`)."""
    rng = random.Random(7)
    rows = [rng.randint(1, 400) for _ in range(300)]
    plan = layer_plan(rows, world=8, max_bytes=10**9, inputs=8)
    (file,) = plan.files
    assert file.shared and file.writers == tuple(range(8)) and file.owner in file.writers
    loads = [plan.written_by(r) for r in range(8)]
    assert sum(loads) == file.nbytes
    assert max(loads) - file.nbytes / 8 <= max(rows) * 16


def test_ranks_share_files_only_within_a_host():
    """Two hosts of two ranks (ranks 0,1 and 2,3): no file has writers on both. Shown to fail with
    `hosts or (0,) * world` replaced by `(0,) * world` in make_plan."""
    plan = layer_plan([50] * 6 + [7] * 10, world=4, max_bytes=1500, hosts=(0, 0, 2, 2))
    assert any(f.shared for f in plan.files)
    for f in plan.files:
        assert len({r // 2 for r in (f.writers or (f.owner,))}) == 1, f
    assert max(plan.written_by(r) for r in range(4)) <= 1.3 * plan.total_bytes / 4


@pytest.mark.parametrize("world", [2, 3])
def test_a_zero_save_is_written_where_it_was_read(ds_ckpts, world):
    """A real ZeRO-2 save (each optimizer file holds one run of the flattened model) into one output file: each
    rank writes about its share, and what crosses ranks is close to what must (the bytes a rank writes beyond
    what it read), where whole-file ownership sends everything the other ranks read to the one owner. Shown to
    fail with the locality pass removed (N=2: 412032 bytes cross instead of 384)."""
    found = discover(ds_ckpts["ds_z2_fp32_w2"].resolve(), "auto", None, {})
    fmt = registry.get(found.scan.format)
    src = source.looking_at(found.scan.root)
    fragments = [frag for f in found.scan.files for frag in fmt.open(src, found.scan, f).fragments]
    plan = prepare_merge(found, fragments, world, OutputSettings()).plan
    (file,) = plan.model_files
    assert file.shared
    loads = [plan.written_by(r) for r in range(world)]
    assert max(loads) <= 1.05 * file.nbytes / world
    whole = prepare_merge(found, fragments, world, OutputSettings(), hosts=tuple(range(world))).plan
    assert not any(f.shared for f in whole.files)  # one rank per host: nothing to share
    read = [sum(f.nbytes for s in plan.sources.values() for f in s.fragments if plan.readers[f.file_index] == r)
            for r in range(world)]
    must = sum(max(0, file.nbytes / world - read[r]) for r in range(world))
    assert crossing_bytes(plan) <= must + 0.05 * file.nbytes < crossing_bytes(whole)


def test_balanced_is_relative_to_the_mean():
    assert spread.balanced([105, 95]) and not spread.balanced([106, 94]) and not spread.balanced([10, 0])


@pytest.mark.torchrun
def test_a_shared_file_is_whole_or_absent(fsdp_ckpts, tmp_path):
    """Two ranks write the one model.safetensors; rank 1 fails in round 2, after both have written parts of it
    (DISTMERGE_TEST_FAIL_AT, the engine's test hook). Nothing is left: no final file, no partial one, no index.
    Then the same merge, whole: byte-identical to one process's. Shown to fail with `writer.abort()` not
    removing the temporary file (the partial file stayed)."""
    args = ("--input", fsdp_ckpts["fsdp2_llama_w4"], "--budget", "16KiB", "--quiet")
    failed = torchrun(2, "merge", *args, "--output", tmp_path / "failed", env={"DISTMERGE_TEST_FAIL_AT": "1:2"})
    assert failed.returncode != 0
    left = (tmp_path / "failed").iterdir() if (tmp_path / "failed").exists() else ()  # gone when the merge made it
    assert sorted(p.name for p in left if p.name != ".distmerge") == []  # and left it empty (output/local_lock.py)
    assert torchrun(2, "merge", *args, "--output", tmp_path / "two").returncode == 0
    assert merge_inproc(*args, "--output", tmp_path / "one") == 0
    two, one = (tmp_path / name / "model.safetensors" for name in ("two", "one"))
    assert two.read_bytes() == one.read_bytes()
    index = json.loads((tmp_path / "two" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {"model.safetensors"}

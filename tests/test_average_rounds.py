"""An average's tensor over --budget comes in several rounds (engine/plan.py `portions`, engine/fold.py `advance`): each
round brings whole inputs of it, in the order given, under the budget (or one input alone), and its owner folds them
as they come. So a rank receives one round's inputs of a tensor, never all K at once, and the bytes written are the
ones of a merge that brings all K in one round."""

from __future__ import annotations

import pytest

from distmerge.average import fold as average_fold  # noqa: F401  (registers the `average` fold)
from distmerge.engine import exchange
from distmerge.engine import fold as engine_fold
from distmerge.engine.plan import make_plan, merge_inventories
from distmerge.families.base import Target, Unit
from tests.conftest import assert_exact, expected_tensors, load_merged, merge_inproc, torchrun, tree_bytes
from tests.helpers.average import average, inputs
from tests.helpers.plan import files, frag

MIB = 1 << 20
ROWS = MIB // (4 * 1024)  # a 1 MiB float32 tensor of 1024 columns


def averaged(count: int, shared: bool = False) -> Unit:
    """One target averaged over `count` inputs' `input-k:w` (1 MiB each, input k in file k); `shared`: a base-model
    source `base:b` that every input's step takes too (as a --base-model weight several inputs' units share)."""
    sources = tuple(f"input-{k}:w" for k in range(count)) + (("base:b",) if shared else ())
    steps = tuple(((k, count) if shared else (k,), ()) for k in range(count))
    return Unit(sources=sources, targets=(Target(name="w", shape=(ROWS, 1024), dtype="F32"),), transform="average",
                params=(("inputs", steps), ("weights", (1 / count,) * count), ("floating", (True,)), ("names", ("w",))))


def plan_of(unit: Unit, budget: int, world: int = 2):
    frags = [frag(name, (ROWS, 1024), (0, 0), (ROWS, 1024), k) for k, name in enumerate(unit.sources)]
    return make_plan(sources=merge_inventories(frags, files(len(frags))), units=[unit], files=files(len(frags)),
                     world=world, max_shard_bytes=1 << 40, budget_bytes=budget)


def brought(plan) -> list[tuple[str, ...]]:
    return [names for k in range(len(plan.rounds)) for _, names in plan.brings(k)]


def crossing(plan, k: int) -> int:
    return sum(f.nbytes for frags in exchange.lanes(plan, plan.brings(k)).values() for f in frags)


@pytest.mark.parametrize("budget, rounds", [
    (int(2.5 * MIB), [("input-0:w", "input-1:w"), ("input-2:w", "input-3:w")]),
    (MIB, [("input-0:w",), ("input-1:w",), ("input-2:w",), ("input-3:w",)]),
    (int(0.5 * MIB), [("input-0:w",), ("input-1:w",), ("input-2:w",), ("input-3:w",)]),  # one input over it: alone
])
def test_a_tensor_over_the_budget_brings_whole_inputs_in_order(budget, rounds):
    """Four 1 MiB inputs of one tensor: as many inputs per round as the budget holds, in order. Seen to fail with
    every unit in one round (the four inputs, 4 MiB, crossing ranks in one round)."""
    plan = plan_of(averaged(4), budget)
    assert brought(plan) == rounds
    assert all(plan.rounds[k] == (0,) for k in range(len(rounds)))
    assert [plan.last_round_of(0, k) for k in range(len(rounds))] == [False] * (len(rounds) - 1) + [True]
    assert max(crossing(plan, k) for k in range(len(rounds))) <= max(budget, MIB)


def test_a_source_every_input_shares_comes_with_the_first():
    plan = plan_of(averaged(3, shared=True), 2 * MIB)
    assert brought(plan) == [("input-0:w", "base:b"), ("input-1:w", "input-2:w")]


def test_under_the_budget_or_not_a_fold_one_round():
    assert brought(plan_of(averaged(4), 4 * MIB)) == [("input-0:w", "input-1:w", "input-2:w", "input-3:w")]
    whole = Unit(sources=("w",), targets=(Target(name="w", shape=(ROWS, 1024), dtype="F32"),))
    plan = plan_of(whole, MIB // 2)
    assert brought(plan) == [("w",)] and plan.carried == {}


THREE = ("fsdp2_llama_w1", "fsdp2_llama_w4", "fsdp2_llama_w2")


def test_carried_over_rounds_the_average_is_the_formula(fsdp_ckpts, tmp_path, monkeypatch):
    """--budget 1KiB: the tiny model's tensors but the norms are over it, so each of their three inputs comes in a
    round of its own; the output is the formula's, byte for byte the output of the default budget (all in one round)."""
    ckpts = [fsdp_ckpts[c] for c in THREE]
    advanced: list[int] = []
    advance = engine_fold.FoldBuild.advance

    def counted(self, names):
        before = self.step
        advance(self, names)
        if len(names) < len(self.unit.sources):  # a round before the tensor's last: its input folded in, nothing kept
            advanced.append((len(names), self.step - before, len(self.received) + len(self.local)))

    monkeypatch.setattr(engine_fold.FoldBuild, "advance", counted)
    assert merge_inproc(*inputs(*ckpts), "--average", "--budget", "1KiB", "--output", tmp_path / "small") == 0
    refs = [expected_tensors(c) for c in ckpts]
    over = sum(3 * t.numel() * t.element_size() > 1024 for t in refs[0].values())  # the tensors carried
    assert over >= 10 and advanced == [(1, 1, 0)] * (2 * over)  # their rounds before the last: one input each
    monkeypatch.undo()
    assert merge_inproc(*inputs(*ckpts), "--average", "--output", tmp_path / "default") == 0
    assert tree_bytes(tmp_path / "small") == tree_bytes(tmp_path / "default")
    assert_exact(load_merged(tmp_path / "small"), average(refs))


@pytest.mark.torchrun
def test_two_processes_carry_a_tensor_over_rounds(fsdp_ckpts, tmp_path):
    """The same under torchrun N=2, where the inputs' fragments cross ranks round by round: the bytes of one
    process with everything in one round."""
    ckpts = [fsdp_ckpts[c] for c in THREE]
    args = [*inputs(*ckpts), "--average", "--average-weights", "0.5,-0.25,0.75"]
    assert merge_inproc(*args, "--output", tmp_path / "one") == 0
    run = torchrun(2, "merge", *args, "--budget", "1KiB", "--output", tmp_path / "two", "--quiet")
    assert run.returncode == 0, run.stderr[-3000:]
    assert tree_bytes(tmp_path / "one") == tree_bytes(tmp_path / "two")


def test_verify_in_memory_carries_a_tensor_over_rounds(fsdp_ckpts, tmp_path, capsys):
    """verify's sink (each target compared as it is built) takes a carried tensor in the round that ends it."""
    from distmerge.front.cli import main as distmerge_main

    ckpts = [fsdp_ckpts[c] for c in THREE]
    assert merge_inproc(*inputs(*ckpts), "--average", "--output", tmp_path / "avg") == 0
    capsys.readouterr()
    merged = [a for c in ckpts for a in ("--merged", str(c))]
    args = ["verify", *merged, "--average", "--budget", "1KiB", "--reference", str(tmp_path / "avg")]
    assert distmerge_main(args) == 0
    assert "verify: PASS 21 tensors bit-exact" in capsys.readouterr().out

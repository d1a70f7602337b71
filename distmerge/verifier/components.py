"""Which units of two plans are compared together, by whom, in which round (pure: the same on every rank).

verify of one checkpoint against another plans both (each as merge would, Hugging Face names on both); a pair
of target names (verifier/listing.py) joins the unit of one plan that builds its merged tensor with the unit of the
other that builds its reference tensor. A comparison component is a connected set of units across the two plans:

    plan A (FSDP)     q_proj   k_proj   v_proj        one unit per target
                         \\       |       /            pairs: q-q, k-k, v-v
    plan B (Megatron)     linear_qkv -> q, k, v       one unit, three targets (split_qkv)

Each component gets one owner (largest first onto the rank with the fewest bytes, plan.assign_owners), and each
owner takes its components in order in batches whose source bytes, both sides together, fit the budget; round k
is every owner's k-th batch (as plan._rounds does for one plan). Those owners and rounds are imposed on both
plans, which the engine then runs in lockstep (engine.run.run_in_lockstep): an owner builds all of a component's
targets, both sides, in the same round.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import replace

from distmerge import dtypes
from distmerge.disjoint_sets import DisjointSets
from distmerge.engine.plan import Plan, assign_owners


def comparison_plans(a: Plan, b: Plan, pairs: Iterable[tuple[str, str]], world: int,
                     budget: int) -> tuple[Plan, Plan]:
    """`pairs`: (target name in `a`, target name in `b`) of every comparison. Returns both plans doing only the
    units of those targets, with the components' owners and rounds."""
    comps = components(a, b, pairs)
    sizes = [sum(_target_bytes(a if s == 0 else b, i) for s, i in comp) for comp in comps]
    owners = assign_owners(sizes, world)
    rounds = _rounds([sum(_source_bytes(a if s == 0 else b, i) for s, i in comp) for comp in comps], owners,
                     world, budget)
    return _imposed(a, 0, comps, owners, rounds), _imposed(b, 1, comps, owners, rounds)


def components(a: Plan, b: Plan, pairs: Iterable[tuple[str, str]]) -> list[list[tuple[int, int]]]:
    """Connected sets of (side, unit index), side 0 for `a` and 1 for `b`, each sorted, in order of their first
    member: the same on every rank."""
    unit_a, unit_b = _unit_of_target(a), _unit_of_target(b)
    compared: DisjointSets[tuple[int, int]] = DisjointSets()
    for name_a, name_b in pairs:
        compared.join((0, unit_a[name_a]), (1, unit_b[name_b]))
    return sorted(sorted(group) for group in compared.groups())


def _unit_of_target(plan: Plan) -> dict[str, int]:
    return {t.name: i for i, u in enumerate(plan.units) for t in u.targets}


def _target_bytes(plan: Plan, unit: int) -> int:
    return sum(t.nbytes for t in plan.units[unit].targets)


def _source_bytes(plan: Plan, unit: int) -> int:
    metas = (plan.sources[s].meta for s in plan.units[unit].sources)
    return sum(math.prod(m.shape) * dtypes.itemsize(m.dtype) for m in metas)


def _rounds(need: list[int], owners: list[int], world: int, budget: int) -> list[int]:
    """The round of each component: each owner's components in order, a new round when the budget is full."""
    filled, depth = [0] * world, [-1] * world
    out = []
    for c, owner in enumerate(owners):
        if depth[owner] < 0 or filled[owner] + need[c] > budget:
            depth[owner] += 1
            filled[owner] = 0
        filled[owner] += need[c]
        out.append(depth[owner])
    return out


def _imposed(plan: Plan, side: int, comps: list[list[tuple[int, int]]], owners: list[int],
             rounds: list[int]) -> Plan:
    """`plan` doing only its units of the components, each on its component's owner, in its component's round
    (a unit the plan carried over several rounds comes whole in that one: the components' rounds are joint)."""
    owner_of = list(plan.owner_of_unit)
    by_round: dict[int, list[int]] = defaultdict(list)
    for comp, owner, k in zip(comps, owners, rounds, strict=True):
        for s, unit in comp:
            if s == side:
                owner_of[unit] = owner
                by_round[k].append(unit)
    depth = max(rounds, default=-1) + 1
    return replace(plan, owner_of_unit=tuple(owner_of), rounds=tuple(tuple(sorted(by_round[k])) for k in range(depth)),
                   carried={})

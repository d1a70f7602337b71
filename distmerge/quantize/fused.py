"""Fused sets: the weights vLLM loads as one matrix (q/k/v as qkv_proj, gate/up as gate_up_proj, Mixtral's w1/w3)
share NVFP4's global scale, as llm-compressor's model_free_ptq writes them (its DEFAULT_FUSED_MAPPINGS). One unit
must produce a whole set, so that its owner computes that scale from every member, whichever ranks read them and
however many processes there are: the units producing the members of a set are joined into one before planning.

    unit q   [q_src]  -> identity -> [q.weight]
    unit k   [k_src]  -> identity -> [k.weight]          unit  [q_src, k_src, v_src] -> joined -> [q, k, v]
    unit v   [v_src]  -> identity -> [v.weight]    ->
    (Megatron's linear_qkv is one unit already: split_qkv -> [q, k, v], nothing to join)

A joined unit holds its members' sources together, as Megatron's fused qkv and fc1 units do; a unit is never split
across output files, so the set lands in one file. The sets, by name (each member the same prefix):

    <...attn or attention>.{q_proj, k_proj, v_proj}.weight     attention
    <...attn or attention>.{wq_a, wkv_a_with_mqa}.weight       DeepSeek's multi-latent attention, in its own names
    <...mlp>.{gate_proj, up_proj}.weight                       dense MLPs (not Qwen's or DeepSeek's experts, nor
                                                               shared experts: `mlp.experts.E.gate_proj` is not
                                                               `mlp.gate_proj`, and the peer leaves them apart)
    <...>.{w1, w3}.weight                                      Mixtral's experts

A set counts when all its members are weights of the model (as the peer finds them among the tensor names); its
members that are quantized share the scale.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection

from distmerge.disjoint_sets import DisjointSets
from distmerge.families.base import Target, Unit
from distmerge.families.joined import join_units

SETS: tuple[tuple[re.Pattern[str], tuple[str, ...]], ...] = tuple(
    (re.compile(rf"(?P<prefix>{prefix})(?P<member>{'|'.join(members)})\.weight"), members) for prefix, members in (
        (r".*(?:attn|attention)\.", ("q_proj", "k_proj", "v_proj")),
        (r".*(?:attn|attention)\.", ("wq_a", "wkv_a_with_mqa")),
        (r".*mlp\.", ("gate_proj", "up_proj")),
        (r".*", ("w1", "w3")),
    ))


def sets_of(names: Collection[str]) -> dict[str, str]:
    """Each weight that is a member of a complete fused set -> the set's key (its prefix and first member)."""
    present = set(names)
    found: dict[str, str] = {}
    for pattern, members in SETS:
        for name in names:
            m = pattern.fullmatch(name)
            if m and name not in found and all(f"{m['prefix']}{x}.weight" in present for x in members):
                found[name] = f"{m['prefix']}{members[0]}"
    return found


def join(units: list[Unit], quantizes: Callable[[Target], bool]) -> tuple[list[Unit], dict[str, str]]:
    """The units with those that produce members of one set joined into one (in the place of the first), and each
    quantized member's set key."""
    names = [t.name for u in units for t in u.targets if t.group == "model"]
    sets = {name: key for name, key in sets_of(names).items()}
    sets = {t.name: sets[t.name] for u in units for t in u.targets if t.name in sets and quantizes(t)}
    grouped = DisjointSets(range(len(units)))
    first: dict[str, int] = {}
    for i, unit in enumerate(units):
        for t in unit.targets:
            if t.name in sets:
                grouped.join(i, first.setdefault(sets[t.name], i))
    members = grouped.groups()  # each in unit order
    joined = {min(m): join_units([units[i] for i in m]) for m in members if len(m) > 1}
    done = {i for m in members if len(m) > 1 for i in m}
    return [joined.get(i, u) for i, u in enumerate(units) if i not in done or i in joined], sets

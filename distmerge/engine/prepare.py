"""From what discovery found and the ranks' inventories to the plan: the one planning path of merge and inspect.

    inventories --plan.merge_inventories--> source tensors (coverage checked)
                --families.base.claim-----> the family for these names --units--> units, extra files, notes
                --plan.make_plan----------> output files, owners, rounds
                (+ the sources the family wrote into no unit: the engine checks them, see unwritten.py)

Pure and deterministic: every rank calls it with the same arguments and gets the same plan.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from distmerge import catalog
from distmerge.average import units as average
from distmerge.average.units import AverageOptions
from distmerge.dtypes import CAST_CHOICES
from distmerge.engine import inputs, unwritten
from distmerge.engine import plan as planning
from distmerge.engine.discover import Discovery
from distmerge.engine.placement import Placement
from distmerge.engine.plan import Plan
from distmerge.errors import InputError
from distmerge.families.base import FamilyContext, LoraOptions, SourceMeta, Unit, claim, rewrite
from distmerge.formats.base import BASE_MODEL_PREFIX, Fragment, input_prefix
from distmerge.output import is_store, is_url
from distmerge.output.store import Sharing


@dataclass(frozen=True, kw_only=True)
class OutputSettings:
    """The options that shape the output: each field but `budget_bytes` and `output` (the run's) is set by the
    options declared in output_options.py, and holds their default when made with no arguments."""

    dtype: str = "keep"  # a --dtype choice
    max_shard_bytes: int = 5 * 10**9
    budget_bytes: int = 128 * 2**20
    lora: LoraOptions = field(default_factory=LoraOptions)
    output: Path | str = Path()  # a folder, or an object-store URL
    quantize: str | None = None  # a --quantize choice (quantize.schemes.SCHEMES): linear weights in FP8 or 4 bits
    average: AverageOptions = field(default_factory=AverageOptions)  # --average, --average-weights


# The units joined as a caller needs them (the one-pass import: the Hugging Face tensors of one Megatron tensor on
# one owner, in one round), given the family's units and config.json; it may refuse in one line (a DistmergeError).
Together = Callable[[list[Unit], dict[str, Any]], list[Unit]]


@dataclass(frozen=True, kw_only=True)
class Prepared:
    """The plan, and the sources the family wrote into no unit, for the engine to check (unwritten.py)."""

    plan: Plan
    left_out: dict[str, str] = field(default_factory=dict)
    must_equal: tuple[tuple[str, str], ...] = ()


def plan_merge(found: Discovery, fragments: list[Fragment], world: int, settings: OutputSettings) -> Plan:
    """inspect's plan: it reads no tensor data, so the sources left out are named, not measured."""
    prepared = prepare_merge(found, fragments, world, settings)
    notes = unwritten.left_out_notes(prepared.left_out) + [f"{a} not written: a copy of {b}, written in its place"
                                                           for a, b in prepared.must_equal]
    return replace(prepared.plan, notes=(*prepared.plan.notes, *notes))


def prepare_merge(found: Discovery, fragments: list[Fragment], world: int, settings: OutputSettings,
                  hosts: tuple[int, ...] | None = None, sharing: Sharing | None = None,
                  placement: Placement | None = None, together: Together | None = None) -> Prepared:
    """`hosts[r]`: the host of rank r, for plan.make_plan (None: every rank on one host); `sharing`: what the
    output store lets several ranks do with one file (None: a local folder's rule); `placement`: the input on the
    nodes' own disks (placement.Placement); `together`: the caller's joining of the units (Together)."""
    catalog.install()  # the families, transforms and rewrites the claim and the plan look up by name
    scan = found.scan
    sources = planning.merge_inventories(fragments, scan.files)
    # The checkpoint's own tensors go to the family's claim; a second input root's (--base-model) ride along.
    base = {name.removeprefix(BASE_MODEL_PREFIX): s.meta for name, s in sources.items()
            if name.startswith(BASE_MODEL_PREFIX)}
    ctx = FamilyContext(config=found.config, cast=CAST_CHOICES[settings.dtype], hints=scan.hints, lora=settings.lora,
                        output=_shown(settings.output), base_weights=base)
    # An average's inputs (engine/inputs.py): each input's tensors to its own family, the results joined
    results, families = [], []
    for i, own in enumerate(inputs.scans(scan)):
        metas = _own_tensors(sources, i, len(scan.parts))
        if not metas:
            raise InputError(f"{own.root}: the rank files hold no tensors")
        families.append(claim(list(metas), found.config, own.hints))
        results.append(average.prefixed(families[-1].units(metas, replace(ctx, hints=own.hints)), input_prefix(i)))
    family, result = families[0], results[0]
    if scan.parts:
        result = average.combine(results, settings.average.of(len(results)), [s.root for s in inputs.scans(scan)])
    # the options that rewrite any family's result (base.register_rewrite), after the family: its targets carry
    # Hugging Face names, which their tables match
    result = rewrite(result, settings, family.traits(found.config), found.config)
    if together is not None:
        result = replace(result, units=together(list(result.units), found.config))
    if base and not any(s.startswith(BASE_MODEL_PREFIX) for u in result.units for s in u.sources):
        result = replace(result, notes=[*result.notes, "--base-model: the folder's weights were not needed (the "
                                                       "checkpoint holds its own), none was read"])
    plan = planning.make_plan(
        sources=sources,
        units=result.units,
        files=scan.files,
        world=world,
        max_shard_bytes=settings.max_shard_bytes,
        budget_bytes=settings.budget_bytes,
        extra_files=result.extra_files,
        notes=tuple(result.notes),
        hosts=hosts,
        sharing=sharing,
        placement=placement,
    )
    # finalize writes them into config.json, those made late as it writes it
    plan = replace(plan, config_updates=dict(result.config_updates), config_later=dict(result.config_later))
    return Prepared(plan=plan, left_out=dict(result.left_out), must_equal=tuple(result.must_equal))


def _own_tensors(sources: dict[str, planning.SourceTensor], index: int, parts: int) -> dict[str, SourceMeta]:
    """Input `index`'s tensors under their own names (without input_prefix), a --base-model folder's left out."""
    prefix = input_prefix(index)
    others = tuple(input_prefix(i) for i in range(1, parts + 1) if i != index) + (BASE_MODEL_PREFIX,)
    return {name.removeprefix(prefix): replace(s.meta, name=name.removeprefix(prefix)) for name, s in sources.items()
            if name.startswith(prefix) and not name.startswith(others)}


def _shown(output: Path | str | object) -> str:
    if is_store(output):
        return output.url  # type: ignore[attr-defined]
    return str(output) if is_url(output) else str(Path(output).resolve())

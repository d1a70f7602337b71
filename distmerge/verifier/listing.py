"""Pairing (rank 0, headers only): which merged tensor is compared with which reference tensor, and what
is settled from the headers alone (missing, extra, shape). Tied heads follow the model family's traits."""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path

from distmerge import catalog, dtypes
from distmerge.engine.inputs import InputSpec
from distmerge.engine.prepare import OutputSettings
from distmerge.errors import ConfigError
from distmerge.families import hub_names
from distmerge.families.base import ModelTraits, claim
from distmerge.families.megatron import mtp
from distmerge.formats.base import Hints
from distmerge.input import source
from distmerge.input.tree import CONFIG_CAP
from distmerge.natural_order import natural_key
from distmerge.quantize.compare import Encoding, encoding_of
from distmerge.verifier.report import Check, Criteria
from distmerge.verifier.sides import Side, open_side


@dataclass(frozen=True, kw_only=True)
class VerifyOptions:
    """What `verify` compares (the API of verify.run.verify and verify_and_report, kept stable for callers).

    Each side is an engine.inputs.InputSpec: where it is and how to read it. `merged` is either a finished Hugging
    Face model (a folder holding model.safetensors.index.json or model.safetensors, or one weights file), compared
    as it is, or any checkpoint `merge` reads (FSDP rank files, DCP, Megatron, DeepSpeed, torchtitan, LoRA runs; a
    folder, s3://bucket/prefix or a Source): that one is merged in memory, as `merge` with its spec and `settings`
    would, and each tensor compared with the reference; nothing is written (verifier/checkpoint.py). Several
    `merged` checkpoints with settings.average on are averaged in memory as `merge --average` averages them.
    `reference`: a Hugging Face folder or file, or a checkpoint too (detected, or named by its spec's format; its
    config.json from its spec's hf_config when it has none of its own): merged in memory with the same `settings`
    and compared with `merged`, whichever kind that is (verifier/kinds.py). A spec's format, hf_config,
    format_options and base_model apply to a checkpoint only (given with a finished model they are an error);
    `settings`: --dtype, --lora, --budget and the rest.
    """

    merged: InputSpec
    reference: InputSpec
    criteria: Criteria = field(default_factory=Criteria)
    logits: bool = False
    json: Path | None = None
    quiet: bool = False
    settings: OutputSettings = field(default_factory=OutputSettings)

    def __post_init__(self) -> None:
        # a caller's path or str works too: a side read as it is found
        for name in ("merged", "reference"):
            if not isinstance(getattr(self, name), InputSpec):
                object.__setattr__(self, name, InputSpec(locations=getattr(self, name)))
        if isinstance(self.json, str):
            object.__setattr__(self, "json", Path(self.json))


@dataclass(frozen=True, kw_only=True)
class Pair:
    """Names on both sides with equal shapes: the tensors one rank reads and compares."""

    name: str
    merged_name: str  # differs from `name` only for a tied head: the embedding the model re-uses
    reference_name: str
    note: str = ""
    # an encoded weight's (merge --quantize) tensors on the merged side it is decoded with, its scales: the weight is
    # compared decoded (bounded.py)
    parts: tuple[str, ...] = ()
    per: int = 1  # reference elements per stored element of the merged weight (2: e2m1 pairs in a byte)


@dataclass(frozen=True, kw_only=True)
class Listing:
    merged: Side
    reference: Side
    traits: ModelTraits = field(default_factory=ModelTraits)  # what the merged model is (its family's)
    ties: bool
    hub_rules: hub_names.Rules = ()  # a vision-language model's module <-> hub name prefixes (hub_names.py)
    pairs: tuple[Pair, ...]
    settled: tuple[Check, ...]  # decided from the headers alone (missing, extra, shape)
    encoding: Encoding | None = None  # how the merged model's weights are stored, when encoded (merge --quantize)
    model_dtype: str | None = None  # the dtype of most of its floating bytes: what its encoded weights were encoded
    # from (a quantized model's config.json names the dtype its loader decodes them into, which may be another)


def make_listing(opts: VerifyOptions) -> Listing:
    """Rank 0: both sides finished models (kinds.py said so: each one local path)."""
    path = Path(opts.merged.location)
    merged = open_side(path, role="merged model", allow_torch=False)
    reference = open_side(Path(opts.reference.location), role="reference", allow_torch=True)
    return pair_sides(merged, reference, merged_config(beside(path)))


def beside(model: Path) -> Path:
    """The config.json of a finished model: in its folder, or beside its one weights file."""
    return model / "config.json" if source.of(model).is_dir(model) else model.parent / "config.json"


def pair_sides(merged: Side, reference: Side, config: dict | None, later: dict | None = None) -> Listing:
    """`config`: the merged model's config.json (None: there is none, so nothing says a head is tied); `later`: the
    values merge would make late in it (Plan.config_later: a model merged in memory), which may say how its weights
    are encoded."""
    catalog.install()  # the families claim chooses from
    traits = claim(list(merged.tensors), config or {}, Hints()).traits(config or {})
    ties = config is not None and traits.ties(config)  # no config.json: nothing says the head is tied
    # Both sides under the names save_pretrained writes (a reference saved with the module's names of a
    # vision-language model pairs with the merged hub names), each mapped back to the side's own name.
    rules = hub_names.rules_for(config or {})
    encoding = encoding_of(config or {}, later)
    # stored weight -> its pair's fields (the tensors it is decoded with, compared decoded), and the stored weight of
    # each weight the reference names (a 4-bit one is stored as <module>.weight_packed)
    codes = {n: loc.dtype for n, loc in merged.tensors.items()}
    encoded, stored = encoding.stored(codes) if encoding else ({}, {})
    part_names = {n for fields in encoded.values() for n in fields["parts"]}
    on_merged = {hub_names.to_hub(stored.get(n, n), rules): n for n in merged.tensors if n not in part_names}
    on_reference = {hub_names.to_hub(n, rules): n for n in reference.tensors}
    tied = _tied(traits, rules, {*on_merged, *on_reference}) if ties else {}
    pairs, settled = [], []
    # MTP layers the reference lacks entirely (save_pretrained of transformers' DeepSeek-V3 has no module for
    # them): nothing to compare with, which is not a failure (families/megatron/mtp.py)
    absent = tuple(p for p in mtp.layer_prefixes(config or {}) if not any(n.startswith(p) for n in on_reference))
    for name in sorted(set(on_merged) | set(on_reference), key=natural_key):
        if name.startswith(absent) and name not in on_reference:
            settled.append(replace(_settled(name, merged, reference, "not in reference", "", None), passed=True,
                                   reason="a multi-token-prediction layer: the reference has none of it"))
            continue
        pair = _pair(name, on_merged, on_reference, tied, merged, reference)
        if isinstance(pair, Check):
            settled.append(pair)
            continue
        m, r = merged.tensors[pair.merged_name], reference.tensors[pair.reference_name]
        fields = encoded.get(pair.merged_name, {})
        if _logical(m.shape, fields.get("per", 1)) == r.shape:
            pairs.append(replace(pair, **fields))
        else:
            settled.append(_settled(name, merged, reference, "shape", _shape_reason(m.shape, r.shape), pair))
    return Listing(merged=merged, reference=reference, traits=traits, ties=ties, hub_rules=rules, pairs=tuple(pairs),
                   settled=tuple(settled), encoding=encoding, model_dtype=_main_dtype(merged))


def _logical(shape: tuple[int, ...], per: int) -> tuple[int, ...]:
    """The weight's shape from its stored one (e2m1 pairs: half the columns)."""
    return shape if per == 1 else (*shape[:-1], shape[-1] * per)


def _main_dtype(side: Side) -> str | None:
    """The floating dtype holding most of the side's bytes, of those a config.json may name (as merge's finalize
    finds it: engine.finalize.main_dtype)."""
    by_bytes: Counter[str] = Counter()
    for loc in side.tensors.values():
        if dtypes.announced(loc.dtype):
            by_bytes[loc.dtype] += math.prod(loc.shape) * dtypes.itemsize(loc.dtype)
    return by_bytes.most_common(1)[0][0] if by_bytes else None


def merged_config(path: Path) -> dict | None:
    """The config.json at `path`, looked up as the model's files are (sides.open_side), or None."""
    src = source.of(path)
    if not src.is_file(path):
        return None
    try:
        config = json.loads(src.read_text(path, CONFIG_CAP, "config.json"))
    except ValueError:
        raise ConfigError(f"{path} is not valid JSON: fix it or copy the training run's config.json") from None
    return config if isinstance(config, dict) else {}


def _tied(traits: ModelTraits, rules: hub_names.Rules, names: set[str]) -> dict[str, str]:
    """Head -> the embedding it re-uses, in hub names; of a family's candidate embeddings, the one present."""
    tied: dict[str, str] = {}
    for head, embed in traits.tied_heads:
        if hub_names.to_hub(embed, rules) in names:
            tied.setdefault(hub_names.to_hub(head, rules), hub_names.to_hub(embed, rules))
    return tied


def _pair(name: str, on_merged: dict[str, str], on_reference: dict[str, str], tied: dict[str, str], merged: Side,
          reference: Side) -> Pair | Check:
    """`name` in hub names; `on_*`: hub name -> the side's own name; `tied`: head -> embedding, when the merged
    config ties them (else empty)."""
    m, r = on_merged.get(name), on_reference.get(name)
    if m and r:
        return Pair(name=name, merged_name=m, reference_name=r)
    embed = tied.get(name)
    why = "merged config.json ties embeddings; the model re-creates the head from"
    if embed and r and embed in on_merged:
        return Pair(name=name, merged_name=on_merged[embed], reference_name=r,
                    note=f"tied head: {why} {embed}; compared reference {r} with merged {on_merged[embed]}")
    if embed and m and embed in on_reference:
        return Pair(name=name, merged_name=m, reference_name=on_reference[embed],
                    note=f"tied head: {why} {embed}; compared merged {m} with reference {on_reference[embed]}")
    outcome = "missing in merged" if r else "extra in merged"
    return _settled(name, merged, reference, outcome, outcome,
                    Pair(name=name, merged_name=m or "", reference_name=r or ""))


def _settled(name: str, merged: Side, reference: Side, outcome: str, reason: str, pair: Pair | None) -> Check:
    m = merged.tensors.get(pair.merged_name if pair else name)
    r = reference.tensors.get(pair.reference_name if pair else name)
    return Check(
        name=name, passed=False, outcome=outcome, reason=reason,
        file=Path(merged.files[m.file]).name if m else None,
        shape=m.shape if m else None, reference_shape=r.shape if r else None,
        dtype=m.dtype if m else None, reference_dtype=r.dtype if r else None, note=pair.note if pair else "",
    )


def _shape_reason(shape: tuple[int, ...], ref: tuple[int, ...]) -> str:
    transposed = " (transposed)" if len(shape) == 2 and shape == ref[::-1] else ""
    return f"shape {list(shape)}, reference {list(ref)}{transposed}"


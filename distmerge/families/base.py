"""The contract between model families and the engine: units of work, declared as data.

Call order (distmerge/engine/prepare.py drives it, the same for merge and inspect; verify asks `describe`):

    claim(names, config, hints)   the first registered family, in `order`, whose claims() is true
    family.units(sources, ctx)    -> FamilyResult: units (source names -> Hugging Face targets through a
                                  named transform), extra JSON files, notes; pure, no I/O, the same on
                                  every rank
    family.traits(config)         -> ModelTraits: what the written model is (tied heads, the transformers
                                  class to load it with, where its attention sizes live)
    rewrite(result, settings, ...)  the result rewritten by each output option that has a rewrite
                                  (add_rewrite) and that the settings turn on

A family module defines its instance; distmerge/catalog.py, the one list of every family, transform and rewrite,
puts it here with `register` (catalog.install). A family
written as a table of rows (megatron/, torchtitan/) finds each source's row with `matched_rows`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, TypeVar

from distmerge import dtypes
from distmerge.errors import ConfigError, InputError
from distmerge.families.transforms import NO_PARAMS, Params
from distmerge.formats.base import Hints


@dataclass(frozen=True, kw_only=True)
class SourceMeta:
    """A global source tensor as the plan sees it (all fragments merged)."""

    name: str
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True, kw_only=True)
class Target:
    """One output tensor: its Hugging Face name, shape and output dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    group: str = "model"  # "model": the sharded model files; other groups: output/names.py GROUP_FILES

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * dtypes.itemsize(self.dtype)


@dataclass(frozen=True, kw_only=True)
class Unit:
    """Assemble `sources`, apply the named transform (see transforms.py), produce `targets`.

    A unit is never split across output files, so one owner holds everything it needs.
    """

    sources: tuple[str, ...]
    targets: tuple[Target, ...]
    transform: str = "identity"
    params: Params = NO_PARAMS  # the transform's own dataclass (families/transforms.py)


def output_dtype(source_dtype: str, cast: str | None) -> str:
    """--dtype casts floating tensors only; integer and bool buffers keep their dtype."""
    return cast if cast and dtypes.is_float(source_dtype) else source_dtype


@dataclass(frozen=True, kw_only=True)
class LoraOptions:
    mode: str = "auto"  # auto (= adapter when LoRA keys exist), adapter, merge
    alpha: float | None = None  # overrides lora_train_meta.json
    base_model: str | None = None  # base_model_name_or_path for adapter_config.json


@dataclass(frozen=True, kw_only=True)
class FamilyContext:
    """What a family may consult besides the tensors: the HF config, the format's hints, the options."""

    config: dict[str, Any]
    cast: str | None
    hints: Hints = field(default_factory=Hints)
    lora: LoraOptions = field(default_factory=LoraOptions)
    output: str = ""
    # The --base-model folder's tensors (a second input root), by their Hugging Face name; each SourceMeta's
    # `name` is the source a unit reads. Empty without the option. For checkpoints that lack their base (LoRA-only).
    base_weights: dict[str, SourceMeta] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class FamilyResult:
    units: list[Unit]
    extra_files: dict[str, dict[str, Any]] = field(default_factory=dict)  # relative path -> JSON to write
    notes: list[str] = field(default_factory=list)
    # Sources the family reads into no unit (families do no I/O; the engine checks them, see unwritten.py):
    left_out: dict[str, str] = field(default_factory=dict)  # source -> why the output has no place for it
    must_equal: tuple[tuple[str, str], ...] = ()  # (dropped copy, written source) that must hold equal values
    # config.json keys the written model needs in place of the input's (a value head: its architectures and one
    # label); finalize writes them over the input config
    config_updates: dict[str, Any] = field(default_factory=dict)
    # config.json keys whose value is made only as finalize writes config.json, on rank 0 (making it may cost
    # seconds: a library to import): key -> a record whose `config()` makes it
    config_later: dict[str, Later] = field(default_factory=dict)


class Later(Protocol):
    """A config.json value made late (FamilyResult.config_later)."""

    def config(self) -> Any:
        """The value, made on rank 0 as finalize writes config.json."""
        ...

    def dtype(self, main: str | None) -> str | None:
        """The dtype config.json names, given the one most written bytes are in (`main`): `main`, or the dtype the
        model's loader turns it into (a quantized model's)."""
        ...


@dataclass(frozen=True, kw_only=True)
class ModelTraits:
    """What the written model is, for merge (tied heads), verify and inspect alike."""

    tied_heads: tuple[tuple[str, str], ...] = ()  # (head, embedding): the head is not written when tied
    auto_class: str = "AutoModelForCausalLM"  # the transformers class that loads it (verify --logits)
    config_block: str | None = None  # config.json key holding the attention sizes (VL: "text_config")
    outputs: str = "logits"  # what the model's forward gives (verify --logits compares it): "logits" or "values"

    def sizes(self, config: dict[str, Any]) -> dict[str, Any]:
        """Top-level keys, and what only the sizes block (when there is one) holds."""
        block = config.get(self.config_block) if self.config_block else None
        return {**block, **config} if isinstance(block, dict) else dict(config)

    def ties(self, config: dict[str, Any]) -> bool:
        """transformers' default is to tie; a config saved by it writes the key whenever it differs."""
        return bool(self.sizes(config).get("tie_word_embeddings", True))

    def dropped_heads(self, shapes: dict[str, tuple[int, ...]], config: dict[str, Any]) -> set[str]:
        """Heads the config ties to an embedding present with the same shape: the model re-creates them."""
        if not self.ties(config):
            return set()
        return {h for h, e in self.tied_heads if h in shapes and e in shapes and shapes[h] == shapes[e]}


# A causal language model as transformers writes it. The head is dropped when the config ties
# embeddings and the embedding is there with the same shape (the model re-creates the head from it).
# Vision-language models nest the embedding under model.language_model. (hub_names.py).
CAUSAL_LM = ModelTraits(tied_heads=(("lm_head.weight", "model.embed_tokens.weight"),
                                    ("lm_head.weight", "model.language_model.embed_tokens.weight")),
                        auto_class="AutoModelForCausalLM", config_block="text_config")

# A vision-language model (a vision_config in config.json): the same heads, loaded by another auto class.
IMAGE_TEXT_LM = replace(CAUSAL_LM, auto_class="AutoModelForImageTextToText")


# transformers' classes of a causal LM's body under another head, by suffix: Qwen2ForTokenClassification is
# Qwen2ForCausalLM's body with a value head (what a PPO critic's own config.json names). A layout whose family
# handles that head (value_head.py) maps it through the causal LM's table.
HEAD_CLASSES = ("ForTokenClassification",)
CAUSAL_CLASS = "ForCausalLM"


def body_class(arch: str) -> str:
    """Qwen2ForTokenClassification -> Qwen2ForCausalLM; any other name as it is."""
    head = next((h for h in HEAD_CLASSES if arch.endswith(h)), None)
    return arch[: -len(head)] + CAUSAL_CLASS if head else arch


def table_for(config: dict[str, Any], tables: Collection[str], model_types: dict[str, str], layout: str,
              heads: bool = False) -> str:
    """The architecture whose table maps this model: config.json's `architectures`, else its `model_type`.
    `heads`: the layout's family writes value heads, so a head class maps through its family's causal LM."""
    archs = config.get("architectures") or [model_types.get(config.get("model_type", ""), "")]
    arch = next((a for a in (body_class(a) if heads else a for a in archs) if a in tables), None)
    if arch is None:
        raise ConfigError(f"config.json's architecture {archs[0] or config.get('model_type')!r} has no {layout} "
                          f"mapping; supported: {', '.join(tables)}")
    return arch


class TableRow(Protocol):
    @property
    def source(self) -> str: ...  # a source tensor's name, `{}` for each layer or expert number


R = TypeVar("R", bound=TableRow)


def row_pattern(source: str) -> re.Pattern[str]:
    """A table row's source name as a pattern: each `{}` matches a number, a group of its own."""
    return re.compile(re.escape(source).replace(r"\{\}", r"(\d+)"))


def compile_rows(rows: Iterable[R]) -> list[tuple[R, re.Pattern[str]]]:
    return [(row, row_pattern(row.source)) for row in rows]


def matched_rows(sources: dict[str, SourceMeta], rows: list[tuple[R, re.Pattern[str]]], layout: str, arch: str,
                 aliases: dict[str, str] | None = None) -> Iterator[tuple[SourceMeta, R, tuple[str, ...]]]:
    """Each source with the first row whose pattern takes its name (`aliases`: the name to match it by instead)
    and the numbers in it, in the sources' order. A source no row takes would be dropped from the output: once
    the others are given, an InputError names them (so an error raised while building a unit comes first)."""
    unmapped = []
    for meta in sources.values():
        name = (aliases or {}).get(meta.name, meta.name)
        found = next(((row, m) for row, pattern in rows if (m := pattern.fullmatch(name))), None)
        if found is None:
            unmapped.append(meta.name)
            continue
        yield meta, found[0], found[1].groups()
    if unmapped:
        shown = ", ".join(sorted(unmapped)[:6])
        raise InputError(f"{len(unmapped)} {layout} tensors have no mapping for {arch} ({shown}): distmerge "
                         "would drop them; is config.json for this model?")


def config_int(config: dict[str, Any], key: str, layout: str) -> int:
    """An integer the `layout` (a family's word) needs from config.json, or a ConfigError that says so."""
    value = config.get(key)
    if not isinstance(value, int):
        raise ConfigError(f"config.json has no integer {key}, which the {layout} layout needs")
    return value


class Family(Protocol):
    name: str
    order: int  # asked in this order; the first that claims the tensors wins (a fallback comes last)

    def claims(self, names: Collection[str], config: dict[str, Any], hints: Hints) -> bool: ...

    def units(self, sources: dict[str, SourceMeta], ctx: FamilyContext) -> FamilyResult: ...

    def traits(self, config: dict[str, Any]) -> ModelTraits: ...


@dataclass(frozen=True)
class NamingFamily:
    """A family that takes every tensor of one naming (the format's hints say whose names they are), turns
    them into units with `build` (a pure function of the family's own module) and writes a causal LM."""

    name: str
    naming: str
    order: int
    build: Callable[[dict[str, SourceMeta], FamilyContext], FamilyResult]

    def claims(self, names: Collection[str], config: dict[str, Any], hints: Hints) -> bool:
        return hints.naming == self.naming

    def units(self, sources: dict[str, SourceMeta], ctx: FamilyContext) -> FamilyResult:
        return self.build(sources, ctx)

    def traits(self, config: dict[str, Any]) -> ModelTraits:
        return IMAGE_TEXT_LM if isinstance(config.get("vision_config"), dict) else CAUSAL_LM


REGISTERED: list[Family] = []


def register(family: Family) -> Family:
    """Make `family` known to claim, in its declared order; catalog.install calls it."""
    if any(f.name == family.name for f in REGISTERED):
        raise AssertionError(f"two model families are named {family.name!r}")
    REGISTERED.append(family)
    REGISTERED.sort(key=lambda f: (f.order, f.name))
    return family


# An output option's rewrite of any family's result, by the OutputSettings field that turns it on (its value given
# to the rewrite); distmerge/catalog.py lists each (add_rewrite), and prepare.py applies it after the family
Rewrite = Callable[[FamilyResult, Any, ModelTraits, dict[str, Any]], FamilyResult]
REWRITES: dict[str, Rewrite] = {}


def add_rewrite(setting: str, rewrite: Rewrite) -> None:
    """Make `rewrite` the one the OutputSettings field `setting` turns on; catalog.install calls it."""
    assert setting not in REWRITES, f"two rewrites of {setting}"
    REWRITES[setting] = rewrite


def rewrite(result: FamilyResult, settings: object, traits: ModelTraits, config: dict[str, Any]) -> FamilyResult:
    """The family's result rewritten by each registered option that `settings` turns on (a truthy field)."""
    for setting, rewrite_ in REWRITES.items():
        if value := getattr(settings, setting):
            result = rewrite_(result, value, traits, config)
    return result


def claim(names: Collection[str], config: dict[str, Any], hints: Hints, *, skip: Family | None = None) -> Family:
    """The family for these tensors; `skip` lets a wrapping family (LoRA) find the one it wraps."""
    assert REGISTERED, "no model family is registered: call distmerge.catalog.install() first"
    for family in REGISTERED:
        if family is not skip and family.claims(names, config, hints):
            return family
    shown = ", ".join(sorted(names)[:4])
    raise InputError(f"no model family of distmerge knows these tensors ({shown}, ...; {hints.naming} names)")

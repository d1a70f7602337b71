"""What the user says the checkpoint is, checked against what its weights and config.json say.

A claim never changes the output: distmerge reads what a model is from its weights and config.json. A claim that
agrees is silent; one that contradicts them is an error before any tensor data is read (verl's
--is-value-model, --tie-word-embedding, --num-attention-heads, --num-key-value-heads: verl_cli.py).

    kind                  agrees when
    value_model           the model written is a value model (config.json ...ForTokenClassification)
    tied_embeddings       config.json ties the output layer to the embedding
    num_attention_heads   config.json's number (of its text model, for a vision-language model)
    num_key_value_heads   config.json's number (num_attention_heads when it has none: plain multi-head)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from distmerge.engine.plan import Plan
from distmerge.errors import DistmergeError
from distmerge.families.base import CAUSAL_LM, HEAD_CLASSES


class ClaimError(DistmergeError):
    """An option says the checkpoint is something its weights or config.json say it is not."""


@dataclass(frozen=True, kw_only=True)
class Claim:
    flag: str  # the option as the user spelled it, named in the error
    kind: str  # a key of CHECKS
    value: int | bool = True


def check(claims: tuple[Claim, ...], config: dict[str, Any], plan: Plan) -> None:
    """Every claim against config.json and the plan (what will be written). Pure: the same on every rank."""
    written = {**config, **plan.config_updates}
    names = {t.name: t.shape for f in plan.files for t in f.targets}
    for claim in claims:
        CHECKS[claim.kind](claim, written, names)


def _value_model(claim: Claim, config: dict[str, Any], names: Mapping[str, tuple[int, ...]]) -> None:
    arch = (config.get("architectures") or [""])[0]
    if arch.endswith(HEAD_CLASSES):
        return
    head = "lm_head.weight"
    what = (f"a vocabulary head ({head} {list(names[head])})" if head in names
            else "no value head (its output layer is tied to the embedding)")
    named = f" (config.json: {arch})" if arch else ""
    raise ClaimError(f"{claim.flag}, but the checkpoint is a language model: {what}{named}; drop {claim.flag}, "
                     "or pass the critic's checkpoint")


def _tied(claim: Claim, config: dict[str, Any], names: Mapping[str, tuple[int, ...]]) -> None:
    if CAUSAL_LM.ties(config):
        return
    raise ClaimError(f"{claim.flag}, but config.json has tie_word_embeddings false and the checkpoint its own "
                     f"output layer: drop {claim.flag} (distmerge reads the tie from config.json)")


def _config_number(key: str, default_key: str | None = None) -> Callable[..., None]:
    def check_number(claim: Claim, config: dict[str, Any], names: Mapping[str, tuple[int, ...]]) -> None:
        sizes = CAUSAL_LM.sizes(config)
        found = sizes.get(key, sizes.get(default_key) if default_key else None)
        if found == claim.value:
            return
        said = f"{key} {found}" if found is not None else f"no {key}"
        raise ClaimError(f"{claim.flag} {claim.value}, but config.json says {said}: pass the config of this "
                         f"checkpoint's model (--hf-config), or drop {claim.flag}")
    return check_number


CHECKS: dict[str, Callable[[Claim, dict[str, Any], Mapping[str, tuple[int, ...]]], None]] = {
    "value_model": _value_model,
    "tied_embeddings": _tied,
    "num_attention_heads": _config_number("num_attention_heads"),
    "num_key_value_heads": _config_number("num_key_value_heads", "num_attention_heads"),
}


def check_checkpoint(claims: tuple[Claim, ...], root: Path, fmt: str, hf_config: Path | None,
                     options: Mapping[str, Any]) -> None:
    """The claims about a checkpoint that is not merged (verl's `test`): planned as a merge plans it, from the
    headers, in this process."""
    from distmerge.engine import discover as disc
    from distmerge.engine.prepare import OutputSettings, prepare_merge
    from distmerge.engine.reader import Reader
    from distmerge.formats import registry

    found = disc.discover(disc.check_input(root), fmt, hf_config, options)
    reader = Reader(found.scan, registry.get(found.scan.format))
    try:
        fragments = reader.open(list(range(len(found.scan.files))))
    finally:
        reader.close()
    check(claims, found.config, prepare_merge(found, fragments, 1, OutputSettings()).plan)

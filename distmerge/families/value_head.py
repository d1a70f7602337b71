"""Value heads (PPO critics): the actor's model with one value per token in place of the vocabulary head.

verl's critic, as it is built and saved (read in verl's sources):

    FSDP      AutoModelForTokenClassification.from_pretrained(actor, num_labels=1)
              -> score.weight [1, hidden], score.bias [1]; no lm_head
    Megatron  GPTModel whose output_layer is LinearForLastLayer(hidden, 1): a plain torch Linear, neither
              vocabulary-parallel nor tied, a full copy on every TP rank
              -> output_layer.weight [1, hidden]; output_layer.bias [1] only from verl's older model
              initializer (bias=True), none from its Megatron-Bridge path (bias=False)

Both save the actor's config.json as they loaded it: `architectures` still says ...ForCausalLM, and
AutoModelForCausalLM loads the body and a random lm_head without a word. So a value model is told from its
weights (a one-row head, no lm_head), never from that config, and written as save_pretrained writes the
family's ...ForTokenClassification model: score.weight, score.bias (zeros for a head saved without one: the
same values), and config.json's `architectures` and one label (id2label / label2id: how transformers stores
num_labels=1).

Hugging Face names: `ValueHeadFamily` below claims them. Megatron names: the Megatron family asks
`megatron_head` and hands its body units to `with_megatron_head`.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import replace
from typing import Any

import torch

from distmerge.errors import ConfigError, LayoutError
from distmerge.families.base import (
    FamilyContext,
    FamilyResult,
    ModelTraits,
    SourceMeta,
    Target,
    Unit,
    claim,
    output_dtype,
)
from distmerge.formats.base import Hints

SCORE_WEIGHT, SCORE_BIAS = "score.weight", "score.bias"  # ...ForTokenClassification's head (a Linear with bias)
LM_HEAD = "lm_head.weight"
MEGATRON_WEIGHT, MEGATRON_BIAS = "output_layer.weight", "output_layer.bias"
CAUSAL_SUFFIX, VALUE_SUFFIX = "ForCausalLM", "ForTokenClassification"
ONE_LABEL = {"id2label": {"0": "LABEL_0"}, "label2id": {"LABEL_0": 0}}  # what save_pretrained writes for 1 label

# What a merged value model is: no tied head, loaded by AutoModelForTokenClassification, one value per token.
VALUE_MODEL = ModelTraits(auto_class="AutoModelForTokenClassification", config_block="text_config", outputs="values")


def megatron_head(sources: dict[str, SourceMeta]) -> tuple[str, ...]:
    """The sources of a Megatron value head (an output layer of one row, and its bias if saved), or () for a
    language model (an output layer of vocabulary rows, or none when tied)."""
    weight = sources.get(MEGATRON_WEIGHT)
    if weight is None or len(weight.shape) != 2 or weight.shape[0] != 1:
        return ()
    return tuple(n for n in (MEGATRON_WEIGHT, MEGATRON_BIAS) if n in sources)


def with_megatron_head(body: FamilyResult, sources: dict[str, SourceMeta], ctx: FamilyContext,
                       hidden: int | None) -> FamilyResult:
    """The body's units plus the head as score.weight / score.bias, and the config of a value model."""
    weight, bias = sources[MEGATRON_WEIGHT], sources.get(MEGATRON_BIAS)
    if hidden is not None and weight.shape != (1, hidden):
        raise LayoutError(f"{MEGATRON_WEIGHT} has shape {list(weight.shape)}, a value head of config.json's "
                          f"hidden_size needs [1, {hidden}]: wrong config.json?")
    dtype = output_dtype(weight.dtype, ctx.cast)
    score = Target(name=SCORE_WEIGHT, shape=weight.shape, dtype=dtype)
    if bias is None:
        zero = Target(name=SCORE_BIAS, shape=(1,), dtype=dtype)
        head = [Unit(sources=(weight.name,), targets=(score, zero), transform="with_zero_bias")]
        how = f"{MEGATRON_WEIGHT} -> {SCORE_WEIGHT}, {SCORE_BIAS} = 0 (the head was saved without a bias)"
    else:
        if bias.shape != (1,):
            raise LayoutError(f"{MEGATRON_BIAS} has shape {list(bias.shape)}, a value head's bias is [1]")
        head = [Unit(sources=(weight.name,), targets=(score,)),
                Unit(sources=(bias.name,), targets=(Target(name=SCORE_BIAS, shape=(1,),
                                                           dtype=output_dtype(bias.dtype, ctx.cast)),))]
        how = f"{MEGATRON_WEIGHT}, {MEGATRON_BIAS} -> {SCORE_WEIGHT}, {SCORE_BIAS}"
    return as_value_model(replace(body, units=[*body.units, *head]), ctx.config, how)


def as_value_model(result: FamilyResult, config: dict[str, Any], how: str) -> FamilyResult:
    """`result` with config.json made a one-label ...ForTokenClassification and a note that says so."""
    updates = value_config(config)
    arch = updates.get("architectures", ["(no architectures in config.json)"])[0]
    note = f"value model (PPO critic): {how}; config.json: {arch}, one label"
    return replace(result, config_updates={**result.config_updates, **updates}, notes=[*result.notes, note])


def value_config(config: dict[str, Any]) -> dict[str, Any]:
    """The config.json keys of a one-label token-classification model of the config's family."""
    archs = config.get("architectures") or []
    updates: dict[str, Any] = {}
    if archs:
        updates["architectures"] = [token_classification(archs[0])]
    labels = config.get("id2label")
    if not (isinstance(labels, dict) and len(labels) == 1 and isinstance(config.get("label2id"), dict)):
        updates.update(ONE_LABEL)  # keeps a label the run named itself
    if "num_labels" in config:
        updates["num_labels"] = 1
    return updates


def token_classification(arch: str) -> str:
    """Qwen2ForCausalLM -> Qwen2ForTokenClassification (transformers names them so for every family)."""
    if arch.endswith(VALUE_SUFFIX):
        return arch
    if not arch.endswith(CAUSAL_SUFFIX):
        raise ConfigError(f"the checkpoint is a value model (one value per token) but config.json's architecture "
                          f"{arch!r} is not a causal LM whose ...{VALUE_SUFFIX} class distmerge can name: pass "
                          f"--hf-config with a config.json that names it")
    return arch[: -len(CAUSAL_SUFFIX)] + VALUE_SUFFIX


class ValueHeadFamily:
    """Hugging Face names with a token-classification head and no lm_head (verl's FSDP critic): the tensors
    as they are (the Hugging Face family's units), config.json made a value model's when the head has one row."""

    name = "value_head"
    order = 80  # before the Hugging Face family (90), which would write the same tensors under the actor's config

    def claims(self, names: Collection[str], config: dict[str, Any], hints: Hints) -> bool:
        # score.bias too: a sequence-classification head (a reward model) is a score.weight without one
        return hints.naming == "hf" and SCORE_WEIGHT in names and SCORE_BIAS in names and LM_HEAD not in names

    def units(self, sources: dict[str, SourceMeta], ctx: FamilyContext) -> FamilyResult:
        result = claim(list(sources), ctx.config, ctx.hints, skip=self).units(sources, ctx)
        if sources[SCORE_WEIGHT].shape[0] != 1:
            return result  # a token classifier of several labels: its config already says what it is
        return as_value_model(result, ctx.config, f"{SCORE_WEIGHT}, {SCORE_BIAS} as saved")

    def traits(self, config: dict[str, Any]) -> ModelTraits:
        return VALUE_MODEL


VALUE_HEAD = ValueHeadFamily()


def with_zero_bias(sources: list[torch.Tensor]) -> list[torch.Tensor]:
    """A linear layer saved without a bias -> its weight and a zero bias, for a class whose layer has one
    (verl's Megatron value head, Linear(hidden, 1, bias=False) -> ...ForTokenClassification's score):

        weight (rows, in)   ->   weight (rows, in), bias (rows,) = 0     (x @ W.T + 0: the same outputs)
    """
    (weight,) = sources
    return [weight, weight.new_zeros(weight.shape[0])]

"""The model-family contract, checked on every registered family (families/base.py).

Expected names and shapes come from transformers itself: each sample's tiny Hugging Face model is written
by `save_pretrained`, and the names and shapes in that file are what the family must write (transformers 5
keeps MoE experts fused in memory but saves them per expert, so the module's state dict is not the answer).
A new family only needs a row in SAMPLES. What the tests prove:
- claim: the registry's order gives the sample to its own family;
- round trip: the family's targets are exactly the Hugging Face model's names and shapes, every source
  is used once, no target is written twice;
- tied heads: tying the config drops exactly the family's tied heads, nothing else;
- Megatron tables: every row of every table is reached by some architecture, through its own pattern
  (no row is shadowed by an earlier one), in both the Transformer Engine and the local spelling.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import replace
from itertools import product
from typing import Any

import pytest

from distmerge.families.base import CAUSAL_LM, REGISTERED, FamilyContext, LoraOptions, claim
from distmerge.families.megatron.tables import FAMILIES
from distmerge.formats.base import Hints
from tests.helpers.families import SPELLINGS, Sample, hf_state, megatron_sources, metas, torchtitan_samples, tt_hf_state


# -- samples -------------------------------------------------------------------------------------------
def hf_samples() -> list[Sample]:
    config, state = hf_state("LlamaForCausalLM")
    return [Sample(config=config, sources=metas(state), expected=state)]


def lora_samples() -> list[Sample]:
    config, state = hf_state("LlamaForCausalLM")
    sources = {}
    for name, shape in state.items():
        module = name.removesuffix(".weight")
        if module.endswith(("q_proj", "v_proj")):
            sources[f"base_model.model.{module}.base_layer.weight"] = shape
            sources[f"base_model.model.{module}.lora_A.default.weight"] = (2, shape[1])
            sources[f"base_model.model.{module}.lora_B.default.weight"] = (shape[0], 2)
        else:
            sources[f"base_model.model.{name}"] = shape
    hints = Hints(lora_meta={"r": 2, "lora_alpha": 4})
    return [Sample(config=config, sources=metas(sources), expected=state, hints=hints, lora=LoraOptions(mode=m))
            for m in ("adapter", "merge")]


def value_head_samples() -> list[Sample]:
    """verl's FSDP critic: save_pretrained of the one-label ...ForTokenClassification, under the actor's config."""
    samples = []
    for arch in ("LlamaForCausalLM", "Qwen2ForCausalLM"):
        config, state = hf_state(arch, "AutoModelForTokenClassification", num_labels=1)
        samples.append(Sample(config=config, sources=metas(state), expected=state))
    return samples


def megatron_states(arch: str) -> list[tuple[dict[str, Any], dict[str, tuple[int, ...]]]]:
    """DeepSeek-V3: the torchtitan samples' model (dense first layer, then MoE), with and without the query LoRA."""
    if arch == "DeepseekV3ForCausalLM":
        return [tt_hf_state("deepseek_v3", q_lora) for q_lora in (True, False)]
    return [hf_state(arch)]


def megatron_samples() -> list[Sample]:
    samples = []
    for arch in FAMILIES:
        for spelling, (config, state) in product(SPELLINGS, megatron_states(arch)):
            samples.append(Sample(config=config, sources=megatron_sources(arch, spelling, state), expected=state,
                                  hints=Hints(naming="megatron")))
    return samples


SAMPLES = {"hf": hf_samples, "lora": lora_samples, "megatron": megatron_samples, "torchtitan": torchtitan_samples,
           "value_head": value_head_samples}
FAMILY_NAMES = [f.name for f in REGISTERED]


def run(sample: Sample, config: dict[str, Any]):
    family = claim(list(sample.sources), config, sample.hints)
    ctx = FamilyContext(config=config, cast=None, hints=sample.hints, lora=sample.lora, output="/out")
    return family, family.units(sample.sources, ctx)


# -- the tests -----------------------------------------------------------------------------------------
def test_every_registered_family_has_samples():
    assert set(SAMPLES) == set(FAMILY_NAMES), "add samples of each new family to SAMPLES"


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_round_trip_to_hugging_face_names_and_shapes(name):
    for sample in SAMPLES[name]():
        family, result = run(sample, sample.config)
        assert family.name == name
        model = [t for u in result.units for t in u.targets if t.group == "model"]
        names = Counter(t.name for t in model)
        assert max(names.values()) == 1, [n for n, c in names.items() if c > 1]
        assert {t.name: t.shape for t in model} == sample.expected
        used = Counter(s for u in result.units for s in u.sources)
        assert set(used) == set(sample.sources) and max(used.values()) == 1


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_tied_config_drops_exactly_the_tied_heads(name):
    for sample in SAMPLES[name]():
        family, untied = run(sample, sample.config)
        _, tied = run(sample, {**sample.config, "tie_word_embeddings": True})
        names = {t.name for u in untied.units for t in u.targets}
        kept = {t.name for u in tied.units for t in u.targets}
        heads = {h for h, e in family.traits(sample.config).tied_heads if h in names and e in names}
        # a family without tied heads (a value model's) drops nothing
        assert (heads or not family.traits(sample.config).tied_heads) and names - kept == heads


def test_lora_adapter_and_fused_units():
    adapter, merged = (run(s, s.config)[1] for s in lora_samples())
    saved = {t.name for u in adapter.units for t in u.targets if t.group == "adapter"}
    assert saved == {f"base_model.model.model.layers.{i}.self_attn.{p}_proj.lora_{ab}.weight" for i in range(2)
                     for p in "qv"
                     for ab in "AB"}  # PEFT saves its own prefix, without the adapter name
    assert "lora_adapter/adapter_config.json" in adapter.extra_files
    fused = [u for u in merged.units if u.transform == "lora_fuse"]
    assert len(fused) == 4 and all(len(u.sources) == 3 for u in fused)
    assert dict(fused[0].params) == {"scale": 2.0}


def test_every_megatron_row_is_reached_through_its_own_pattern():
    from distmerge.families.megatron.family import _compiled

    reached: set[str] = set()
    for arch in FAMILIES:
        for spelling, (_, state) in product(SPELLINGS, megatron_states(arch)):
            megatron_sources(arch, spelling, state, reached)
        for row, _pattern in _compiled(arch):
            name = row.source.format(*range(row.source.count("{}")))
            first = next(r for r, p in _compiled(arch) if p.fullmatch(name))
            assert first.targets == row.targets, f"{arch}: {row.source} is shadowed by {first.source}"
    every = {row.source for rows in FAMILIES.values() for row in rows}
    assert every - reached == set(), "table rows no architecture reaches"


def test_traits_read_the_sizes_block():
    vl = {"text_config": {"num_attention_heads": 8, "tie_word_embeddings": False}, "hidden_size": 32}
    assert CAUSAL_LM.sizes(vl)["num_attention_heads"] == 8 and not CAUSAL_LM.ties(vl)
    assert CAUSAL_LM.ties({}) and replace(CAUSAL_LM, tied_heads=()).dropped_heads({"lm_head.weight": (1,)}, {}) == set()
    assert re.fullmatch(r"Auto\w+", CAUSAL_LM.auto_class)

"""Hugging Face state dicts and the training-side sources each family maps them from, by the families' own libraries
(test_contract_families.py, test_merge_megatron_mla.py, test_merge_torchtitan.py)."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

from distmerge.families.base import LoraOptions, SourceMeta
from distmerge.families.megatron.tables import FAMILIES, MODEL_TYPES, Row
from distmerge.formats.base import Hints
from distmerge.formats.safetensors_header import read_header
from distmerge.input import source

SMALL = dict(hidden_size=16, num_attention_heads=4, num_key_value_heads=2, head_dim=4, intermediate_size=24,
             vocab_size=100, num_hidden_layers=2, tie_word_embeddings=False)


MOE = dict(num_experts=2, num_local_experts=2, moe_intermediate_size=12, shared_expert_intermediate_size=20,
           num_experts_per_tok=1, mlp_only_layers=[0])


PADDED_VOCAB = 128  # Megatron pads the vocabulary; the family trims it back


@dataclass
class Sample:
    config: dict[str, Any]
    sources: dict[str, SourceMeta]
    expected: dict[str, tuple[int, ...]]  # the Hugging Face state dict (untied)
    hints: Hints = field(default_factory=Hints)
    lora: LoraOptions = field(default_factory=LoraOptions)


@cache
def hf_state(arch: str, auto: str = "AutoModelForCausalLM",
             **extra: Any) -> tuple[dict[str, Any], dict[str, tuple[int, ...]]]:
    import transformers

    model_type = next(t for t, a in MODEL_TYPES.items() if a == arch)
    config = transformers.AutoConfig.for_model(model_type, **SMALL, **MOE, **extra)
    model = getattr(transformers, auto).from_config(config)
    with tempfile.TemporaryDirectory() as out:
        model.save_pretrained(out)
        header = read_header(source.of(out), Path(out) / "model.safetensors")
    return {**config.to_dict(), "architectures": [arch]}, {e.name: e.shape for e in header.entries.values()}


def metas(shapes: dict[str, tuple[int, ...]]) -> dict[str, SourceMeta]:
    return {n: SourceMeta(name=n, dtype="F32", shape=s) for n, s in shapes.items()}


MLA_ARCHS = {"DeepseekV3ForCausalLM"}


SPELLINGS = {  # which rows one save uses: Transformer Engine's fused norms + SequentialMLP, or local + grouped
    # (TE's multi-latent attention keeps input_layernorm a module of its own and fuses only the q/kv norms)
    "te": lambda row, arch: (".input_layernorm." not in row.source or arch in MLA_ARCHS)
    and ".pre_mlp_layernorm." not in row.source and not row.source.endswith("weight{}")
    and not (arch in MLA_ARCHS and row.source.endswith(("q_layernorm.weight", "kv_layernorm.weight"))),
    "local": lambda row, arch: "layer_norm_weight" not in row.source and ".local_experts." not in row.source,
}


def megatron_sources(arch: str, spelling: str, expected: dict[str, tuple[int, ...]],
                     reached: set[str] | None = None) -> dict[str, SourceMeta]:
    """One Megatron tensor per row instance whose targets the Hugging Face model has, shaped back from them."""
    out = {}
    layers, experts = SMALL["num_hidden_layers"], MOE["num_experts"]
    for row in (r for r in FAMILIES[arch] if SPELLINGS[spelling](r, arch)):
        numbers = {0: [()], 1: [(i,) for i in range(layers)],
                   2: [(i, e) for i in range(layers) for e in range(experts)]}[row.source.count("{}")]
        for nums in numbers:
            targets = [t.format(*nums) for t in row.targets]
            if not any(t in expected for t in targets):
                continue
            assert all(t in expected for t in targets), f"{row.source}: {targets} not all in the HF model"
            out[row.source.format(*nums)] = _source_shape(row, [expected[t] for t in targets])
            if reached is not None:
                reached.add(row.source)
    return metas(out)


def _source_shape(row: Row, shapes: list[tuple[int, ...]]) -> tuple[int, ...]:
    if row.transform == "trim_rows":
        return (PADDED_VOCAB, *shapes[0][1:])
    return (sum(s[0] for s in shapes), *shapes[0][1:])  # identity, split_qkv, split_gate_up: rows stacked


# torchtitan: one tiny model per table; qwen3_moe keeps a dense first layer, deepseek_v3 (MLA, dense first layer,
# shared experts, routing bias) with and without the query low-rank projection.
TT_MODELS = {
    "llama": dict(SMALL),
    "qwen3": dict(SMALL),
    "qwen3_moe": dict(SMALL, **MOE),
    "deepseek_v3": dict(hidden_size=16, num_attention_heads=4, intermediate_size=24, vocab_size=100,
                        num_hidden_layers=2, tie_word_embeddings=False, n_routed_experts=2, n_shared_experts=1,
                        moe_intermediate_size=12, first_k_dense_replace=1, q_lora_rank=8, kv_lora_rank=6,
                        qk_nope_head_dim=4, qk_rope_head_dim=2, v_head_dim=4, num_experts_per_tok=1, n_group=1,
                        topk_group=1),
}


@cache
def tt_hf_state(model_type: str, q_lora: bool = True) -> tuple[dict[str, Any], dict[str, tuple[int, ...]]]:
    import transformers

    extra = {} if q_lora else {"q_lora_rank": None}
    config = transformers.AutoConfig.for_model(model_type, **{**TT_MODELS[model_type], **extra})
    model = transformers.AutoModelForCausalLM.from_config(config)
    with tempfile.TemporaryDirectory() as out:
        model.save_pretrained(out)
        header = read_header(source.of(out), Path(out) / "model.safetensors")
    return config.to_dict(), {e.name: e.shape for e in header.entries.values()}


def torchtitan_sources(arch: str, gen: str, expected: dict[str, tuple[int, ...]],
                       reached: set[str] | None = None) -> dict[str, SourceMeta]:
    """One torchtitan tensor (stacked experts one per expert, as the format presents them) per row instance of
    the name generation `gen` whose target the Hugging Face model has; its shape is the target's."""
    from distmerge.families.torchtitan.tables import FAMILIES as TT

    out = {}
    layers, experts = SMALL["num_hidden_layers"], MOE["num_experts"]
    for row in TT[arch]:
        if row.gen not in ("", gen) or row.target is None or row.mtp:  # transformers builds no MTP layer
            continue
        numbers = {0: [()], 1: [(i,) for i in range(layers)],
                   2: [(i, e) for i in range(layers) for e in range(experts)]}[row.source.count("{}")]
        for nums in numbers:
            if row.target.format(*nums) in expected:
                out[row.source.format(*nums)] = expected[row.target.format(*nums)]
                if reached is not None:
                    reached.add(row.source)
    return metas(out)


def torchtitan_samples(reached: set[str] | None = None) -> list[Sample]:
    from distmerge.families.torchtitan.tables import MODEL_TYPES as TT_TYPES

    samples = []
    for model_type, q_lora in [(t, True) for t in TT_MODELS] + [("deepseek_v3", False)]:
        config, state = tt_hf_state(model_type, q_lora)
        for gen in ("0.3", "0.2"):
            sources = torchtitan_sources(TT_TYPES[model_type], gen, state, reached)
            samples.append(Sample(config=config, sources=sources, expected=state, hints=Hints(naming="torchtitan")))
    return samples

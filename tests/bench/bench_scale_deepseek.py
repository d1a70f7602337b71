"""bench_scale.py's DeepSeek-V3 family: megatron-core names -> Hugging Face names, the MTP layer as layer 61.

distmerge's Megatron family maps DeepSeek-V3 but refuses its MTP layer (transformers has no module for it), which
the real checkpoint has; the simulation needs every tensor planned, so it registers this table (importing this
module registers it). The shapes come from distmerge's own megatron.target_shapes.
"""

from __future__ import annotations

import re

from distmerge.families import base
from distmerge.families.megatron import family as megatron

LAYER_PREFIXES = ((re.compile(r"decoder\.layers\.(\d+)\."), 0),
                  (re.compile(r"mtp\.layers\.(\d+)\.transformer_layer\."), 61),  # the MTP module is HF's layer 61
                  (re.compile(r"mtp\.layers\.(\d+)\."), 61))
GLOBAL = {"embedding.word_embeddings.weight": (("model.embed_tokens.weight",), "trim_rows"),
          "output_layer.weight": (("lm_head.weight",), "trim_rows"),
          "decoder.final_layernorm.weight": (("model.norm.weight",), "identity")}
IN_LAYER = {"input_layernorm.weight": ("input_layernorm.weight",),
            "self_attention.linear_q_down_proj.weight": ("self_attn.q_a_proj.weight",),
            "self_attention.linear_q_up_proj.layer_norm_weight": ("self_attn.q_a_layernorm.weight",),
            "self_attention.linear_q_up_proj.weight": ("self_attn.q_b_proj.weight",),
            "self_attention.linear_kv_down_proj.weight": ("self_attn.kv_a_proj_with_mqa.weight",),
            "self_attention.linear_kv_up_proj.layer_norm_weight": ("self_attn.kv_a_layernorm.weight",),
            "self_attention.linear_kv_up_proj.weight": ("self_attn.kv_b_proj.weight",),
            "self_attention.linear_proj.weight": ("self_attn.o_proj.weight",),
            "pre_mlp_layernorm.weight": ("post_attention_layernorm.weight",),
            "mlp.linear_fc1.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
            "mlp.linear_fc2.weight": ("mlp.down_proj.weight",),
            "mlp.router.weight": ("mlp.gate.weight",), "mlp.router.expert_bias": ("mlp.gate.e_score_correction_bias",),
            "mlp.shared_experts.linear_fc1.weight": ("mlp.shared_experts.gate_proj.weight",
                                                     "mlp.shared_experts.up_proj.weight"),
            "mlp.shared_experts.linear_fc2.weight": ("mlp.shared_experts.down_proj.weight",),
            "enorm.weight": ("enorm.weight",), "hnorm.weight": ("hnorm.weight",), "eh_proj.weight": ("eh_proj.weight",),
            "final_layernorm.weight": ("shared_head.norm.weight",)}
EXPERT = re.compile(r"mlp\.experts\.linear_fc([12])\.weight(\d+)")


def deepseek_targets(name: str) -> tuple[tuple[str, ...], str]:
    if name in GLOBAL:
        return GLOBAL[name]
    for pattern, offset in LAYER_PREFIXES:
        if m := pattern.match(name):
            hf, rest = f"model.layers.{int(m[1]) + offset}.", name[m.end():]
            if e := EXPERT.fullmatch(rest):
                x = f"{hf}mlp.experts.{e[2]}."
                return ((x + "gate_proj.weight", x + "up_proj.weight"), "split_gate_up") if e[1] == "1" else \
                    ((x + "down_proj.weight",), "identity")
            targets = tuple(hf + t for t in IN_LAYER[rest])
            return targets, "split_gate_up" if len(targets) == 2 else "identity"
    raise KeyError(name)


def deepseek_units(sources: dict[str, base.SourceMeta], ctx: base.FamilyContext) -> base.FamilyResult:
    units = []
    for meta in sources.values():
        names, transform = deepseek_targets(meta.name)
        shards = ctx.hints.expert_fc1_shards if ".experts." in meta.name else ctx.hints.fc1_shards
        params = {"split_gate_up": (("shards", shards),), "trim_rows": (("rows", ctx.config["vocab_size"]),)}
        p = params.get(transform, ())
        shapes = megatron.target_shapes(transform, meta, p)
        targets = tuple(base.Target(name=n, shape=s, dtype=meta.dtype) for n, s in zip(names, shapes, strict=True))
        units.append(base.Unit(sources=(meta.name,), targets=targets, transform=transform, params=p))
    return base.FamilyResult(units=units)


# Asked before the Megatron family (order 20, which refuses MTP); only the 671B case here has Megatron names.
base.register(base.NamingFamily(name="bench-deepseek-v3", naming="megatron", order=15, build=deepseek_units))

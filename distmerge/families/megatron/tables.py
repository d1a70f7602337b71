"""Megatron-core names -> Hugging Face names, one table per model family, as data.

`{}` stands for a number carried over in order: the layer, then the expert. Each row names the
transform (transforms.py) that turns the global Megatron tensor into the Hugging Face ones. TE builds
fuse the norms into the next linear layer (`linear_qkv.layer_norm_weight`), local builds keep them
apart (`input_layernorm`); torch_dist saves always use the TE names. Both spellings are listed.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Row:
    source: str
    targets: tuple[str, ...]
    transform: str = "identity"
    # The local spec's own name, which a torch_dist save never holds: megatron-core saves and loads it under the
    # Transformer Engine name of the row beside it (the local layer spec's sharded_state_dict_keys_map). Read by
    # the export, skipped by the import (families/megatron/inverse.py), which writes the name torch_dist holds.
    local: bool = False
    # Grouped GEMM's spelling of the expert rows (linear_fc1.weight{e}), which legacy saves hold: torch_dist saves
    # it under SequentialMLP's keys (TEGroupedMLP.sharded_state_dict, "interchangeable with SequentialMLP's").
    # Read by the export, skipped by the import like a local row: the import writes the sequential spelling.
    grouped: bool = False


L, M = "decoder.layers.{}.", "model.layers.{}."
LAYERS = M  # every target layer's prefix: the family checks the layer numbers against config.json

EMBEDDINGS = (
    Row("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "trim_rows"),
    Row("output_layer.weight", ("lm_head.weight",), "trim_rows"),
    Row("decoder.final_layernorm.weight", ("model.norm.weight",)),
)

ATTENTION = (
    Row(L + "input_layernorm.weight", (M + "input_layernorm.weight",), local=True),
    Row(L + "self_attention.linear_qkv.layer_norm_weight", (M + "input_layernorm.weight",)),
    Row(L + "self_attention.linear_qkv.weight",
        (M + "self_attn.q_proj.weight", M + "self_attn.k_proj.weight", M + "self_attn.v_proj.weight"), "split_qkv"),
    Row(L + "self_attention.linear_qkv.bias",
        (M + "self_attn.q_proj.bias", M + "self_attn.k_proj.bias", M + "self_attn.v_proj.bias"), "split_qkv"),
    Row(L + "self_attention.linear_proj.weight", (M + "self_attn.o_proj.weight",)),
    Row(L + "self_attention.q_layernorm.weight", (M + "self_attn.q_norm.weight",)),  # Qwen3
    Row(L + "self_attention.k_layernorm.weight", (M + "self_attn.k_norm.weight",)),
)

PRE_MLP_NORM = (
    Row(L + "pre_mlp_layernorm.weight", (M + "post_attention_layernorm.weight",), local=True),
    Row(L + "mlp.linear_fc1.layer_norm_weight", (M + "post_attention_layernorm.weight",)),
)

DENSE_MLP = (
    Row(L + "mlp.linear_fc1.weight", (M + "mlp.gate_proj.weight", M + "mlp.up_proj.weight"), "split_gate_up"),
    Row(L + "mlp.linear_fc2.weight", (M + "mlp.down_proj.weight",)),
)


def _experts(router: str, gate: str, up: str, down: str) -> tuple[Row, ...]:
    """Router and experts, in both Megatron spellings: SequentialMLP (local_experts.{e}.) and grouped
    GEMM (linear_fc1.weight{e})."""
    rows = [Row(L + "mlp.router.weight", (router,))]
    sequential, grouped = L + "mlp.experts.local_experts.{}.linear_fc", L + "mlp.experts.linear_fc"
    spellings = ((sequential + "1.weight", sequential + "2.weight", False),
                 (grouped + "1.weight{}", grouped + "2.weight{}", True))
    for fc1, fc2, is_grouped in spellings:
        rows += [Row(fc1, (gate, up), "split_gate_up", grouped=is_grouped), Row(fc2, (down,), grouped=is_grouped)]
    return tuple(rows)


QWEN_MOE = _experts(M + "mlp.gate.weight", M + "mlp.experts.{}.gate_proj.weight", M + "mlp.experts.{}.up_proj.weight",
                    M + "mlp.experts.{}.down_proj.weight")
QWEN2_SHARED_EXPERT = (
    Row(L + "mlp.shared_experts.linear_fc1.weight",
        (M + "mlp.shared_expert.gate_proj.weight", M + "mlp.shared_expert.up_proj.weight"), "split_gate_up"),
    Row(L + "mlp.shared_experts.linear_fc2.weight", (M + "mlp.shared_expert.down_proj.weight",)),
    Row(L + "mlp.shared_experts.gate_weight", (M + "mlp.shared_expert_gate.weight",)),
)
MIXTRAL_MOE = _experts(M + "block_sparse_moe.gate.weight", M + "block_sparse_moe.experts.{}.w1.weight",
                       M + "block_sparse_moe.experts.{}.w3.weight", M + "block_sparse_moe.experts.{}.w2.weight")

DENSE = EMBEDDINGS + ATTENTION + PRE_MLP_NORM + DENSE_MLP

# DeepSeek-V3 (and V2) multi-latent attention, megatron-core transformer/multi_latent_attention.py: the names
# and shapes of megatron-core 0.16.1's own modules and of real saves (tests/fixtures/make_megatron_mla.py),
# mapped to transformers' DeepseekV3 names. Transform "mla": mla.py checks the shape against
# config.json and permutes the rope rows when config.json says rope_interleave: false. TE fuses the q/kv norms
# into the up projections (layer_norm_weight); the local spec keeps q_layernorm / kv_layernorm. The input norm
# is a module of its own in both specs.
A, SA = L + "self_attention.", M + "self_attn."
MLA_ATTENTION = (
    Row(L + "input_layernorm.weight", (M + "input_layernorm.weight",)),
    Row(A + "linear_q_proj.weight", (SA + "q_proj.weight",), "mla"),  # q_lora_rank None: no query LoRA
    Row(A + "linear_q_down_proj.weight", (SA + "q_a_proj.weight",), "mla"),
    Row(A + "q_layernorm.weight", (SA + "q_a_layernorm.weight",)),
    Row(A + "linear_q_up_proj.layer_norm_weight", (SA + "q_a_layernorm.weight",)),
    Row(A + "linear_q_up_proj.weight", (SA + "q_b_proj.weight",), "mla"),
    Row(A + "linear_kv_down_proj.weight", (SA + "kv_a_proj_with_mqa.weight",), "mla"),  # [kv latent; rope]
    Row(A + "kv_layernorm.weight", (SA + "kv_a_layernorm.weight",)),
    Row(A + "linear_kv_up_proj.layer_norm_weight", (SA + "kv_a_layernorm.weight",)),
    Row(A + "linear_kv_up_proj.weight", (SA + "kv_b_proj.weight",), "mla"),  # per head [k_nope; v]
    Row(A + "linear_proj.weight", (SA + "o_proj.weight",), "mla"),
)
# The first first_k_dense_replace layers keep a dense MLP (DENSE_MLP's rows); the others route over experts with
# sigmoid scores plus a float32 bias that only picks the experts (router.expert_bias), beside shared experts.
DEEPSEEK_MOE = _experts(M + "mlp.gate.weight", M + "mlp.experts.{}.gate_proj.weight",
                        M + "mlp.experts.{}.up_proj.weight", M + "mlp.experts.{}.down_proj.weight") + (
    Row(L + "mlp.router.expert_bias", (M + "mlp.gate.e_score_correction_bias",)),
    Row(L + "mlp.shared_experts.linear_fc1.weight",
        (M + "mlp.shared_experts.gate_proj.weight", M + "mlp.shared_experts.up_proj.weight"), "split_gate_up"),
    Row(L + "mlp.shared_experts.linear_fc2.weight", (M + "mlp.shared_experts.down_proj.weight",)),
)
DEEPSEEK_V3 = EMBEDDINGS + MLA_ATTENTION + PRE_MLP_NORM + DENSE_MLP + DEEPSEEK_MOE

# Multi-token prediction, megatron-core transformer/multi_token_prediction.py (MultiTokenPredictionLayer): block j
# is `mtp.layers.{j}.` with enorm, hnorm (norms of the next token's embedding and of the hidden state), eh_proj
# (column-parallel Linear(2 hidden -> hidden) over [enorm(embedding); hnorm(hidden)], as Hugging Face's eh_proj),
# a transformer layer (built from the decoder's last layer spec: its rows are the decoder's, found under
# decoder.layers.{num_hidden_layers + j}, mla.mtp_aliases) and final_layernorm (the norm before the
# shared output head). The layer is `transformer_layer.*` in megatron-core 0.16, `mtp_model_layer.*` in 0.19.
# Hugging Face numbers the block num_hidden_layers + j (mtp.py); the aliases put that number in these
# rows' `{}`. Kept apart from FAMILIES: transformers' models have no module for them, so the
# save_pretrained contract tests cannot reach them (the real megatron-core MTP saves in tests do).
MTP_BLOCK, MTP_LAYERS = "mtp.layers.{}.", ("transformer_layer.", "mtp_model_layer.")
MTP_OWN = (
    Row(MTP_BLOCK + "enorm.weight", (M + "enorm.weight",)),
    Row(MTP_BLOCK + "hnorm.weight", (M + "hnorm.weight",)),
    Row(MTP_BLOCK + "eh_proj.weight", (M + "eh_proj.weight",)),
    Row(MTP_BLOCK + "final_layernorm.weight", (M + "shared_head.norm.weight",)),
)
MTP: dict[str, tuple[Row, ...]] = {"DeepseekV3ForCausalLM": MTP_OWN}

# Hugging Face architecture -> its table. MoE tables keep the dense MLP rows for layers without experts.
FAMILIES: dict[str, tuple[Row, ...]] = {
    "LlamaForCausalLM": DENSE,
    "MistralForCausalLM": DENSE,
    "Qwen2ForCausalLM": DENSE,
    "Qwen3ForCausalLM": DENSE,
    "Qwen3MoeForCausalLM": DENSE + QWEN_MOE,
    "Qwen2MoeForCausalLM": DENSE + QWEN_MOE + QWEN2_SHARED_EXPERT,
    "MixtralForCausalLM": EMBEDDINGS + ATTENTION + PRE_MLP_NORM + MIXTRAL_MOE,
    "DeepseekV3ForCausalLM": DEEPSEEK_V3,
}
# Hugging Face names transformers keeps in float32 whatever the model's dtype (DeepseekV3's
# _keep_in_fp32_modules_strict: the router and its routing bias); a --dtype cast writes them in float32, as
# save_pretrained of a cast model does.
FLOAT32_TARGETS: dict[str, tuple[str, ...]] = {
    "DeepseekV3ForCausalLM": (".mlp.gate.weight", ".mlp.gate.e_score_correction_bias"),
}
# config.json's model_type, for configs without `architectures`.
MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
               "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
               "mixtral": "MixtralForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM"}

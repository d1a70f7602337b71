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


L, M = "decoder.layers.{}.", "model.layers.{}."
LAYERS = M  # every target layer's prefix: the family checks the layer numbers against config.json

EMBEDDINGS = (
    Row("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "trim_rows"),
    Row("output_layer.weight", ("lm_head.weight",), "trim_rows"),
    Row("decoder.final_layernorm.weight", ("model.norm.weight",)),
)

ATTENTION = (
    Row(L + "input_layernorm.weight", (M + "input_layernorm.weight",)),
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
    Row(L + "pre_mlp_layernorm.weight", (M + "post_attention_layernorm.weight",)),
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
    spellings = ((sequential + "1.weight", sequential + "2.weight"), (grouped + "1.weight{}", grouped + "2.weight{}"))
    for fc1, fc2 in spellings:
        rows += [Row(fc1, (gate, up), "split_gate_up"), Row(fc2, (down,))]
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

# Hugging Face architecture -> its table. MoE tables keep the dense MLP rows for layers without experts.
FAMILIES: dict[str, tuple[Row, ...]] = {
    "LlamaForCausalLM": DENSE,
    "MistralForCausalLM": DENSE,
    "Qwen2ForCausalLM": DENSE,
    "Qwen3ForCausalLM": DENSE,
    "Qwen3MoeForCausalLM": DENSE + QWEN_MOE,
    "Qwen2MoeForCausalLM": DENSE + QWEN_MOE + QWEN2_SHARED_EXPERT,
    "MixtralForCausalLM": EMBEDDINGS + ATTENTION + PRE_MLP_NORM + MIXTRAL_MOE,
}
# config.json's model_type, for configs without `architectures`.
MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
               "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
               "mixtral": "MixtralForCausalLM"}

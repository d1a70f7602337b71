"""torchtitan names -> Hugging Face names, one table per model family, as data.

Read as facts from torchtitan's state-dict adapters (torchtitan/models/{llama3,qwen3,deepseek_v3}/
state_dict_adapter.py, 0.2.2 and 0.3.0); the tables are distmerge's own. `{}` stands for a number carried
over in order: the layer, then the expert. Two generations of names, both listed:

    0.3 (mid-2025 on)                                   0.2
    layers.{}.attention.qkv_linear.wq.weight            layers.{}.attention.wq.weight
    lm_head.weight                                      output.weight
    layers.{}.moe.routed_experts.inner_experts.w1_EFD   layers.{}.moe.experts.w1           (stacked [E, F, D])
    layers.{}.moe.expert_bias_E                         layers.{}.moe.expert_bias

Stacked experts reach the family one expert at a time, `<name>.<e>` (formats/torchtitan.py splits them):
`gate_proj = w1[e]`, `up_proj = w3[e]`, `down_proj = w2[e]`, no transpose. A row with no target is a tensor
the Hugging Face model has no place for; `why` is reported with its largest magnitude (unwritten.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Row:
    source: str
    target: str | None  # None: no place in the Hugging Face model (see why)
    transform: str = "identity"
    heads: str = ""  # rope_permute: the size (see torchtitan.sizes) counting the heads of the rows
    why: str = ""
    gen: str = ""  # "0.3" or "0.2": the name generation the spelling belongs to ("": both)
    mtp: bool = False  # multi-token-prediction layer j: Hugging Face numbers it num_hidden_layers + j
    init: str = ""  # a row with no target: the value torchtitan initializes it to, which an import writes
    # MLA: the rows end in rotary ones, "q" (each head [qk_nope | qk_rope]) or "kv" (one block [kv latent |
    # qk_rope]), as interleaved pairs in torchtitan; Hugging Face's halves when config.json's rope_interleave is false
    rope_rows: str = ""


def both(new: str, old: str, target: str | None, **kw) -> tuple[Row, Row]:
    return Row(new, target, gen="0.3", **kw), Row(old, target, gen="0.2", **kw)


L, M = "layers.{}.", "model.layers.{}."
EXPERTS = "moe.routed_experts.inner_experts."  # 0.3; 0.2: moe.experts.

EMBEDDINGS = (
    Row("tok_embeddings.weight", "model.embed_tokens.weight"),
    Row("norm.weight", "model.norm.weight"),
    *both("lm_head.weight", "output.weight", "lm_head.weight"),
)
NORMS = (
    Row(L + "attention_norm.weight", M + "input_layernorm.weight"),
    Row(L + "ffn_norm.weight", M + "post_attention_layernorm.weight"),
)


def _qkv(rope: str) -> tuple[Row, ...]:
    """wq, wk, wv (0.3 keeps the names of the fused qkv_linear it splits on save) and wo; `rope`: the transform
    that turns torchtitan's rotary layout of wq and wk into Hugging Face's."""
    rows = []
    for w, proj, heads in (("wq", "q_proj", "heads"), ("wk", "k_proj", "kv_heads"), ("wv", "v_proj", "")):
        rotated = {"transform": rope, "heads": heads} if heads and rope != "identity" else {}
        rows += both(f"{L}attention.qkv_linear.{w}.weight", f"{L}attention.{w}.weight", f"{M}self_attn.{proj}.weight",
                     **rotated)
    return (*rows, Row(L + "attention.wo.weight", M + "self_attn.o_proj.weight"))


QK_NORM = (
    Row(L + "attention.q_norm.weight", M + "self_attn.q_norm.weight"),
    Row(L + "attention.k_norm.weight", M + "self_attn.k_norm.weight"),
)
DENSE_MLP = (
    Row(L + "feed_forward.w1.weight", M + "mlp.gate_proj.weight"),
    Row(L + "feed_forward.w3.weight", M + "mlp.up_proj.weight"),
    Row(L + "feed_forward.w2.weight", M + "mlp.down_proj.weight"),
)


def _moe(bias: str | None, why: str = "") -> tuple[Row, ...]:
    """Router, per-expert weights and the load-balancing bias torchtitan adds to the router's scores. Without a
    Hugging Face place, the bias is written by an import as torchtitan makes it (common/moe.py: a persistent
    float32 buffer of zeros, which its own from_hf leaves as it is)."""
    rows = [Row(L + "moe.router.gate.weight", M + "mlp.gate.weight")]
    for w, new, proj in (("w1", "w1_EFD", "gate_proj"), ("w3", "w3_EFD", "up_proj"), ("w2", "w2_EDF", "down_proj")):
        rows += both(f"{L}{EXPERTS}{new}.{{}}", f"{L}moe.experts.{w}.{{}}", f"{M}mlp.experts.{{}}.{proj}.weight")
    rows += both(L + "moe.expert_bias_E", L + "moe.expert_bias", bias, why=why, init="" if bias else "zeros")
    return tuple(rows)


QWEN3_BIAS_WHY = ("Hugging Face Qwen3-MoE has no routing bias; torchtitan added it to the router's scores when "
                  "picking experts, so the Hugging Face model may pick others (torchtitan's own export drops it "
                  "silently)")
SHARED_EXPERTS = (
    Row(L + "moe.shared_experts.w1.weight", M + "mlp.shared_experts.gate_proj.weight"),
    Row(L + "moe.shared_experts.w3.weight", M + "mlp.shared_experts.up_proj.weight"),
    Row(L + "moe.shared_experts.w2.weight", M + "mlp.shared_experts.down_proj.weight"),
)
MLA = (  # multi-head latent attention; wq when q_lora_rank is 0, else wq_a, q_norm, wq_b
    Row(L + "attention.wq.weight", M + "self_attn.q_proj.weight", rope_rows="q"),
    Row(L + "attention.wq_a.weight", M + "self_attn.q_a_proj.weight"),
    Row(L + "attention.q_norm.weight", M + "self_attn.q_a_layernorm.weight"),
    Row(L + "attention.wq_b.weight", M + "self_attn.q_b_proj.weight", rope_rows="q"),
    Row(L + "attention.wkv_a.weight", M + "self_attn.kv_a_proj_with_mqa.weight", rope_rows="kv"),
    Row(L + "attention.kv_norm.weight", M + "self_attn.kv_a_layernorm.weight"),
    Row(L + "attention.wkv_b.weight", M + "self_attn.kv_b_proj.weight"),
    Row(L + "attention.wo.weight", M + "self_attn.o_proj.weight"),
)
DEEPSEEK_LAYER = NORMS + MLA + DENSE_MLP + _moe(M + "mlp.gate.e_score_correction_bias") + SHARED_EXPERTS
MTP_OWN = (  # the multi-token-prediction block's own parts, under the layer Hugging Face gives it
    Row("mtp_layers.{}.enorm.weight", M + "enorm.weight", mtp=True),
    Row("mtp_layers.{}.hnorm.weight", M + "hnorm.weight", mtp=True),
    Row("mtp_layers.{}.eh_proj.weight", M + "eh_proj.weight", mtp=True),
    Row("mtp_layers.{}.mtp_norm.weight", M + "shared_head.norm.weight", mtp=True),
)
MTP = MTP_OWN + tuple(replace(r, source="mtp_" + r.source, gen="0.3", mtp=True) for r in DEEPSEEK_LAYER
                      if r.gen != "0.2")  # 0.2 had no MTP

LLAMA3 = EMBEDDINGS + NORMS + _qkv("rope_permute") + DENSE_MLP
QWEN3 = EMBEDDINGS + NORMS + _qkv("identity") + QK_NORM + DENSE_MLP  # CosSinRoPE: already Hugging Face's layout

# Hugging Face architecture -> its table. MoE tables keep the dense MLP rows for layers without experts.
FAMILIES: dict[str, tuple[Row, ...]] = {
    "LlamaForCausalLM": LLAMA3,
    "Qwen3ForCausalLM": QWEN3,
    "Qwen3MoeForCausalLM": QWEN3 + _moe(None, QWEN3_BIAS_WHY),
    "DeepseekV3ForCausalLM": EMBEDDINGS + DEEPSEEK_LAYER + MTP,
}
MODEL_TYPES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
               "deepseek_v3": "DeepseekV3ForCausalLM"}

# Every Hugging Face target's shape in sizes read from config.json (family.py: sizes), keyed by
# its name with the layer prefix and the expert number taken out. Checked before any byte moves.
SHAPES: dict[str, tuple[str, ...]] = {
    "model.embed_tokens.weight": ("vocab", "hidden"),
    "lm_head.weight": ("vocab", "hidden"),
    "model.norm.weight": ("hidden",),
    "input_layernorm.weight": ("hidden",),
    "post_attention_layernorm.weight": ("hidden",),
    "self_attn.q_proj.weight": ("q_rows", "hidden"),
    "self_attn.k_proj.weight": ("kv_rows", "hidden"),
    "self_attn.v_proj.weight": ("kv_rows", "hidden"),
    "self_attn.o_proj.weight": ("hidden", "o_cols"),
    "self_attn.q_norm.weight": ("head_dim",),
    "self_attn.k_norm.weight": ("head_dim",),
    "self_attn.q_a_proj.weight": ("q_lora", "hidden"),
    "self_attn.q_a_layernorm.weight": ("q_lora",),
    "self_attn.q_b_proj.weight": ("q_rows", "q_lora"),
    "self_attn.kv_a_proj_with_mqa.weight": ("kv_a_rows", "hidden"),
    "self_attn.kv_a_layernorm.weight": ("kv_lora",),
    "self_attn.kv_b_proj.weight": ("kv_b_rows", "kv_lora"),
    "mlp.gate_proj.weight": ("ffn", "hidden"),
    "mlp.up_proj.weight": ("ffn", "hidden"),
    "mlp.down_proj.weight": ("hidden", "ffn"),
    "mlp.gate.weight": ("experts", "hidden"),
    "mlp.gate.e_score_correction_bias": ("experts",),
    "mlp.experts.{}.gate_proj.weight": ("moe_ffn", "hidden"),
    "mlp.experts.{}.up_proj.weight": ("moe_ffn", "hidden"),
    "mlp.experts.{}.down_proj.weight": ("hidden", "moe_ffn"),
    "mlp.shared_experts.gate_proj.weight": ("shared_ffn", "hidden"),
    "mlp.shared_experts.up_proj.weight": ("shared_ffn", "hidden"),
    "mlp.shared_experts.down_proj.weight": ("hidden", "shared_ffn"),
    "enorm.weight": ("hidden",),
    "hnorm.weight": ("hidden",),
    "eh_proj.weight": ("hidden", "two_hidden"),
    "shared_head.norm.weight": ("hidden",),
}

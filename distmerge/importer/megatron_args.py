"""The `args` a Megatron-LM checkpoint carries (common.pt), for the model an import writes.

Megatron-LM's load_checkpoint (training/checkpointing.py) reads from them: the TP and PP sizes the save was made
with, `no_save_optim` / `no_save_rng` (getattr: set here, there is neither), and, unless --finetune,
check_checkpoint_args compares num_layers, hidden_size, num_attention_heads, max_position_embeddings,
make_vocab_size_divisible_by, padded_vocab_size and tokenizer_type with the run's. The parallel sizes are those of
the smallest job that trains the layout: TP x PP x EP processes, data parallel over EP. `--use-checkpoint-args`
takes the model's shape from them (load_args_from_checkpoint). Names as Megatron-LM's arguments.py spells them;
only plain values (megatron-core's safe globals list argparse.Namespace, so torch.load with weights_only reads it).
"""

from __future__ import annotations

import argparse
import re
from typing import Any

from distmerge.families import base
from distmerge.importer.plan import ImportPlan, Layout

CHECKPOINT_VERSION = 3.0  # Megatron-LM's current checkpoint_version
# The content metadata megatron-core 0.16.1's save records (dist_checkpointing.save(content_metadata=...)), as
# Megatron-LM passes it for a model without a distributed optimizer.
CONTENT_METADATA = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}


def megatron_args(config: dict[str, Any], plan: ImportPlan, layout: Layout, dtype: str) -> argparse.Namespace:
    c = base.CAUSAL_LM.sizes(config)
    sizes = plan.sizes
    heads, hidden = sizes.heads, c["hidden_size"]
    plain = dict(
        num_layers=sizes.layers, hidden_size=hidden, ffn_hidden_size=c.get("intermediate_size"),
        num_attention_heads=heads, group_query_attention=sizes.groups != heads, num_query_groups=sizes.groups,
        kv_channels=c.get("head_dim") or hidden // heads,
        max_position_embeddings=c.get("max_position_embeddings"), seq_length=c.get("max_position_embeddings"),
        position_embedding_type="rope", rotary_base=rope_theta(c), rotary_percent=1.0,
        normalization="RMSNorm", norm_epsilon=c.get("rms_norm_eps"), swiglu=True, add_bias_linear=False,
        add_qkv_bias=any(n.endswith("linear_qkv.bias") for n in plan.tensors),
        qk_layernorm=any(n.endswith(("q_layernorm.weight", "kv_layernorm.weight")) for n in plan.tensors),
        untie_embeddings_and_output_weights=not sizes.tied, vocab_size=sizes.vocab,
        padded_vocab_size=sizes.padded_vocab, make_vocab_size_divisible_by=layout.divisible_by,
        tokenizer_type="HuggingFaceTokenizer",
        tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.tp, context_parallel_size=1, data_parallel_size=layout.ep,
        world_size=layout.tp * layout.pp * layout.ep, bf16=dtype == "BF16", fp16=dtype == "F16",
        ckpt_format="torch_dist", use_dist_ckpt=True, no_save_optim=True, no_save_rng=True, iteration=0,
        consumed_train_samples=0, consumed_valid_samples=0, **pipeline_args(layout),
    )
    # MLA's fields replace the plain attention's (kv_channels is MLA's value head size)
    return argparse.Namespace(**plain | moe_args(c, plan) | mla_args(c, plan))


def rope_theta(block: dict[str, Any]) -> int:
    """The rotary base: config.json's rope_theta, or transformers 5's rope_parameters.rope_theta."""
    rope = block.get("rope_parameters") or {}
    return int(block.get("rope_theta") or rope.get("rope_theta") or 10000)


def mla_args(block: dict[str, Any], plan: ImportPlan) -> dict[str, Any]:
    """The multi-latent attention and multi-token prediction fields (Megatron-LM's --multi-latent-attention,
    --q-lora-rank, --kv-lora-rank, --qk-head-dim, --qk-pos-emb-head-dim, --v-head-dim, --rope-type and YaRN's
    --rotary-scaling-factor ..., --mtp-num-layers), from config.json; none without MLA. kv_channels is the value
    head size, as megatron-core's MLA core attention takes it."""
    if not any(n.endswith(".linear_kv_up_proj.weight") for n in plan.tensors):
        return {}
    rope = block.get("rope_scaling") or block.get("rope_parameters") or {}
    yarn = rope.get("rope_type", rope.get("type")) == "yarn"
    mtp = {int(m[1]) for n in plan.tensors if (m := re.match(r"mtp\.layers\.(\d+)\.", n))}
    out = dict(multi_latent_attention=True, q_lora_rank=block.get("q_lora_rank"), kv_lora_rank=block["kv_lora_rank"],
               qk_head_dim=block["qk_nope_head_dim"], qk_pos_emb_head_dim=block["qk_rope_head_dim"],
               v_head_dim=block["v_head_dim"], kv_channels=block["v_head_dim"], rope_type="yarn" if yarn else "rope",
               mtp_num_layers=len(mtp) or None)
    if yarn:
        out |= dict(rotary_scaling_factor=rope.get("factor"), mscale=rope.get("mscale", 1.0),
                    mscale_all_dim=rope.get("mscale_all_dim", 0.0), beta_fast=rope.get("beta_fast", 32),
                    beta_slow=rope.get("beta_slow", 1),
                    original_max_position_embeddings=rope.get("original_max_position_embeddings"))
    return out


def pipeline_args(layout: Layout) -> dict[str, Any]:
    """The pipeline split's fields, as Megatron-LM's arguments.py leaves them after parsing
    --num-virtual-stages-per-pipeline-rank V (virtual_pipeline_model_parallel_size V; the layers per virtual
    stage only set by its other spelling, --num-layers-per-virtual-pipeline-stage, which uneven stages exclude)
    and --decoder-first/last-pipeline-num-layers."""
    return dict(virtual_pipeline_model_parallel_size=layout.vpp, num_virtual_stages_per_pipeline_rank=layout.vpp,
                num_layers_per_virtual_pipeline_stage=None, decoder_first_pipeline_num_layers=layout.first,
                decoder_last_pipeline_num_layers=layout.last)


def moe_args(block: dict[str, Any], plan: ImportPlan) -> dict[str, Any]:
    """The MoE fields of the args (Megatron-LM's --num-experts, --moe-ffn-hidden-size, ...), from config.json;
    none for a dense model. Every layer routes (moe_layer_freq 1), or DeepSeek-V3's (deepseek_moe_args); the shared
    expert of Qwen2-MoE is gated.
    moe_router_pre_softmax as Hugging Face's routing: the top-k of a softmax renormalised (Qwen's
    norm_topk_prob, Mixtral always) is the softmax of the top-k logits (pre_softmax False); not renormalised
    (Qwen2-MoE as released), the softmax over all experts first (True)."""
    if not plan.sizes.experts:
        return {}
    if block.get("n_routed_experts"):
        return deepseek_moe_args(block, plan)
    shared = block.get("shared_expert_intermediate_size")
    return dict(num_experts=plan.sizes.experts, moe_router_topk=block.get("num_experts_per_tok"),
                moe_ffn_hidden_size=block.get("moe_intermediate_size") or block.get("intermediate_size"),
                moe_shared_expert_intermediate_size=shared, moe_shared_expert_gate=bool(shared),
                moe_layer_freq=1, moe_router_score_function="softmax",
                moe_router_pre_softmax=not block.get("norm_topk_prob", True), moe_grouped_gemm=False)


def deepseek_moe_args(block: dict[str, Any], plan: ImportPlan) -> dict[str, Any]:
    """DeepSeek-V3's routing as Megatron-LM's recipe sets it: the first first_k_dense_replace layers dense
    (moe_layer_freq as the list --moe-layer-freq "([0]*k+[1]*(n-k))" parses to), sigmoid scores plus the expert
    bias that picks the experts, top-k within the best n_group groups, the weights scaled by routed_scaling_factor,
    n_shared_experts ungated shared experts of moe_intermediate_size each."""
    sizes = plan.sizes
    freq: int | list[int] = [0] * sizes.dense_layers + [1] * (sizes.layers - sizes.dense_layers)
    return dict(num_experts=sizes.experts, moe_router_topk=block.get("num_experts_per_tok"),
                moe_ffn_hidden_size=block.get("moe_intermediate_size"),
                moe_shared_expert_intermediate_size=block.get("moe_intermediate_size", 0)
                * block.get("n_shared_experts", 0) or None, moe_shared_expert_gate=False,
                moe_layer_freq=freq if sizes.dense_layers else 1, moe_router_score_function="sigmoid",
                moe_router_enable_expert_bias=True, moe_router_topk_scaling_factor=block.get("routed_scaling_factor"),
                moe_router_num_groups=block.get("n_group"), moe_router_group_topk=block.get("topk_group"),
                moe_router_pre_softmax=False, moe_grouped_gemm=False)


def common_state(args: argparse.Namespace) -> dict[str, Any]:
    """What megatron-core 0.16.1's dist_checkpointing.save writes as common.pt for Megatron-LM's save_checkpoint."""
    return {"args": args, "checkpoint_version": CHECKPOINT_VERSION, "iteration": 0,
            "num_floating_point_operations_so_far": 0, "content_metadata": dict(CONTENT_METADATA)}

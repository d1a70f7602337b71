"""Write a real Megatron-LM legacy checkpoint (megatron-core GPTModel, TP x PP, CPU + gloo) of a Llama-shaped model.

Run under torchrun with W = TP * PP processes, e.g.::

    torchrun --standalone --nproc-per-node 4 tests/bench/make_megatron_ckpt.py --out DIR --size 800000000 --tp 2 --pp 2

Writes what Megatron-LM's ``training/checkpointing.py`` writes with ``--ckpt-format torch --no-save-optim``:
``DIR/iter_0000001/mp_rank_{tp:02d}[_{pp:03d}]/model_optim_rng.pt`` (a torch.save of args, checkpoint_version,
iteration, ``model.state_dict_for_save_checkpoint()``, rng_state) and ``DIR/latest_checkpointed_iteration.txt``;
plus ``DIR_hf/config.json``, the LlamaConfig a user would pass as ``--hf-config`` (Megatron saves none).

The vocabulary is 32001, padded Megatron-style to a multiple of 128 x TP (32256 at TP=2), so the mergers must
trim it. Weights are seeded random (not Megatron's init, which on CPU builds every full master weight first):
the benchmark compares mergers, not models. Only stdlib at module level: bench_megatron.py imports
``megatron_shape`` for its stamp.
"""

from __future__ import annotations

import argparse
import json
import random
import warnings
from pathlib import Path

from make_ckpt import llama_shape

VOCAB = 32001  # not a multiple of 128 * TP: exercises the padding trim
DIVISIBLE_BY = 128  # Megatron-LM's default --make-vocab-size-divisible-by
ITERATION = 1


def megatron_shape(size: int, tp: int, pp: int) -> dict:
    """make_ckpt's Llama proportions, layers rounded to a multiple of PP (even stages), vocab padded for TP."""
    shape = llama_shape(size)
    layers = max(pp, round(shape["num_hidden_layers"] / pp) * pp)
    per_layer = (shape["params"] - 2 * shape["vocab_size"] * shape["hidden_size"] - shape["hidden_size"]) // \
        shape["num_hidden_layers"]
    padded = -(-VOCAB // (DIVISIBLE_BY * tp)) * DIVISIBLE_BY * tp
    return dict(shape, num_hidden_layers=layers, vocab_size=VOCAB, padded_vocab_size=padded,
                params=2 * padded * shape["hidden_size"] + shape["hidden_size"] + layers * per_layer)


def patch_cuda_for_cpu() -> None:
    """megatron-core asks torch.cuda for the current device in a few CPU-reachable places; answer "cpu"."""
    import torch

    if not torch.cuda.is_available():
        torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]


def build(shape: dict, tp: int, pp: int):  # noqa: ANN201 - megatron types stay out of the module imports
    import torch
    import torch.nn.functional as F
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(
        num_layers=shape["num_hidden_layers"], hidden_size=shape["hidden_size"],
        ffn_hidden_size=shape["intermediate_size"], num_attention_heads=shape["num_attention_heads"],
        num_query_groups=shape["num_key_value_heads"], kv_channels=shape["hidden_size"] // shape["num_attention_heads"],
        gated_linear_unit=True, activation_func=F.silu, normalization="RMSNorm", add_bias_linear=False,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32,
        params_dtype=torch.float32, use_cpu_initialization=True,
        perform_initialization=False,  # filled below, shard by shard: no rank ever holds a full weight
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False, apply_rope_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False, hidden_dropout=0.0, attention_dropout=0.0,
    )
    return GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
                    vocab_size=shape["padded_vocab_size"], max_sequence_length=2048,
                    pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(),
                    share_embeddings_and_output_weights=False, position_embedding_type="rope", rotary_base=10000)


def fill(model, seed: int, tp: int, pp: int) -> None:  # noqa: ANN001
    """Seeded normal values; replicated (1-D) weights get the same values on every TP rank of a stage, as in
    training, and mean 1 so a merger that takes a norm from the wrong layer shows."""
    import torch

    split = torch.Generator().manual_seed(seed + 1000 * pp + tp)
    replicated = torch.Generator().manual_seed(seed + 1000 * pp)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.normal_(1.0, 0.02, generator=replicated)
            else:
                p.normal_(0.0, 0.02, generator=split)


def megatron_args(shape: dict, tp: int, pp: int, world: int) -> argparse.Namespace:
    """A few of the ~500 entries of Megatron-LM's args, enough for a converter to read the model back."""
    import torch
    from megatron.core.transformer.enums import AttnBackend

    return argparse.Namespace(
        attention_backend=AttnBackend.auto,  # real args pickle megatron enums: a reader must cope with them
        num_layers=shape["num_hidden_layers"], hidden_size=shape["hidden_size"],
        ffn_hidden_size=shape["intermediate_size"], num_attention_heads=shape["num_attention_heads"],
        group_query_attention=True, num_query_groups=shape["num_key_value_heads"],
        kv_channels=shape["hidden_size"] // shape["num_attention_heads"], normalization="RMSNorm", swiglu=True,
        position_embedding_type="rope", untie_embeddings_and_output_weights=True, add_bias_linear=False,
        vocab_size=VOCAB, padded_vocab_size=shape["padded_vocab_size"], make_vocab_size_divisible_by=DIVISIBLE_BY,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=None,
        expert_model_parallel_size=1, data_parallel_size=world // (tp * pp), world_size=world,
        params_dtype=torch.float32, bf16=False, fp16=False, ckpt_format="torch", use_dist_ckpt=False,
        no_save_optim=True, iteration=ITERATION, transformer_impl="local",
    )


def rng_state() -> list[dict]:
    import numpy as np
    import torch

    return [{"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
             "torch_rng_state": torch.get_rng_state(), "cuda_rng_state": None, "rng_tracker_states": {}}]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--size", type=int, required=True, help="target model bytes (fp32)")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")  # megatron's "no Transformer Engine" warnings x W ranks bury real errors

    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    torch.set_num_threads(1)  # W ranks share a couple of cores
    patch_cuda_for_cpu()
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    if world != args.tp * args.pp:
        raise SystemExit(f"make_megatron_ckpt: world size {world} != TP {args.tp} x PP {args.pp}")
    ps.initialize_model_parallel(tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp)
    tp, pp = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
    shape = megatron_shape(args.size, args.tp, args.pp)
    model = build(shape, args.tp, args.pp)
    fill(model, args.seed, tp, pp)

    # Megatron-LM get_checkpoint_name: mp_rank_{tp:02d}, plus _{pp:03d} when PP > 1.
    name = f"mp_rank_{tp:02d}" + (f"_{pp:03d}" if args.pp > 1 else "")
    path = args.out / f"iter_{ITERATION:07d}" / name / "model_optim_rng.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {"args": megatron_args(shape, args.tp, args.pp, world), "checkpoint_version": 3.0,
             "iteration": ITERATION, "model": model.state_dict_for_save_checkpoint(), "rng_state": rng_state(),
             "num_floating_point_operations_so_far": 0}
    torch.save(state, path)
    counts = [None] * world
    dist.all_gather_object(counts, (tp, pp, sum(p.numel() for p in model.parameters())))
    if dist.get_rank() == 0:
        # Each (tp, pp) holds a disjoint slice except the replicated norms, counted once per stage (tp 0).
        norms = shape["hidden_size"] * (2 * shape["num_hidden_layers"] + 1)
        total = sum(n for _, _, n in counts) - (args.tp - 1) * norms
        assert total == shape["params"], (total, shape)
        (args.out / "latest_checkpointed_iteration.txt").write_text(str(ITERATION))
        write_hf_config(shape, Path(f"{args.out}_hf"))
        print(f"make_megatron_ckpt: {total:,} params ({total * 4 / 1e9:.3f} GB fp32), TP={args.tp} PP={args.pp}, "
              f"shape {json.dumps(shape)}", flush=True)
    dist.barrier()  # every rank's file is complete before the job (and the caller waiting on it) ends
    ps.destroy_model_parallel()
    dist.destroy_process_group()
    return 0


def write_hf_config(shape: dict, folder: Path) -> None:
    from transformers import LlamaConfig

    keys = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "num_hidden_layers",
            "vocab_size")
    config = LlamaConfig(**{k: shape[k] for k in keys}, max_position_embeddings=2048, rope_theta=10000.0,
                         rms_norm_eps=1e-5, tie_word_embeddings=False, architectures=["LlamaForCausalLM"])
    config.save_pretrained(folder)


if __name__ == "__main__":
    raise SystemExit(main())

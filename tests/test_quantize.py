"""`--quantize fp8-block | fp8-channel`: the FP8 weights are the published recipe applied to the merged tensors.

Every format's fixture (FSDP, DCP, Megatron dense and DeepSeek-V3 MoE, DeepSpeed, torchtitan) is merged in full
precision and in both layouts. Each FP8 weight and its scales must equal a reference quantization of the full
merge's tensor written here from the recipe (block by block, row by row: DeepSeek-V3's 128x128 blocks with
partial edge blocks, compressed-tensors' per-channel scales); every other tensor must equal the full merge's bit
for bit. transformers then loads each FP8 folder on CPU (it dequantizes there) with no missing or unexpected key,
and compressed-tensors reads its layout back with its own classes.

The fixture models have dimensions of 32 to 138 rows and columns: 138 (FSDP, DCP, DeepSpeed's intermediate size)
is a full block and a partial one of 10, everything else one partial block.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from distmerge.quantize import schemes
from tests.conftest import REPO, free_port, load_merged, merge_inproc, reference_dir, torchrun, tree_bytes
from tests.helpers import fp8_recipe
from tests.helpers.fp8_recipe import RECIPES, SCALE_NAMES, recipe_block
from tests.helpers.inputs import input_of

CT_FOLDER = "fsdp2_llama_w2"

# case -> (fixture family, extra merge arguments)
CASES = {
    "fsdp2_llama_w2": ("fsdp_ckpts", ()),
    "dcp_llama_w2": ("dcp_ckpts", ()),
    "megatron_tp2": ("megatron_ckpts", ("--hf-config", "REFERENCE/huggingface")),
    "mla_tp2": ("mla_ckpts", ("--hf-config", "REFERENCE/huggingface")),  # DeepSeek-V3: MLA, routed + shared experts
    "ds_z2_fp32_w2": ("ds_ckpts", ()),
    "tt_qwen3_moe_w4": ("tt_ckpts", ()),  # Qwen3 MoE: routers are nn.Linear modules left in float32
}
SCHEMES = ("fp8-block", "fp8-channel")

# The weights each case writes in FP8, spelled out here and never read from distmerge's own table
# (families/quantized.py): a row dropped there leaves its weights in float32, and the case that holds them fails.
ATTENTION = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
MLA = ("self_attn.q_a_proj", "self_attn.q_b_proj", "self_attn.kv_a_proj_with_mqa", "self_attn.kv_b_proj",
       "self_attn.o_proj")  # DeepSeek-V3's multi-latent attention
MLP = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
EXPERTS = ("mlp.experts.{e}.gate_proj", "mlp.experts.{e}.up_proj", "mlp.experts.{e}.down_proj")  # routed
SHARED_EXPERTS = ("mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj", "mlp.shared_experts.down_proj")
SHARED_EXPERT = ("mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj", "mlp.shared_expert.down_proj")  # Qwen2
MIXTRAL = ("block_sparse_moe.experts.{e}.w1", "block_sparse_moe.experts.{e}.w2", "block_sparse_moe.experts.{e}.w3")


def weights(layers, modules: tuple[str, ...], experts: int = 1) -> set[str]:
    """`model.layers.{layer}.{module}.weight` for each layer, module and expert number."""
    return {f"model.layers.{layer}.{m.format(e=e)}.weight" for layer in layers for m in modules for e in range(experts)}


LLAMA_FP8 = weights(range(2), ATTENTION + MLP)
FP8_WEIGHTS = {
    "fsdp2_llama_w2": LLAMA_FP8,
    "dcp_llama_w2": LLAMA_FP8,
    "megatron_tp2": LLAMA_FP8,
    # layer 0 dense, layers 1-3 four routed experts and the shared ones; routers (mlp.gate) stay in float32
    "mla_tp2": weights(range(4), MLA) | weights([0], MLP) | weights(range(1, 4), EXPERTS, 4)
               | weights(range(1, 4), SHARED_EXPERTS),
    "ds_z2_fp32_w2": LLAMA_FP8,
    "tt_qwen3_moe_w4": weights(range(2), ATTENTION) | weights(range(2), EXPERTS, 3),
}
# The recipe, written out block by block from the layouts' specifications: tests/helpers/fp8_recipe.py


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("shape", [(138, 64), (300, 257), (64, 64), (1, 5), (256, 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_quantization_is_the_recipe(scheme, shape, dtype):
    """Edge blocks partial in both directions, one row, exact multiples; bf16 and fp32 inputs; one all-zero
    block (or row) and values beyond FP8's range before scaling. The dequantized tensor is within the bound."""
    torch.manual_seed(sum(shape))
    w = (torch.randn(shape) * 1000).to(dtype)
    if max(shape) > 128:
        w[:128, :128] = 0  # an all-zero block, and rows
    elif shape[0] > 1:
        w[0] = 0  # an all-zero row
    q, s = schemes.SCHEMES[scheme].quantize(w)
    want_q, want_s = RECIPES[scheme](w)
    assert same_bytes(q, want_q) and same_bytes(s, want_s)
    assert s.shape == ((shape[0], 1) if scheme == "fp8-channel" else (-(-shape[0] // 128), -(-shape[1] // 128)))
    err = (fp8_recipe.dequantized(scheme, q, s) - w.float()).abs()
    assert bool((err <= fp8_recipe.bound(w, fp8_recipe.each_scale(scheme, s, shape))).all())
    assert err.max() > 0  # not a test that cannot fail: FP8 loses bits


# -- merges of every format --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def merged(request, tmp_path_factory) -> dict[tuple[str, str], Path]:
    """(case, "full" | scheme) -> output folder; every case merged once per layout by one process."""
    root = tmp_path_factory.mktemp("quantized")
    out = {}
    for case, (family, extra) in CASES.items():
        ckpt = input_of(request.getfixturevalue(family)[case])
        args = [a.replace("REFERENCE", str(reference_dir(request.getfixturevalue(family)[case]))) for a in extra]
        for kind in ("full", *SCHEMES):
            folder = root / f"{case}-{kind}"
            quantize = () if kind == "full" else ("--quantize", kind)
            assert merge_inproc("--input", ckpt, "--output", folder, *args, *quantize) == 0, (case, kind)
            out[case, kind] = folder
    return out


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("case", list(CASES))
def test_each_format_writes_the_layout(case, scheme, merged):
    full, quantized = load_merged(merged[case, "full"]), load_merged(merged[case, scheme])
    suffix, written = SCALE_NAMES[scheme], FP8_WEIGHTS[case]
    assert written <= set(full)  # the list above names this model's tensors
    assert set(quantized) == set(full) | {n + suffix for n in written}
    for name, tensor in full.items():
        if name in written:
            q, s = RECIPES[scheme](tensor)
            assert same_bytes(quantized[name], q) and same_bytes(quantized[name + suffix], s), name
        else:  # embeddings, norms, routers, the head: as the full merge wrote them
            assert same_bytes(quantized[name], tensor), name
    config = json.loads((merged[case, scheme] / "config.json").read_text())
    assert fp8_recipe.scheme_in(config) == scheme
    assert config.get("torch_dtype", config.get("dtype")) == "float32"  # the unquantized tensors' dtype
    kept = config["quantization_config"].get("modules_to_not_convert", config["quantization_config"].get("ignore"))
    assert "lm_head" in kept and not any(k + ".weight" in written for k in kept)
    if "moe" in case or "mla" in case:
        assert any(k.endswith(".mlp.gate") for k in kept)  # the routers stay in float32


def test_the_recipe_tests_can_fail(merged):
    """The comparison above sees one flipped FP8 bit and a scale off by one unit in the last place."""
    case = "fsdp2_llama_w2"
    full, quantized = load_merged(merged[case, "full"]), load_merged(merged[case, "fp8-block"])
    name = "model.layers.0.mlp.down_proj.weight"
    q, s = recipe_block(full[name])
    assert same_bytes(quantized[name], q)
    flipped = q.view(torch.uint8).clone()
    flipped[0, 0] ^= 1
    assert not same_bytes(flipped.view(torch.float8_e4m3fn), q)
    assert not same_bytes(torch.nextafter(s, torch.full_like(s, 1.0)), s)


@pytest.mark.parametrize("case, written, kept", [
    ("megatron_dist_mixtral_ep2", weights(range(2), ATTENTION + MIXTRAL, 4), "block_sparse_moe.gate"),
    ("megatron_qwen2_moe_tp2", weights(range(2), ATTENTION + EXPERTS + SHARED_EXPERT, 4), "mlp.shared_expert_gate"),
])
def test_the_moe_families_write_their_experts_in_fp8(case, written, kept, megatron_ckpts, tmp_path):
    """Mixtral's block_sparse_moe experts and Qwen2-MoE's single shared expert, which no case above holds: exactly
    these weights are FP8, the routers and the shared expert's gate stay in float32 and are named as kept."""
    ckpt = megatron_ckpts[case]
    assert merge_inproc("--input", ckpt, "--output", tmp_path, "--hf-config", reference_dir(ckpt) / "huggingface",
                        "--quantize", "fp8-block") == 0
    merged = load_merged(tmp_path)
    assert {n for n, t in merged.items() if t.dtype == torch.float8_e4m3fn} == written
    config = json.loads((tmp_path / "config.json").read_text())
    assert f"model.layers.1.{kept}" in config["quantization_config"]["modules_to_not_convert"]


# Names in each place save_pretrained puts a decoder layer (a plain model, Qwen2-VL's language model, LLaVA's) and
# the Linear modules left out: vision towers, routers, the multi-token-prediction block's eh_proj, the head.
@pytest.mark.parametrize("name, fp8_weight", [
    ("model.layers.3.self_attn.q_proj.weight", True),
    ("model.language_model.layers.3.mlp.down_proj.weight", True),
    ("language_model.model.layers.3.self_attn.o_proj.weight", True),
    ("model.visual.blocks.0.mlp.down_proj.weight", False),
    ("model.layers.3.self_attn.q_proj.bias", False),
    ("model.layers.3.mlp.gate.weight", False),
    ("model.layers.3.mlp.shared_expert_gate.weight", False),
    ("model.layers.61.eh_proj.weight", False),
    ("lm_head.weight", False),
])
def test_the_table_names_decoder_linear_weights_only(name, fp8_weight):
    from distmerge.quantize.table import QUANTIZED

    assert (QUANTIZED.fullmatch(name) is not None) == fp8_weight

# -- loaders --------------------------------------------------------------------------------------------------
def logits(folder: Path, vocab: int) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    ids = (torch.arange(2 * 16) % vocab).reshape(2, 16)
    with torch.no_grad():
        return model.eval()(ids).logits.float()


# Logits of the FP8 folder against the full-precision merge's, both run by transformers on CPU: the largest
# difference relative to the largest logit, and the cosine. Measured on these fixtures (docs/quantize.md):
# fp8-block at most 0.096 and 0.9972, fp8-channel 0.152 and 0.9971 (its config also quantizes activations per token,
# which compressed-tensors does in the forward; the DeepSeek-V3 MoE case is the worst, a routing choice flips).
# transformers 5.24 dequantizes a partial edge block with a block size it derives from the scale grid (rows / grid
# rows: 69 for 138 rows in 2 blocks), not weight_block_size's 128, which doubles fp8-block's error on the
# 138-wide models (FSDP, DCP, DeepSpeed); elsewhere its dequantized weights equal fp8.dequantize's exactly.
LOGITS_TOLERANCE, LOGITS_COSINE = 0.2, 0.995


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("case", list(CASES))
def test_transformers_loads_each_fp8_folder_on_cpu(case, scheme, merged):
    vocab = json.loads((merged[case, "full"] / "config.json").read_text())["vocab_size"]
    want = logits(merged[case, "full"], vocab)
    got = logits(merged[case, scheme], vocab)
    worst = float((got - want).abs().max() / want.abs().max())
    assert 0 < worst < LOGITS_TOLERANCE, worst
    cosine = torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0)
    assert cosine > LOGITS_COSINE, cosine


# -- compressed-tensors reads its layout back ------------------------------------------------------------------
@pytest.mark.parametrize("case", ["fsdp2_llama_w2", "megatron_tp2"])
def test_compressed_tensors_reads_the_folder_back(case, merged):
    """With the library's own classes and no transformers loader: its QuantizationConfig parses config.json,
    apply_quantization_config picks exactly the modules that have a weight_scale (the ignore list holds the others),
    the folder's tensors fill the compressed modules with no missing or unexpected key, and its decompression gives
    fp8.dequantize's values, within the FP8 bound of the full-precision weights. Dense models: transformers 5 builds
    MoE experts as one 3-D parameter, which only its loader's conversion maps the per-expert tensors onto (the MoE
    folders are read through it in test_transformers_loads_each_fp8_folder_on_cpu)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = merged[case, "fp8-channel"]
    config = json.loads((folder / "config.json").read_text())
    quant = QuantizationConfig.model_validate(config["quantization_config"])
    hf_config = AutoConfig.from_pretrained(merged[case, "full"])
    model = AutoModelForCausalLM.from_config(hf_config).eval()
    apply_quantization_config(model, quant)
    state = load_merged(folder)
    picked = {n for n, m in model.named_modules() if getattr(m, "quantization_scheme", None) is not None}
    assert picked == {n.removesuffix(".weight_scale") for n in state if n.endswith(".weight_scale")}
    compressor = ModelCompressor(quantization_config=quant)
    compressor.compress_model(model)
    result = model.load_state_dict(state, strict=False)
    assert not result.unexpected_keys and not result.missing_keys, result
    compressor.decompress_model(model)
    full = load_merged(merged[case, "full"])
    params = dict(model.named_parameters())
    for module in picked:
        w, s = state[module + ".weight"], state[module + ".weight_scale"]
        got = params[module + ".weight"].detach()
        assert torch.equal(got, fp8_recipe.dequantized("fp8-channel", w, s)), module
        within = fp8_recipe.bound(full[module + ".weight"], fp8_recipe.each_scale("fp8-channel", s, tuple(w.shape)))
        assert bool(((got - full[module + ".weight"]).abs() <= within).all())


def test_compressed_tensors_quantizes_to_the_same_bytes(merged):
    """The library's own quantization of the full merge's float32 weights (calculate_qparams per channel, then its
    float-quantized compressor) gives distmerge's FP8 weights and scales byte for byte, and config.json's
    quantization_config is what its ModelCompressor.update_config writes for the same config."""
    from compressed_tensors.compressors import FloatQuantizationCompressor, ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from compressed_tensors.quantization.utils import calculate_qparams

    folder = merged[CT_FOLDER, "fp8-channel"]
    config = json.loads((folder / "config.json").read_text())
    quant = QuantizationConfig.model_validate(config["quantization_config"])
    scheme = quant.config_groups["group_0"]
    full, ours = load_merged(merged[CT_FOLDER, "full"]), load_merged(folder)
    names = [n.removesuffix("_scale") for n in ours if n.endswith(".weight_scale")]
    for name in names:
        w = full[name]
        scale, zero = calculate_qparams(w.amin(dim=1, keepdim=True), w.amax(dim=1, keepdim=True), scheme.weights)
        out = FloatQuantizationCompressor.compress({"weight": w, "weight_scale": scale, "weight_zero_point": zero},
                                                   scheme)
        assert same_bytes(out["weight"], ours[name]) and same_bytes(scale, ours[name + "_scale"]), name
    written = folder.parent / "update_config"
    written.mkdir(exist_ok=True)
    (written / "config.json").write_text("{}")
    ModelCompressor(quantization_config=quant).update_config(str(written))
    assert json.loads((written / "config.json").read_text())["quantization_config"] == config["quantization_config"]


# -- the same bytes whatever the number of processes -------------------------------------------------------------
@pytest.mark.torchrun
@pytest.mark.parametrize(("nproc", "scheme"), [(2, "fp8-channel"), (3, "fp8-block")])
def test_output_bytes_are_the_same_for_any_n(nproc, scheme, mla_ckpts, merged, tmp_path):
    """DeepSeek-V3 (MLA, routed and shared experts) split in 40 KB files, so that files are spread over the ranks;
    N=1 is the one-process merge above, in one file. Compared after the same split, byte for byte."""
    ckpt = mla_ckpts["mla_tp2"]
    args = ["--input", ckpt, "--hf-config", reference_dir(ckpt) / "huggingface", "--quantize", scheme,
            "--max-shard-size", "40KB"]
    assert merge_inproc(*args, "--output", tmp_path / "n1") == 0
    run = torchrun(nproc, "merge", *args, "--quiet", "--output", tmp_path / "n")
    assert run.returncode == 0, run.stderr[-3000:]
    assert len(list((tmp_path / "n").glob("model-*.safetensors"))) > nproc
    assert tree_bytes(tmp_path / "n") == tree_bytes(tmp_path / "n1")
    assert load_merged(tmp_path / "n1").keys() == load_merged(merged["mla_tp2", scheme]).keys()


# What rank 0 runs in a one-process group started by Comm's own code (launched_world says 2, so Comm starts and
# destroys it as under torchrun); prints whether the group's Python object outlives close().
GROUP_AFTER_CLOSE = """
import gc, sys, weakref
import torch.distributed as dist
from distmerge.distributed import comm
from distmerge.quantize import compressed_config
comm.launched_world = lambda: 2
c = comm.Comm(device="cpu", timeout_s=60)
group = weakref.ref(dist.group.WORLD)
compressed_config.fp8_dynamic(["lm_head"], "fp8-channel")
c.close()
gc.collect()
print("alive" if group() is not None else "freed")
"""


def test_the_fp8_channel_config_leaves_the_group_to_close():
    """Rank 0 builds compressed-tensors' config (the import pulls in transformers, then torch.distributed.nn.functional)
    while the group is up: the group must still be freed by Comm.close(), not at interpreter exit, where its gloo
    threads abort the process (SIGABRT in 2 of 30 two-process merges before comm.Comm._start_group imported that
    module first: docs/reliability.md). A fresh interpreter: in this one the module may already be imported."""
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0",
           "WORLD_SIZE": "1", "PYTHONWARNINGS": "ignore"}
    run = subprocess.run([sys.executable, "-c", GROUP_AFTER_CLOSE], capture_output=True, text=True, timeout=120,
                         env=env, cwd=REPO)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split() == ["freed"], run.stdout


# -- options ----------------------------------------------------------------------------------------------------------
def test_a_cast_is_quantized_as_the_cast_merge_writes(fsdp_ckpts, tmp_path):
    """--dtype bf16 --quantize: the FP8 weights are the quantization of the bf16 merge's tensors; config.json says
    bfloat16, the dtype transformers dequantizes into."""
    ckpt = fsdp_ckpts["fsdp2_llama_w2"]
    assert merge_inproc("--input", ckpt, "--output", tmp_path / "bf16", "--dtype", "bf16") == 0
    assert merge_inproc("--input", ckpt, "--output", tmp_path / "q", "--dtype", "bf16", "--quantize", "fp8-block") == 0
    cast, quantized = load_merged(tmp_path / "bf16"), load_merged(tmp_path / "q")
    name = "model.layers.1.self_attn.q_proj.weight"
    q, s = recipe_block(cast[name])
    assert same_bytes(quantized[name], q) and same_bytes(quantized[name + "_scale_inv"], s)
    assert same_bytes(quantized["model.norm.weight"], cast["model.norm.weight"])
    config = json.loads((tmp_path / "q" / "config.json").read_text())
    assert config.get("torch_dtype", config.get("dtype")) == "bfloat16"


def test_nothing_to_quantize_is_refused(lora_only_ckpts, tmp_path, capsys):
    """A LoRA-only save without its base writes an adapter only: no linear weight to quantize, one clear line."""
    ckpt = lora_only_ckpts["fsdp2_llama_lora_only_w2"]
    assert merge_inproc("--input", ckpt, "--output", tmp_path / "out", "--quantize", "fp8-block") == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no tensor of this model is a linear layer" in err[0], err

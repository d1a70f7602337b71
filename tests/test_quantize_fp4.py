"""`--quantize nvfp4 | mxfp4`: every output tensor is, byte for byte, what llm-compressor 0.14's model_free_ptq
(schemes NVFP4A16, MXFP4A16) writes from distmerge's own plain merge in the same --dtype.

The peer runs in its own environment (.venv-peer, made by launch/setup_peer.sh, which launch/test.sh runs: it pins
transformers and compressed-tensors versions of its own), in one subprocess for all jobs (its import alone takes
seconds): tests/bench/peer_model_free_ptq.py. It is told to leave alone what distmerge leaves alone (the `ignore`
distmerge writes: lm_head, the embeddings, routers, and a weight whose inputs are not a whole number of groups, as
the 138-wide MLPs of the FSDP, DCP and DeepSpeed fixtures, which model_free_ptq refuses); with the issue's list,
["lm_head", "re:.*embed_tokens$"], on a model where the two agree, the bytes are the same too.

Without .venv-peer the peer's tests are skipped, saying so, except in CI (CI=true), where they fail.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from distmerge.quantize import fp4, fused, schemes
from tests.conftest import REPO, load_merged, merge_inproc, reference_dir, torchrun, tree_bytes
from tests.helpers import fp4_recipe
from tests.helpers.inputs import input_of

PEER = Path(os.environ.get("DISTMERGE_PEER_PYTHON", REPO / ".venv-peer" / "bin" / "python"))
PEER_SCRIPT = REPO / "tests" / "bench" / "peer_model_free_ptq.py"
HF = ("--hf-config", "REFERENCE/huggingface")
# case -> (fixture family, extra merge arguments)
CASES = {
    "fsdp2_llama_w2": ("fsdp_ckpts", ()),  # 138-wide MLP: down_proj stays in the merge's dtype
    "dcp_llama_w2": ("dcp_ckpts", ()),
    "megatron_tp2": ("megatron_ckpts", HF),  # q/k/v out of one fused linear_qkv, gate/up out of one linear_fc1
    "megatron_dist_mixtral_ep2": ("megatron_ckpts", HF),  # experts' w1/w3 share a global scale, over EP ranks
    "mla_tp2": ("mla_ckpts", HF),  # DeepSeek-V3: MLA, routed and shared experts, routers
    "ds_z2_fp32_w2": ("ds_ckpts", ()),
    "tt_qwen3_moe_w4": ("tt_ckpts", ()),  # Qwen3 MoE: routers are Linear modules, left as they are
}
RUNS = [(case, "bf16") for case in CASES] + [("fsdp2_llama_w2", "keep"), ("mla_tp2", "keep")]  # keep: float32
PRESETS = {"nvfp4": "NVFP4A16", "mxfp4": "MXFP4A16"}
ISSUE_IGNORE = ["lm_head", "re:.*embed_tokens$"]


def peer_python() -> Path:
    if PEER.exists():
        return PEER
    if os.environ.get("CI") == "true":
        pytest.fail(f"{PEER} is missing in CI: launch/test.sh makes it with launch/setup_peer.sh")
    pytest.skip(f"llm-compressor's environment {PEER} is absent: `bash launch/setup_peer.sh` makes it (about 3 min)")


@pytest.fixture(scope="module")
def merged(request, tmp_path_factory) -> dict[tuple, Path]:
    """(case, dtype, "plain" | scheme) -> a folder merged by one process."""
    root = tmp_path_factory.mktemp("fp4")
    out = {}
    for case, dtype in RUNS:
        family, extra = CASES[case]
        ckpt = request.getfixturevalue(family)[case]
        args = [a.replace("REFERENCE", str(reference_dir(ckpt))) for a in extra]
        for kind in ("plain", *PRESETS):
            folder = out[case, dtype, kind] = root / f"{case}-{dtype}-{kind}"
            quantize = () if kind == "plain" else ("--quantize", kind)
            assert merge_inproc("--input", input_of(ckpt), "--output", folder, "--dtype", dtype, *args, *quantize) == 0
    return out


@pytest.fixture(scope="module")
def peer(merged, tmp_path_factory) -> dict[tuple, Path]:
    """The same keys -> model_free_ptq's output from the plain merge, told to ignore what distmerge kept; and
    ("issue", scheme) -> megatron_tp2 with the issue's ignore list; ("random", dtype, scheme) -> random_folder's."""
    python, root = peer_python(), tmp_path_factory.mktemp("fp4_peer")
    jobs, out = [], {}

    def job(key, source: Path, scheme: str, ignore: list[str]) -> None:
        out[key] = root / "-".join(key)
        jobs.append({"input": str(source), "output": str(out[key]), "scheme": PRESETS[scheme], "ignore": ignore})

    for (case, dtype, kind), folder in merged.items():
        if kind != "plain":
            job((case, dtype, kind), merged[case, dtype, "plain"], kind, quantization(folder)["ignore"])
    randoms = {dtype: random_folder(root / f"random-{dtype}", dtype) for dtype in RANDOM}
    for scheme in PRESETS:
        job(("issue", scheme), merged["megatron_tp2", "bf16", "plain"], scheme, ISSUE_IGNORE)
        for dtype, folder in randoms.items():
            job(("random", dtype, scheme), folder, scheme, ISSUE_IGNORE)
    (root / "jobs.json").write_text(json.dumps(jobs))
    run = subprocess.run([str(python), str(PEER_SCRIPT), "--jobs", str(root / "jobs.json")], capture_output=True,
                         text=True, timeout=600, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert run.returncode == 0, run.stderr[-3000:]
    return out


def quantization(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())["quantization_config"]


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)))


def assert_same_tensors(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> None:
    assert sorted(ours) == sorted(theirs)
    differ = [name for name in ours if not same_bytes(ours[name], theirs[name])]
    assert not differ, differ


@pytest.mark.parametrize("scheme", list(PRESETS))
@pytest.mark.parametrize("case, dtype", RUNS)
def test_each_format_equals_the_peer(case, dtype, scheme, merged, peer):
    ours, theirs = load_merged(merged[case, dtype, scheme]), load_merged(peer[case, dtype, scheme])
    assert_same_tensors(ours, theirs)
    row = schemes.SCHEMES[scheme]
    assert sum(n.endswith(".weight_packed") for n in ours) >= 8
    assert all(ours[n].dtype == torch.uint8 for n in ours if n.endswith(".weight_packed"))
    assert {ours[n].dtype for n in ours if n.endswith(".weight_scale")} == {
        torch.float8_e4m3fn if row.global_scale else torch.uint8}
    mine, its = quantization(merged[case, dtype, scheme]), quantization(peer[case, dtype, scheme])
    assert (mine["quant_method"], mine["format"], mine["quantization_status"]) == (
        its["quant_method"], its["format"], its["quantization_status"]) == ("compressed-tensors", row.format,
                                                                           "compressed")
    assert list(mine["config_groups"]) == list(its["config_groups"]) == [row.preset]
    fields = ("num_bits", "type", "group_size", "strategy", "scale_dtype", "symmetric", "dynamic")
    ours_w, theirs_w = mine["config_groups"][row.preset]["weights"], its["config_groups"][row.preset]["weights"]
    assert {f: ours_w[f] for f in fields} == {f: theirs_w[f] for f in fields}
    assert mine["config_groups"][row.preset]["format"] == its["config_groups"][row.preset]["format"] == row.format
    assert "lm_head" in mine["ignore"] and "model.embed_tokens" in mine["ignore"]


@pytest.mark.parametrize("scheme", list(PRESETS))
def test_the_issue_ignore_list_gives_the_same_bytes(scheme, merged, peer):
    """Where every attention and MLP weight takes whole groups and there are no routers, the issue's ignore list and
    distmerge's name the same modules."""
    assert_same_tensors(load_merged(merged["megatron_tp2", "bf16", scheme]), load_merged(peer["issue", scheme]))


# -- random weights: the recipe's edges -------------------------------------------------------------------------
RANDOM = ("bfloat16", "float32", "float16")


def random_folder(folder: Path, dtype: str) -> Path:
    """A Llama-named folder of random weights: normal at several magnitudes, e2m1 grid values times powers of two
    (exact ties), all-zero rows, -0.0, values near the dtype's smallest, and heavy tails; q/k/v and gate/up sets."""
    gen, shapes = torch.Generator().manual_seed(len(dtype)), {"q_proj": (64, 64), "k_proj": (32, 64),
                                                               "v_proj": (32, 64), "o_proj": (64, 64)}
    tensors = {"model.embed_tokens.weight": torch.randn(8, 64, generator=gen)}
    for layer in range(4):
        for i, (name, shape) in enumerate({**{f"self_attn.{k}": v for k, v in shapes.items()},
                                           "mlp.gate_proj": (96, 64), "mlp.up_proj": (96, 64),
                                           "mlp.down_proj": (64, 96)}.items()):
            w = torch.randn(*shape, generator=gen) * 10.0 ** ((layer * 7 + i) % 9 - 6)
            kind = (layer + i) % 4
            if kind == 1:  # on the e2m1 grid, scaled by a power of two: ties for both layouts
                w = torch.randint(-14, 15, shape, generator=gen) * 0.25 * 2.0 ** ((layer * 5 + i) % 17 - 8)
            elif kind == 2:
                w[: shape[0] // 4] = 0
                w[shape[0] // 4, :7] = -0.0
                w[-1] *= 1e-30
            elif kind == 3:
                w = w * torch.exp(torch.randn(*shape, generator=gen) * 3)
            tensors[f"model.layers.{layer}.{name}.weight"] = w
    folder.mkdir(parents=True)
    save_file({k: v.to(getattr(torch, dtype)).contiguous() for k, v in tensors.items()}, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    return folder


@pytest.mark.parametrize("scheme", list(PRESETS))
@pytest.mark.parametrize("dtype", RANDOM)
def test_random_weights_equal_the_peer(dtype, scheme, peer):
    """fp4.py's recipe on its own (what the merge calls), fused sets from fused.py, against the peer's bytes."""
    source = peer["random", dtype, scheme].parent / f"random-{dtype}"
    weights = {k: v for k, v in load_merged_file(source).items() if k != "model.embed_tokens.weight"}
    theirs, row = load_merged(peer["random", dtype, scheme]), schemes.SCHEMES[scheme]
    sets = fused.sets_of(list(weights))
    members: dict[str, list[str]] = {}
    for name in weights:
        members.setdefault(sets.get(name, name), []).append(name)
    ours = {}
    for names in members.values():
        shared = row.shared([weights[n] for n in names])
        for name in names:
            parts = row.quantize(weights[name], shared)
            ours |= {n: t for (n, _, _), t in zip(row.parts(name, tuple(weights[name].shape)), parts, strict=True)}
    assert_same_tensors(ours, {k: v for k, v in theirs.items() if k != "model.embed_tokens.weight"})


def load_merged_file(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(folder / "model.safetensors")


# -- without the peer: the recipe's own promises ---------------------------------------------------------------
def test_e2m1_rounds_to_nearest_ties_to_even_and_packs_the_even_column_low():
    values = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, 0.2, 0.3, -0.1, -0.0, 0.0, -6.0, -2.6, 1e-30])
    assert fp4.codes(values).tolist() == [0, 2, 2, 4, 4, 6, 6, 7, 0, 1, 8, 0, 0, 15, 13, 0]
    nibbles = torch.tensor([[1, 2, 3, 15]], dtype=torch.uint8)
    assert fp4.pack(nibbles).tolist() == [[0x21, 0xF3]]
    assert fp4.unpack(fp4.pack(nibbles)).tolist() == [[0.5, 1.0, 1.5, -6.0]]


def test_mx_exponents_round_the_amax_to_a_power_of_two():
    """1.75 x 2^k and above round up to 2^(k+1); the scale is two below (6, e2m1's largest, is under 2^3); zero: 0."""
    amax = torch.tensor([6.0, 7.0, 1.0, 1.74, 1.76, 0.0, 2.0**-130], dtype=torch.float32)
    assert fp4.mx_exponent(amax).tolist() == [127, 128, 125, 125, 126, 0, 0]
    assert fp4.mx_exponent(amax.bfloat16()).tolist()[:6] == [127, 128, 125, 125, 126, 0]


@pytest.mark.parametrize("case", ["fsdp2_llama_w2", "megatron_tp2", "megatron_dist_mixtral_ep2", "mla_tp2"])
def test_fused_sets_share_one_global_scale(case, merged):
    """q/k/v, gate/up and Mixtral's w1/w3 (whatever unit or rank made them) carry one global scale, that of their
    amax together, computed here from the plain merge; any other weight its own. The sets are the specification's
    (tests/helpers/fp4_recipe.py), not fused.py's."""
    plain, ours = load_merged(merged[case, "bf16", "plain"]), load_merged(merged[case, "bf16", "nvfp4"])
    quantized = [n.removesuffix("_packed") for n in ours if n.endswith(".weight_packed")]
    sets = fp4_recipe.fused_sets(plain)
    shared = [n for n in quantized if len(sets[n]) > 1]
    assert len(shared) >= 2 and (case != "megatron_dist_mixtral_ep2" or any(".w3." in n for n in shared))
    for name in quantized:
        members = [n for n in sets[name] if n in quantized]
        amax = max(plain[n].float().abs().max() for n in members).to(torch.bfloat16)
        expected = (2688.0 / amax.reshape(1)).float()  # as fp4.Scheme.shared: reciprocal, then product, in bf16
        assert same_bytes(ours[name + "_global_scale"], expected), (name, members)
    assert len({ours[n + "_global_scale"].item() for n in quantized}) > 2


def test_fused_sets_share_one_global_scale_without_the_peer(fsdp_ckpts, tmp_path):
    """NVFP4 by its specification (tests/helpers/fp4_recipe.py; no peer needed): each layer's q/k/v and gate/up
    carry one global scale, 448 x 6 over the amax of the set together, every other weight its own; each group scale
    and packed byte is the specification's, from the plain bf16 merge. Seen failing with each weight given its own
    global scale, and with q/k/v left out of fused.py's sets (the test grouping with fused.sets_of agreed)."""
    ckpt = fsdp_ckpts["fsdp2_llama_w2"]
    for kind, extra in (("plain", ()), ("nvfp4", ("--quantize", "nvfp4"))):
        assert merge_inproc("--input", ckpt, "--output", tmp_path / kind, "--dtype", "bf16", *extra) == 0
    plain, ours = load_merged(tmp_path / "plain"), load_merged(tmp_path / "nvfp4")
    quantized = sorted(n.removesuffix("_packed") for n in ours if n.endswith(".weight_packed"))
    sets = fp4_recipe.fused_sets(quantized)
    assert len(quantized) == 12 and sum(len(m) > 1 for m in sets.values()) == 10  # q/k/v, gate/up of 2 layers
    for name in quantized:
        global_scale = fp4_recipe.nvfp4_global([plain[n] for n in sets[name]])
        packed, scale = fp4_recipe.nvfp4(plain[name], global_scale)
        assert same_bytes(ours[name + "_global_scale"], global_scale), (name, sets[name])
        assert same_bytes(ours[name + "_scale"], scale) and same_bytes(ours[name + "_packed"], packed), name


def test_two_processes_write_the_bytes_of_one(fsdp_ckpts, merged, tmp_path):
    """torchrun N=2 with small files, so that the ranks share the units (a fused set is one unit): the files of one
    process's merge with the same options, byte for byte, and the tensors of the peer-checked merge."""
    args = ("--input", fsdp_ckpts["fsdp2_llama_w2"], "--dtype", "bf16", "--quantize", "nvfp4",
            "--max-shard-size", "40KB")
    run = torchrun(2, "merge", *args, "--output", tmp_path / "n2")
    assert run.returncode == 0, run.stderr[-3000:]
    assert merge_inproc(*args, "--output", tmp_path / "n1") == 0
    assert len(list((tmp_path / "n1").glob("model-*.safetensors"))) > 3
    assert tree_bytes(tmp_path / "n2") == tree_bytes(tmp_path / "n1")
    assert_same_tensors(load_merged(tmp_path / "n2"), load_merged(merged["fsdp2_llama_w2", "bf16", "nvfp4"]))


@pytest.mark.parametrize("case, scheme", [("fsdp2_llama_w2", "nvfp4"), ("fsdp2_llama_w2", "mxfp4"),
                                          ("mla_tp2", "mxfp4")])
def test_transformers_loads_each_4_bit_folder_on_cpu(case, scheme, merged):
    """transformers (with compressed-tensors) loads the folder with no missing or unexpected key and decompresses it
    on CPU into exactly fp4.py's dequantized weights (what verify compares); its logits follow the plain merge's.
    Not NVFP4 MoE: transformers 5.25 fuses the experts and leaves their global scale out (the peer's folder too)."""
    from transformers import AutoModelForCausalLM

    folder, row = merged[case, "bf16", scheme], schemes.SCHEMES[scheme]
    model, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert not any(info.values()), info
    plain = AutoModelForCausalLM.from_pretrained(merged[case, "bf16", "plain"])
    ids = torch.arange(32).reshape(2, 16) * 7 % 1000
    with torch.no_grad():
        got, want = model.eval()(ids).logits.float(), plain.eval()(ids).logits.float()
    cosine = torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0).item()
    assert cosine > 0.98, cosine
    ours, loaded = load_merged(folder), model.state_dict()
    for name in (n.removesuffix("_packed") for n in ours if n.endswith(".weight_packed")):
        if name in loaded:  # a dense module's (experts are fused into other names)
            shared = ours.get(name + "_global_scale")
            dequantized = row.dequantize(ours[name + "_packed"], ours[name + "_scale"], shared)
            assert torch.equal(dequantized.to(loaded[name].dtype), loaded[name]), name

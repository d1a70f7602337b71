"""torchtitan input, end to end on real dumps saved by torchtitan's own CheckpointManager (tests/fixtures/
make_torchtitan.py: llama3 MHA, llama3 GQA tied with uneven shards, qwen3 with a bf16 export, qwen3 MoE with
more ranks than experts, DeepSeek-V3 with MLA, a dense first layer, shared experts and an MTP layer), and the
family, transform and checks behind it on their own.

The reference is torchtitan's own `to_hf` of the live model (which drops the MoE routing bias and a tied head):
every merged tensor equals it (torch.equal), from_pretrained gives torchtitan's own logits (llama3, DeepSeek-V3)
or transformers' logits of that reference (qwen3 MoE: torchtitan routes with a bias the Hugging Face model lacks).
"""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from distmerge.engine import discover as disc
from distmerge.engine.reader import Reader
from distmerge.engine.unwritten import _checksum
from distmerge.errors import InputError, LayoutError
from distmerge.families.base import FamilyContext, SourceMeta, claim
from distmerge.families.transforms import apply
from distmerge.formats import registry
from distmerge.formats.base import Fragment, Hints
from tests.conftest import assert_exact, load_merged, merge_inproc, reference_dir, torchrun, tree_bytes
from tests.fixtures.torchtitan_cases import input_ids
from tests.helpers.families import metas, torchtitan_sources, tt_hf_state

CASES = ["tt_llama3_mha_w2", "tt_llama3_gqa_tied_w3", "tt_qwen3_w2", "tt_qwen3_moe_w4"]
MOE, TIED, DSV3 = "tt_qwen3_moe_w4", "tt_llama3_gqa_tied_w3", "tt_deepseek_v3_w3"
DSV3_ARCH = "DeepseekV3ForCausalLM"


@pytest.fixture(scope="module")
def tt_merged(tt_ckpts, tmp_path_factory) -> Path:
    """Each dump merged once, one process, its last step: root/case and root/case.json (the summary)."""
    root = tmp_path_factory.mktemp("tt_merged")
    for case in [*CASES, DSV3]:
        args = ("--input", tt_ckpts[case], "--output", root / case, "--json-summary", root / f"{case}.json")
        assert merge_inproc(*args) == 0, case
    return root


def case_info(ckpt: Path) -> dict:
    return json.loads((reference_dir(ckpt) / "case.json").read_text())


def expected(ckpt: Path, step: int = 2) -> dict[str, torch.Tensor]:
    """torchtitan's to_hf of the live model at `step`, in the dtype that step's dump holds (the export's)."""
    suffix = "" if step == case_info(ckpt)["steps"] else f"_step-{step}"
    dtype = getattr(torch, case_info(ckpt)["generations"][f"step-{step}"]["dtype"])
    return {k: v.to(dtype) for k, v in load_file(reference_dir(ckpt) / f"hf_state{suffix}.safetensors").items()}


def error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("distmerge: error: "), err
    return err[0]


# -- end to end -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", CASES)
def test_merged_equals_torchtitans_own_to_hf(case, tt_ckpts, tt_merged):
    """fp32 full save (MHA), fp32 export (GQA tied, MoE), bf16 export (qwen3): every tensor, bit for bit."""
    assert_exact(load_merged(tt_merged / case), expected(tt_ckpts[case]))
    summary = json.loads((tt_merged / f"{case}.json").read_text())
    assert summary["format"] == "torchtitan" and "torchtitan checkpoint step-2" in summary["notes"]


@pytest.mark.parametrize(("case", "reference"), [("tt_llama3_mha_w2", "logits.pt"), (TIED, "logits.pt"),
                                                 (MOE, "hf_logits.pt"), (DSV3, "logits.pt")])
def test_from_pretrained_gives_the_reference_logits(case, reference, tt_ckpts, tt_merged):
    """llama3: torchtitan's own forward (so the RoPE permute is right); MoE: see the module docstring.
    DeepSeek-V3: torchtitan's own forward with its experts in fp32 (torchtitan_deepseek.fp32_experts), routing
    with the expert bias Hugging Face reads as e_score_correction_bias (the MTP layer is not in the main logits).
    Shown to fail for DeepSeek-V3 (the family's table patched in-process): expert_bias_E left out instead of
    written as e_score_correction_bias (max diff 2.8e-3), or the experts' w1/w3 targets swapped (1.1e-3)."""
    from transformers import AutoModelForCausalLM

    ckpt = tt_ckpts[case]
    model = AutoModelForCausalLM.from_pretrained(tt_merged / case, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=input_ids(case_info(ckpt)["vocab_size"])).logits.float()
    torch.testing.assert_close(logits, torch.load(reference_dir(ckpt) / reference, weights_only=True),
                               rtol=0, atol=1e-5)


@pytest.mark.torchrun
@pytest.mark.parametrize(("case", "n"), [(MOE, 3), (TIED, 2), (DSV3, 2), (DSV3, 3)])
def test_torchrun_output_is_byte_identical(case, n, tt_ckpts, tmp_path):
    args = ["--input", tt_ckpts[case], "--max-shard-size", "100KB"]
    assert merge_inproc(*args, "--output", tmp_path / "n1", "--json-summary", tmp_path / "s1.json") == 0
    run = torchrun(n, "merge", *args, "--quiet", "--output", tmp_path / "n", "--json-summary", tmp_path / "s.json")
    assert run.returncode == 0, run.stderr[-3000:]
    one, many = tree_bytes(tmp_path / "n1"), tree_bytes(tmp_path / "n")
    assert len([name for name in one if name.endswith(".safetensors")]) > 2 and one == many
    notes = [json.loads((tmp_path / s).read_text())["notes"] for s in ("s1.json", "s.json")]
    assert notes[0] == notes[1]  # the checks' notes are the same whoever read which fragment


def by_the_table(ckpt: Path, step: int) -> dict[str, torch.Tensor]:
    """DeepSeek-V3's expected output: torchtitan's to_hf for the decoder layers, and for the MTP layers the live
    torchtitan tensors under the names the family's table gives them (the MTP convention is the table's)."""
    from distmerge.families.torchtitan.tables import FAMILIES

    rows = [(row, re.compile(re.escape(row.source).replace(r"\{\}", r"(\d+)"))) for row in FAMILIES[DSV3_ARCH]]
    info, suffix = case_info(ckpt), "" if step == case_info(ckpt)["steps"] else f"_step-{step}"
    dtype = getattr(torch, info["generations"][f"step-{step}"]["dtype"])
    live = load_file(reference_dir(ckpt) / f"tt_state{suffix}.safetensors")
    layers = info["n_layers"]
    out = {k: v for k, v in expected(ckpt, step).items() if not k.startswith(f"model.layers.{layers}.")}
    for name, value in live.items():
        if not name.startswith("mtp_layers."):
            continue
        parts = [(f"{name}.{e}", value[e]) for e in range(len(value))] if "inner_experts" in name else [(name, value)]
        for source, tensor in parts:
            row, m = next((row, m) for row, pattern in rows if (m := pattern.fullmatch(source)))
            assert row.mtp, source
            numbers = [int(g) for g in m.groups()]
            out[row.target.format(layers + numbers[0], *numbers[1:])] = tensor.to(dtype)
    # and the copies of the embedding and head DeepSeek-V3's checkpoint keeps in its MTP layer (families/mtp.py)
    out[f"model.layers.{layers}.embed_tokens.weight"] = out["model.embed_tokens.weight"]
    out[f"model.layers.{layers}.shared_head.head.weight"] = out["lm_head.weight"]
    return out


@pytest.mark.parametrize("step", [2, 1])
def test_deepseek_v3_equals_to_hf_and_the_mtp_rows(step, tt_ckpts, tt_merged, tmp_path):
    """step 2: the fp32 model-only export; step 1: a full save (optimizer, train state skipped). 4 experts over 3
    ranks (chunks of 2, 2 and 0 experts), MLA with q LoRA, a dense first layer, a shared expert, the routing bias
    as e_score_correction_bias, one MTP layer. Shown to fail (the family's table patched in-process, this test
    reading the real one): shared-expert w1/w3 targets swapped (not equal), MTP rows left out (keys differ)."""
    ckpt = tt_ckpts[DSV3]
    out = tt_merged / DSV3
    if step != 2:
        out = tmp_path / "out"
        assert merge_inproc("--input", ckpt, "--step", str(step), "--output", out) == 0
    want = by_the_table(ckpt, step)
    assert len([k for k in want if k.startswith("model.layers.2.")]) > 20  # the MTP layer is there
    assert want["model.layers.1.mlp.gate.e_score_correction_bias"].abs().max() > 0  # a bias that routes
    assert_exact(load_merged(out), want)


START_UP_PROBE = """
import atexit, gc, json, runpy, sys
def report():
    print("PROBE " + json.dumps({"modules": sorted(sys.modules), "frozen": gc.get_freeze_count()}))
atexit.register(report)
sys.argv = ["distmerge", "merge", "--input", sys.argv[1], "--output", sys.argv[2], "--quiet"]
runpy.run_module("distmerge", run_name="__main__")
"""


def test_one_process_merge_starts_light(tt_ckpts, tmp_path):
    """`python -m distmerge merge --quiet` on a torchtitan dump imports no package that `import torch` does not
    (no torch.distributed beyond torch's own, no DTensor or DCP, no rich, safetensors or transformers), and its
    start-up imports are frozen out of the cyclic GC (cli._start_up; docs/torchtitan.md#speed). Shown to fail:
    rich imported at the top of report.py again (['rich', ...] listed), _start_up's freeze left out (frozen 0)."""
    import subprocess
    import sys

    def probe(*cmd: str) -> list[str]:
        run = subprocess.run([sys.executable, *cmd], capture_output=True, text=True, timeout=180)
        assert run.returncode == 0, run.stderr[-2000:]
        return [line.split(" ", 1)[1] for line in run.stdout.splitlines() if line.startswith("PROBE ")]

    (torch_only,) = probe("-c", "import json, sys, torch; print('PROBE ' + json.dumps(sorted(sys.modules)))")
    (merged,) = probe("-c", START_UP_PROBE, str(tt_ckpts[TIED]), str(tmp_path / "out"))
    merge = json.loads(merged)
    extra = set(merge["modules"]) - set(json.loads(torch_only))
    foreign = sorted(m for m in extra if m.split(".")[0] not in {*sys.stdlib_module_names, "distmerge"})
    assert foreign == [] and "distmerge.engine.run" in extra
    assert merge["frozen"] > 100_000  # torch's objects, frozen before the merge ran


def test_full_checkpoint_by_step(tt_ckpts, tmp_path):
    """step-1 is a full training save: optimizer, lr_scheduler, dataloader and train_state are skipped."""
    ckpt = tt_ckpts[MOE]
    summary = tmp_path / "s.json"
    assert merge_inproc("--input", ckpt / "checkpoint", "--step", "1", "--output", tmp_path / "out",
                        "--json-summary", summary) == 0
    assert_exact(load_merged(tmp_path / "out"), expected(ckpt, step=1))
    skipped = len(case_info(ckpt)["generations"]["step-1"]["non_model_keys"])
    notes = json.loads(summary.read_text())["notes"]
    assert "torchtitan checkpoint step-1" in notes and any(f"skipped {skipped} entries" in n for n in notes)


def test_expert_bias_is_named_with_its_magnitude(tt_ckpts, tt_merged):
    live = load_file(reference_dir(tt_ckpts[MOE]) / "tt_state.safetensors")
    biases = sorted(k for k in live if k.endswith("expert_bias_E"))
    assert len(biases) == 2 and any(live[k].abs().max() > 0 for k in biases)
    notes = json.loads((tt_merged / f"{MOE}.json").read_text())["notes"]
    note = next(n for n in notes if "expert_bias_E" in n)
    for key in biases:
        assert f"{key} (max |x| {live[key].abs().max().item():.3g})" in note
    assert "no routing bias" in note


def test_tied_head_must_equal_the_embedding(tt_ckpts, tt_merged, tmp_path, capsys):
    notes = json.loads((tt_merged / f"{TIED}.json").read_text())["notes"]
    assert "lm_head.weight not written: a copy of tok_embeddings.weight, written in its place (equal: checked)" in notes
    dump = Path(shutil.copytree(tt_ckpts[TIED], tmp_path / "dump"))
    found = disc.discover(dump, "auto", None, {})
    reader = Reader(found.scan, registry.get(found.scan.format))
    frag = next(f for f in reader.open(list(range(len(found.scan.files)))) if f.name == "lm_head.weight")
    reader.close()
    with open(Path(found.scan.root) / found.scan.files[frag.file_index].path, "r+b") as f:
        f.seek(frag.byte_offset + 4 * 5)
        f.write(torch.tensor([123.0]).numpy().tobytes())  # one element of one chunk of the head
    capsys.readouterr()
    assert merge_inproc("--input", dump, "--output", tmp_path / "out") == 1
    assert "lm_head.weight differs from tok_embeddings.weight" in error_line(capsys)
    assert not (tmp_path / "out" / "model.safetensors.index.json").exists()


def test_step_that_does_not_exist_lists_the_steps(tt_ckpts, tmp_path, capsys):
    assert merge_inproc("--input", tt_ckpts[TIED], "--step", "7", "--output", tmp_path / "out") == 1
    assert "has no step-7 (steps found: step-1, step-2)" in error_line(capsys)


def test_missing_config_names_hf_config(tt_ckpts, tmp_path, capsys):
    dump = tmp_path / "dump"
    shutil.copytree(tt_ckpts[TIED] / "checkpoint", dump / "checkpoint")
    capsys.readouterr()
    assert merge_inproc("--input", dump, "--output", tmp_path / "out") == 1
    assert "--hf-config" in error_line(capsys)
    config = reference_dir(tt_ckpts[TIED])
    assert merge_inproc("--input", dump / "checkpoint" / "step-2", "--output", tmp_path / "given",
                        "--hf-config", config) == 0


def test_a_step_already_in_hugging_face_format_is_said_so(tt_ckpts, tt_merged, tmp_path, capsys):
    """last_save_in_hf writes the last step as a Hugging Face model: nothing to merge."""
    dump = Path(shutil.copytree(tt_ckpts[TIED], tmp_path / "dump"))
    shutil.copytree(tt_merged / TIED, dump / "checkpoint" / "step-3")
    capsys.readouterr()
    for given in (dump, dump / "checkpoint" / "step-3"):
        assert merge_inproc("--input", given, "--output", tmp_path / "out") == 1
        assert "step-3 is already a Hugging Face model" in error_line(capsys)


def test_a_config_that_does_not_fit_is_refused_before_any_byte_moves(tt_ckpts, tmp_path, capsys):
    other = reference_dir(tt_ckpts["tt_qwen3_w2"])  # head_dim 32, vocab 999
    assert merge_inproc("--input", tt_ckpts["tt_llama3_mha_w2"], "--output", tmp_path / "out",
                        "--hf-config", other) == 1
    assert "wrong config.json?" in error_line(capsys)
    assert not (tmp_path / "out").exists()  # refused in discovery: not even the folder the merge made is left


# torchtitan 0.2 spelled these differently, and saves from before mid-2025 wrapped the model in `model.`
OLD_NAMES = (("attention.qkv_linear.", "attention."), ("moe.routed_experts.inner_experts.", "moe.experts."),
             ("experts.w1_EFD", "experts.w1"), ("experts.w3_EFD", "experts.w3"), ("experts.w2_EDF", "experts.w2"),
             ("moe.expert_bias_E", "moe.expert_bias"), ("lm_head.weight", "output.weight"))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("full", [False, True])
def test_older_names_and_the_model_wrapper(full, tt_ckpts, tmp_path):
    """The live MoE model's own tensors under 0.2 names and a `model.` wrapper, saved by dcp.save (no fixture
    of an older torchtitan exists): a model-only save, and a full one with optimizer and train state."""
    import torch.distributed.checkpoint as dcp

    ckpt = tt_ckpts[MOE]
    live = load_file(reference_dir(ckpt) / "tt_state.safetensors")
    state = {}
    for name, value in live.items():
        for new, old in OLD_NAMES:
            name = name.replace(new, old)
        state[f"model.{name}"] = value
    if full:
        state |= {"optimizer.state.tok_embeddings.weight.exp_avg": torch.zeros(3), "train_state.step": 2}
    dcp.save(state, checkpoint_id=tmp_path / "dump" / "checkpoint" / "step-2")
    summary = tmp_path / "s.json"
    assert merge_inproc("--input", tmp_path / "dump", "--output", tmp_path / "out", "--hf-config",
                        reference_dir(ckpt), "--json-summary", summary) == 0
    assert_exact(load_merged(tmp_path / "out"), expected(ckpt))
    assert any("layers.1.moe.expert_bias (max |x|" in n for n in json.loads(summary.read_text())["notes"])


# -- the RoPE permute -----------------------------------------------------------------------------------
def test_rope_permute_moves_each_pair_to_the_halves():
    heads, hd, dim = 3, 8, 5
    w = torch.arange(heads * hd * dim, dtype=torch.float32).reshape(heads * hd, dim)
    (hf,) = apply("rope_permute", [w], (("heads", heads),))
    for h in range(heads):
        for i in range(hd // 2):
            for c in range(2):  # torchtitan row head*hd + 2i + c -> Hugging Face row head*hd + c*hd/2 + i
                assert torch.equal(hf[h * hd + c * hd // 2 + i], w[h * hd + 2 * i + c])


def _interleaved_rope(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """Meta/torchtitan llama3: rows (2i, 2i+1) of each head are one complex number, times e^(i*angle_i)."""
    pairs = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2).contiguous())
    return torch.view_as_real(pairs * torch.polar(torch.ones_like(angles), angles)).flatten(-2)


def _half_rope(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """Hugging Face Llama: rows i and i + hd/2 of each head rotate together (rotate_half)."""
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    first, second = x.chunk(2, -1)
    return x * cos + torch.cat([-second, first], -1) * sin


def test_rope_permute_gives_the_same_attention_scores_under_rotate_half():
    heads, kv, hd, dim, seq = 4, 2, 8, 16, 6
    torch.manual_seed(0)
    wq, wk, x = torch.randn(heads * hd, dim), torch.randn(kv * hd, dim), torch.randn(seq, dim)
    angles = torch.arange(seq)[:, None, None] * 500000.0 ** (-torch.arange(hd // 2) / (hd // 2))

    def scores(q_w, k_w, rope):
        q = rope((x @ q_w.T).view(seq, heads, hd), angles)
        k = rope((x @ k_w.T).view(seq, kv, hd), angles).repeat_interleave(heads // kv, dim=1)
        return torch.einsum("qhd,khd->hqk", q, k)

    (hq,) = apply("rope_permute", [wq], (("heads", heads),))
    (hk,) = apply("rope_permute", [wk], (("heads", kv),))
    torchtitan = scores(wq, wk, _interleaved_rope)
    torch.testing.assert_close(scores(hq, hk, _half_rope), torchtitan, rtol=0, atol=1e-4)
    assert (scores(wq, wk, _half_rope) - torchtitan).abs().max() > 1e-2  # unpermuted: wrong, shapes still fit


# -- the equality checksum --------------------------------------------------------------------------------
def _sum_of(t: torch.Tensor, blocks: list[tuple[tuple[int, int], tuple[int, int]]]) -> int:
    total = 0
    for offsets, lengths in blocks:
        piece = t[offsets[0]:offsets[0] + lengths[0], offsets[1]:offsets[1] + lengths[1]].contiguous()
        frag = Fragment(name="t", dtype="F32", global_shape=tuple(t.shape), offsets=offsets, lengths=lengths,
                        file_index=0, byte_offset=0, key="t")
        total += _checksum(frag, 0, piece.view(-1).view(torch.uint8))
    return total % 2**64


def test_checksum_compares_copies_chunked_differently():
    t = torch.randn(7, 5)
    rows = [((0, 0), (3, 5)), ((3, 0), (4, 5))]  # Shard(0), uneven
    cols = [((0, 0), (7, 2)), ((0, 2), (7, 3))]  # Shard(1)
    assert _sum_of(t, rows) == _sum_of(t, cols) == _sum_of(t, [((0, 0), (7, 5))])
    changed, swapped = t.clone(), t.clone()
    changed[4, 1] = torch.nextafter(t[4, 1], torch.tensor(math.inf))  # one bit of one element
    swapped[[2, 5]] = t[[5, 2]]
    assert _sum_of(changed, cols) != _sum_of(t, rows) and _sum_of(swapped, cols) != _sum_of(t, rows)


# -- the family on its own (no fixture has DeepSeek-V3 or torchtitan 0.2 names) -----------------------------
def units_of(sources, config):
    family = claim(list(sources), config, Hints(naming="torchtitan"))
    return family.units(sources, FamilyContext(config=config, cast=None, hints=Hints(naming="torchtitan")))


def deepseek_with_mtp():
    config, state = tt_hf_state("deepseek_v3")
    sources = {n: m.shape for n, m in torchtitan_sources("DeepseekV3ForCausalLM", "0.3", state).items()}
    hidden = config["hidden_size"]
    for name, shape in list(sources.items()):  # one MTP block shaped like the last (MoE) layer
        if name.startswith("layers.1."):
            sources["mtp_" + name.replace("layers.1.", "layers.0.", 1)] = shape
    for part, shape in (("enorm", (hidden,)), ("hnorm", (hidden,)), ("eh_proj", (hidden, 2 * hidden)),
                        ("mtp_norm", (hidden,))):
        sources[f"mtp_layers.0.{part}.weight"] = shape
    return {**config, "num_nextn_predict_layers": 1}, sources


def test_deepseek_mtp_layers_follow_the_decoder_layers():
    config, sources = deepseek_with_mtp()
    result = units_of(metas(sources), config)
    targets = {t.name: u for u in result.units for t in u.targets}
    assert targets["model.layers.2.shared_head.norm.weight"].sources == ("mtp_layers.0.mtp_norm.weight",)
    assert targets["model.layers.2.mlp.experts.1.down_proj.weight"].sources == (
        "mtp_layers.0.moe.routed_experts.inner_experts.w2_EDF.1",)
    assert targets["model.layers.1.mlp.gate.e_score_correction_bias"].sources == ("layers.1.moe.expert_bias_E",)
    # the MTP layer also carries the embedding and the head, as DeepSeek-V3's checkpoint does (families/mtp.py)
    assert targets["model.layers.2.embed_tokens.weight"].sources == ("tok_embeddings.weight",)
    assert targets["model.layers.2.shared_head.head.weight"].sources == ("lm_head.weight",)
    assert not result.left_out and len(targets) == len(sources) + 2
    with pytest.raises(LayoutError, match="num_nextn_predict_layers is 2"):
        units_of(metas(sources), {**config, "num_nextn_predict_layers": 2})


def test_every_expert_is_counted_and_every_source_mapped():
    config, sources = deepseek_with_mtp()
    del sources["layers.1.moe.routed_experts.inner_experts.w1_EFD.1"]
    with pytest.raises(LayoutError, match=r"layers.1.moe.routed_experts.inner_experts.w1_EFD holds experts \[0\]"):
        units_of(metas(sources), config)
    config, sources = deepseek_with_mtp()
    sources["layers.0.attention.renamed_wq.weight"] = (4, 4)  # a rename the table does not know: never dropped
    with pytest.raises(InputError, match="layers.0.attention.renamed_wq.weight"):
        units_of(metas(sources), config)


def test_qwen3_moe_routing_bias_is_left_out_with_its_reason():
    config, state = tt_hf_state("qwen3_moe")
    for gen, bias in (("0.3", "layers.1.moe.expert_bias_E"), ("0.2", "layers.1.moe.expert_bias")):
        sources = torchtitan_sources("Qwen3MoeForCausalLM", gen, state)
        sources[bias] = SourceMeta(name=bias, dtype="F32", shape=(2,))
        result = units_of(sources, config)
        assert set(result.left_out) == {bias} and "no routing bias" in result.left_out[bias]
        assert sum(len(u.targets) for u in result.units) == len(state)


def test_llama3_rotates_wq_and_wk_only():
    config, state = tt_hf_state("llama")
    result = units_of(torchtitan_sources("LlamaForCausalLM", "0.2", state), config)
    rotated = {u.sources[0]: dict(u.params) for u in result.units if u.transform == "rope_permute"}
    assert rotated == {f"layers.{i}.attention.{w}.weight": {"heads": n} for i in range(2)
                       for w, n in (("wq", config["num_attention_heads"]), ("wk", config["num_key_value_heads"]))}


def test_every_row_is_reached_through_its_own_pattern():
    from distmerge.families.torchtitan.family import _compiled
    from distmerge.families.torchtitan.tables import FAMILIES
    from tests.helpers.families import torchtitan_samples

    reached: set[str] = set()
    torchtitan_samples(reached)
    for arch in FAMILIES:
        for row, _pattern in _compiled(arch):
            name = row.source.format(*range(row.source.count("{}")))
            assert next(r for r, p in _compiled(arch) if p.fullmatch(name)) == row, f"{arch}: {row.source} shadowed"
    every = {row.source for rows in FAMILIES.values() for row in rows if row.target and not row.mtp}
    assert every - reached == set(), "rows no sample reaches"


def test_dump_checkpoint_folder_and_step_folder_are_all_detected(tt_ckpts):
    """(a DCP folder with Hugging Face names stays dcp's: test_contract_formats.py's detection test)"""
    for given in ("", "checkpoint", "checkpoint/step-1"):
        assert registry.pick(tt_ckpts[MOE] / given).name == "torchtitan"

"""PPO critics (value models) on both backends, as verl builds them (tests/fixtures/make_critic.py): the merge
writes what save_pretrained of the family's ...ForTokenClassification writes (tensors and config.json), the
model loads with AutoModelForTokenClassification and gives the saving job's values, and `verify --logits`
compares values."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from distmerge.errors import ConfigError, LayoutError
from distmerge.families import value_head
from distmerge.families.base import FamilyContext, SourceMeta, claim
from distmerge.families.megatron import family as megatron
from distmerge.families.megatron.tables import FAMILIES
from distmerge.formats.base import Hints
from distmerge.front.cli import main as distmerge_main
from tests.conftest import (
    assert_exact,
    load_merged,
    load_reference,
    merge_inproc,
    reference_dir,
    torchrun,
    tree_bytes,
)

FSDP = ["critic_fsdp2_qwen2", "critic_fsdp2_llama"]
MEGATRON = ["critic_megatron_dist_tp2", "critic_megatron_bias_tp2"]  # head without / with a bias
CASES = FSDP + MEGATRON


def merge_args(ckpt: Path) -> list[object]:
    """Megatron saves take the actor's config.json (as verl saves it) from the reference folder."""
    hf = reference_dir(ckpt) / "huggingface"
    return ["--input", ckpt, *(["--hf-config", hf] if hf.is_dir() else [])]


@pytest.fixture(scope="module")
def merged(critic_ckpts, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("critics")
    for case in CASES:  # merge_inproc also checks that the input is untouched
        assert merge_inproc(*merge_args(critic_ckpts[case]), "--output", root / case) == 0, case
    return {case: root / case for case in CASES}


@pytest.mark.parametrize("case", CASES)
def test_critic_tensors_equal_the_saving_jobs(case, critic_ckpts, merged):
    """score.weight / score.bias (zeros for verl's bias-free Megatron head) and the body, torch.equal to
    save_pretrained of the live model. Shown to fail (in the module fixture's merge): with megatron_head()
    returning () the Megatron merges stop at 'output_layer.weight has 1 rows but config.json's vocab_size is
    1001'; without the one-row rule in megatron_layout.tp_split_dim the legacy head is the two TP copies
    stacked ('has 2 rows')."""
    assert_exact(load_merged(merged[case]), load_reference(critic_ckpts[case]))


@pytest.mark.parametrize("case", CASES)
def test_critic_loads_as_token_classifier_with_the_jobs_values(case, critic_ckpts, merged):
    """AutoModelForTokenClassification.from_pretrained: no missing, unexpected or resized weights, and the
    values the job's model gave (its forward checked there against the sharded model's own). Shown to fail:
    with with_zero_bias left out (score.weight only) score.bias is missing and newly initialised."""
    from transformers import AutoModelForTokenClassification

    model, info = AutoModelForTokenClassification.from_pretrained(merged[case], output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    ref = torch.load(reference_dir(critic_ckpts[case]) / "values.pt", weights_only=True)
    with torch.no_grad():
        values = model.eval()(ref["input_ids"]).logits
    assert values.shape == (*ref["input_ids"].shape, 1)
    torch.testing.assert_close(values, ref["values"], rtol=0, atol=1e-6)


@pytest.mark.parametrize("case", CASES)
def test_critic_config_is_a_one_label_token_classifier(case, critic_ckpts, merged):
    """config.json: the architectures and labels save_pretrained of the ...ForTokenClassification writes (the
    input's said ...ForCausalLM); every other key but the dtype as the input had it. Shown to fail: with
    as_value_model() not adding its config_updates, architectures stays ['Qwen2ForCausalLM']."""
    from transformers import AutoConfig

    ckpt = critic_ckpts[case]
    written = json.loads((merged[case] / "config.json").read_text())
    saved = json.loads((reference_dir(ckpt) / "config.json").read_text())  # save_pretrained's
    source = merge_args(ckpt)[-1] if case in MEGATRON else ckpt / "huggingface"
    given = json.loads((Path(source) / "config.json").read_text())
    assert given["architectures"][0].endswith("ForCausalLM")
    for key in ("architectures", "id2label", "label2id"):
        assert written[key] == saved[key], key
    assert written["architectures"][0].endswith("ForTokenClassification")
    changed = ("architectures", "id2label", "label2id", "dtype", "torch_dtype")  # dtype: finalize's, as always
    kept = {k: v for k, v in written.items() if k not in changed}
    assert kept == {k: v for k, v in given.items() if k not in changed}
    assert AutoConfig.from_pretrained(merged[case]).num_labels == 1


@pytest.mark.torchrun
def test_critic_torchrun_output_is_byte_identical(critic_ckpts, tmp_path):
    """N=1 and N=2 write the same bytes for the legacy critic (its head and bias replicated in both TP files).
    Shown to fail: with value_config() naming the label by the process id (a stand-in for any run-dependent
    decision) the two config.json differ."""
    args = [*merge_args(critic_ckpts["critic_megatron_bias_tp2"]), "--max-shard-size", "150KB", "--quiet"]
    assert merge_inproc(*args, "--output", tmp_path / "n1") == 0
    run = torchrun(2, "merge", *args, "--output", tmp_path / "n2")
    assert run.returncode == 0, run.stderr[-3000:]
    one, two = tree_bytes(tmp_path / "n1"), tree_bytes(tmp_path / "n2")
    assert len([n for n in one if n.endswith(".safetensors")]) > 2
    assert one == two


def verify(*args: object) -> int:
    return distmerge_main(["verify", *map(str, args)])


def test_verify_logits_compares_values(critic_ckpts, merged, tmp_path):
    """verify --logits loads the critic as a token classifier and compares its values: equal for the merge,
    and a score.bias moved by 0.25 in a copy shows as values 0.25 apart (only the values see a bias). Shown to
    fail: with ValueHeadFamily unregistered verify loads AutoModelForCausalLM and 'cannot run' (no lm_head)."""
    case = "critic_megatron_dist_tp2"
    ref = reference_dir(critic_ckpts[case])
    assert verify("--merged", merged[case], "--reference", ref, "--logits", "--json", tmp_path / "ok.json") == 0
    logits = json.loads((tmp_path / "ok.json").read_text())["logits"]
    assert logits["passed"] and logits["figures"]["max_abs"] == 0 and "values" in logits["note"]
    bad = shutil.copytree(merged[case], tmp_path / "bad")
    with safe_open(bad / "model.safetensors", framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    tensors["score.bias"] = tensors["score.bias"] + 0.25
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    assert verify("--merged", bad, "--reference", ref, "--logits", "--json", tmp_path / "bad.json") == 1
    logits = json.loads((tmp_path / "bad.json").read_text())["logits"]
    assert not logits["passed"] and logits["figures"]["max_abs"] == pytest.approx(0.25)


# -- the family's decisions, on names and shapes alone ---------------------------------------------------------
def meta(name: str, *shape: int) -> SourceMeta:
    return SourceMeta(name=name, dtype="F32", shape=shape)


def test_value_models_are_told_from_the_weights_not_the_config():
    """A one-row output layer is a value head whatever config.json says; a vocabulary-sized one is not; an HF
    score without a bias (a sequence classifier, e.g. a reward model) or beside an lm_head is not claimed.
    Shown to fail: with claims() not asking for score.bias the reward model is claimed."""
    critic = {"score.weight": meta("score.weight", 1, 8), "score.bias": meta("score.bias", 1)}
    assert claim(list(critic), {}, Hints()) is value_head.VALUE_HEAD
    assert claim(["score.weight", "model.norm.weight"], {}, Hints()) is not value_head.VALUE_HEAD
    assert claim([*critic, "lm_head.weight"], {}, Hints()) is not value_head.VALUE_HEAD
    assert value_head.megatron_head({"output_layer.weight": meta("output_layer.weight", 1, 8)})
    assert not value_head.megatron_head({"output_layer.weight": meta("output_layer.weight", 1024, 8)})


def test_every_megatron_family_has_its_token_classification_class():
    """The name value_config derives (…ForCausalLM -> …ForTokenClassification) is a transformers class for every
    architecture the Megatron family maps; an architecture that is no causal LM is refused, not guessed.
    Shown to fail: deriving '...ForTokenClassifier' finds no class."""
    import transformers

    for arch in FAMILIES:
        assert hasattr(transformers, value_head.token_classification(arch)), arch
    with pytest.raises(ConfigError, match="not a causal LM"):
        value_head.token_classification("Qwen2_5_VLForConditionalGeneration")


def test_a_megatron_head_that_does_not_fit_the_config_is_refused():
    """A one-row head of another hidden size: a LayoutError before any byte moves, not a model that fails to
    load. Shown to fail: without the shape check nothing is raised (the plan would write score.weight [1, 32]
    for hidden_size 64)."""
    config = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
              "num_hidden_layers": 0, "vocab_size": 10, "tie_word_embeddings": False}
    sources = {"output_layer.weight": meta("output_layer.weight", 1, 32),
               "decoder.final_layernorm.weight": meta("decoder.final_layernorm.weight", 64)}
    with pytest.raises(LayoutError, match=r"hidden_size needs \[1, 64\]"):
        megatron.units(sources, FamilyContext(config=config, cast=None))


def test_with_zero_bias_adds_a_zero_bias_and_keeps_the_weight():
    """The transform of a bias-free head: the weight untouched, a zero bias of one entry per row, same dtype, so
    x @ W.T + b gives what the head gave. Shown to fail: returning ones as the bias."""
    weight = torch.randn(1, 8, dtype=torch.bfloat16)
    out_weight, bias = value_head.with_zero_bias([weight])
    assert torch.equal(out_weight, weight) and bias.dtype == weight.dtype and torch.equal(bias, torch.zeros(1))
    x = torch.randn(3, 8, dtype=torch.bfloat16)
    assert torch.equal(torch.nn.functional.linear(x, out_weight, bias), x @ weight.T)


# -- a critic whose own config.json names its head class (what --is-value-model users pass) --------------------------
@pytest.mark.parametrize("case", CASES)
def test_critic_with_a_token_classification_config(case, critic_ckpts, tmp_path):
    """The critic's own config.json (save_pretrained of the ...ForTokenClassification: architectures
    Qwen2ForTokenClassification / LlamaForTokenClassification, one label) maps through its family on every format:
    the same tensors and the same config.json. Shown to fail: without base.body_class in table_for the Megatron
    cases stop at "config.json's architecture 'Qwen2ForTokenClassification' has no Megatron mapping"."""
    ckpt = critic_ckpts[case]
    own = tmp_path / "critic_config"
    own.mkdir()
    shutil.copy(reference_dir(ckpt) / "config.json", own / "config.json")
    assert json.loads((own / "config.json").read_text())["architectures"][0].endswith("ForTokenClassification")
    assert merge_inproc("--input", ckpt, "--hf-config", own, "--output", tmp_path / "out") == 0
    assert_exact(load_merged(tmp_path / "out"), load_reference(ckpt))
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    saved = json.loads((reference_dir(ckpt) / "config.json").read_text())
    for key in ("architectures", "id2label", "label2id"):
        assert written[key] == saved[key], key


def test_a_value_model_config_over_a_language_model_is_refused(megatron_ckpts, tmp_path, capsys):
    """A Megatron actor (vocabulary output layer) with a config.json that names Qwen2ForTokenClassification: one
    line, no model that loads as neither. Shown to fail: without refuse_head_config the merge writes lm_head.weight
    under a token-classification config."""
    ckpt = megatron_ckpts["megatron_qwen2_tp2"]
    config = json.loads((reference_dir(ckpt) / "huggingface" / "config.json").read_text())
    own = tmp_path / "config"
    own.mkdir()
    (own / "config.json").write_text(json.dumps({**config, "architectures": ["Qwen2ForTokenClassification"]}))
    assert merge_inproc("--input", ckpt, "--hf-config", own, "--output", tmp_path / "out") == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "names Qwen2ForTokenClassification, a value model, but the checkpoint has" in err[0]

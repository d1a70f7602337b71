"""`distmerge verify`'s totals (names matched both ways, least cosine per tensor and per kind of layer) and
`--plot PNG`, on a real merge of the real FSDP2 llama fixture against the state dict the training job saved.
The PNGs are read back and looked at as pixels: a valid image of the promised size, the kinds' colours drawn,
and a visibly different picture when one reference element moves."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file

from distmerge.verifier import plot, totals
from tests.conftest import merge_inproc, reference_dir
from tests.helpers.verify import SHARD, verify

BUMPED = "model.layers.1.mlp.down_proj.weight"
KIND_COLOURS = {"attention": (31, 119, 180), "MLP": (255, 127, 14), "norms": (44, 160, 44),
                "embeddings/head": (214, 39, 40)}  # matplotlib's tab: colours, plot.COLORS


@pytest.fixture(scope="module")
def llama(fsdp_ckpts, tmp_path_factory) -> dict[str, Path]:
    ckpt = fsdp_ckpts["fsdp2_llama_w4"]
    out = tmp_path_factory.mktemp("verify_plot") / "llama"
    assert merge_inproc("--input", ckpt, "--output", out, "--max-shard-size", SHARD) == 0
    return {"merged": out, "reference": reference_dir(ckpt)}


def reference_with(src: Path, dst: Path, edit) -> Path:
    """A copy of the reference's model.safetensors with `edit(tensors)` applied."""
    tensors = load_file(src / "model.safetensors")
    edit(tensors)
    dst.mkdir()
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def bump(tensors: dict[str, torch.Tensor]) -> None:
    tensors[BUMPED].view(-1)[3] += 1e-2


def pixels(path: Path) -> np.ndarray:
    with Image.open(path) as image:
        assert image.format == "PNG"
        assert image.size == (plot.SIZE[0] * plot.DPI, plot.SIZE[1] * plot.DPI)
        return np.asarray(image.convert("RGB"))


def colours(rgb: np.ndarray) -> set[tuple[int, int, int]]:
    return set(map(tuple, rgb.reshape(-1, 3).tolist()))


def rows_of(rgb: np.ndarray, colour: tuple[int, int, int]) -> np.ndarray:
    """The image rows where `colour` is drawn (within a little of it: lines are antialiased)."""
    near = np.abs(rgb.astype(int) - np.array(colour)).sum(axis=2) < 60
    return np.nonzero(near.any(axis=1))[0]


def printed(capsys) -> list[str]:
    return capsys.readouterr().out.splitlines()


# -- totals --------------------------------------------------------------------------------------------
def test_clean_pair_totals_full_coverage_and_cosine_one(llama, tmp_path, capsys):
    assert verify("--merged", llama["merged"], "--reference", llama["reference"], "--json", tmp_path / "r.json") == 0
    out = printed(capsys)
    assert out[-1] == "verify: PASS 21 tensors bit-exact"  # the verdict line as before, last
    assert out[-3] == ("names: 21 of 21 reference names in merged (100.00%), 21 of 21 merged names in reference "
                       "(100.00%); verl's criterion > 99%: met")
    assert out[-2].startswith("least cosine of 21 tensors compared: 1.000000 (")
    assert out[-2].endswith("not a criterion (--min-cosine C makes it one); by kind: attention 1.000000, "
                            "MLP 1.000000, norms 1.000000, embeddings/head 1.000000")
    t = json.loads((tmp_path / "r.json").read_text())["totals"]
    assert t["tensors_compared"] == 21
    assert t["coverage"] == {"reference_names": 21, "merged_names": 21, "matched": 21, "reference_in_merged": 1.0,
                             "merged_in_reference": 1.0, "criterion": "> 0.99", "met": True}
    assert {k: v["tensors"] for k, v in t["least_cosine_by_kind"].items()} == {
        "attention": 8, "MLP": 6, "norms": 5, "embeddings/head": 2}
    assert t["least_cosine"]["cosine"] == pytest.approx(1) and t["min_cosine_met"] is None


def test_an_extra_reference_tensor_lowers_the_coverage(llama, tmp_path, capsys):
    """Shown to fail: with the coverage counting every name as matched, this printed 100.00%."""
    ref = reference_with(llama["reference"], tmp_path / "ref",
                         lambda t: t.update({"model.layers.1.self_attn.extra.weight": torch.ones(4)}))
    assert verify("--merged", llama["merged"], "--reference", ref, "--json", tmp_path / "r.json") == 1
    out = printed(capsys)
    assert out[-1].startswith("verify: FAIL 1 of 22 tensors: model.layers.1.self_attn.extra.weight (missing")
    assert ("names: 21 of 22 reference names in merged (95.45%), 21 of 21 merged names in reference (100.00%); "
            "verl's criterion > 99%: NOT met") in out
    cov = json.loads((tmp_path / "r.json").read_text())["totals"]["coverage"]
    assert cov["reference_in_merged"] == pytest.approx(21 / 22) and cov["merged_in_reference"] == 1.0
    assert (cov["reference_names"], cov["merged_names"], cov["matched"], cov["met"]) == (22, 21, 21, False)


def test_least_cosine_names_the_tensor_and_its_kind(llama, tmp_path, capsys):
    ref = reference_with(llama["reference"], tmp_path / "ref", bump)
    assert verify("--merged", llama["merged"], "--reference", ref, "--min-cosine", "0.99999",
                  "--json", tmp_path / "r.json") == 1
    line = next(x for x in printed(capsys) if x.startswith("least cosine"))
    assert f"0.999986 ({BUMPED}), --min-cosine 0.99999: NOT met; by kind: attention 1.000000, MLP 0.999986" in line
    t = json.loads((tmp_path / "r.json").read_text())["totals"]
    assert t["least_cosine"]["name"] == t["least_cosine_by_kind"]["MLP"]["name"] == BUMPED
    assert t["least_cosine_by_kind"]["attention"]["cosine"] == pytest.approx(1)
    assert (t["min_cosine"], t["min_cosine_met"]) == (0.99999, False)


def test_quiet_keeps_only_the_verdict(llama, capsys):
    assert verify("--merged", llama["merged"], "--reference", llama["reference"], "-q") == 0
    assert printed(capsys) == ["verify: PASS 21 tensors bit-exact"]


@pytest.mark.parametrize(("name", "kind", "layer"), [
    ("model.embed_tokens.weight", "embeddings/head", None),
    ("lm_head.weight", "embeddings/head", None),
    ("score.weight", "embeddings/head", None),
    ("model.norm.weight", "norms", None),
    ("model.layers.3.post_attention_layernorm.weight", "norms", 3),
    ("model.layers.0.self_attn.q_norm.weight", "norms", 0),
    ("model.layers.12.self_attn.kv_a_proj_with_mqa.weight", "attention", 12),
    ("model.layers.1.self_attn.rotary_emb.inv_freq", "attention", 1),
    ("model.layers.7.mlp.experts.3.down_proj.weight", "MLP", 7),
    ("model.layers.7.mlp.gate.weight", "MLP", 7),
    ("visual.blocks.2.attn.qkv.weight", "attention", 2),
    ("visual.merger.weight", "other", None),
])
def test_kinds_and_layers_from_names(name, kind, layer):
    assert (totals.kind_of(name), totals.layer_of(name)) == (kind, layer)


# -- the plot ------------------------------------------------------------------------------------------
def test_plot_of_a_clean_merge_draws_every_kind(llama, tmp_path, capsys):
    assert verify("--merged", llama["merged"], "--reference", llama["reference"], "--plot", tmp_path / "p.png") == 0
    assert printed(capsys)[-1] == "verify: PASS 21 tensors bit-exact"
    rgb = pixels(tmp_path / "p.png")
    found = colours(rgb)
    assert len(found) > 50  # text, axes, series: not a blank canvas
    assert {kind for kind, colour in KIND_COLOURS.items() if colour in found} == set(KIND_COLOURS)


def test_one_changed_element_changes_the_picture(llama, tmp_path, capsys):
    """Shown to fail: with max rel drawn as 0 whatever the figures, the MLP line stayed flat in the top panel
    (14 rows of its colour in the top half of the image, 208 as it should be)."""
    assert verify("--merged", llama["merged"], "--reference", llama["reference"], "--plot", tmp_path / "a.png") == 0
    ref = reference_with(llama["reference"], tmp_path / "bumped", bump)
    assert verify("--merged", llama["merged"], "--reference", ref, "--plot", tmp_path / "sub" / "b.png") == 1
    assert printed(capsys)[-1].startswith(f"verify: FAIL 1 of 21 tensors: {BUMPED}")  # the plot after a failure too
    a, b = pixels(tmp_path / "a.png"), pixels(tmp_path / "sub" / "b.png")
    changed = (a != b).any(axis=2)
    assert changed.sum() > 2000, changed.sum()  # the MLP line leaves the floor in both panels, the axes rescale
    half = changed.shape[0] // 2  # the max rel panel above, 1 - cosine below: the MLP line climbs in both
    mlp_before, mlp_after = rows_of(a, KIND_COLOURS["MLP"]), rows_of(b, KIND_COLOURS["MLP"])
    assert (mlp_before < half).sum() < 40 and (mlp_before >= half).sum() < 40, mlp_before  # on the floor lines
    assert (mlp_after < half).sum() > 100 and (mlp_after >= half).sum() > 100, mlp_after


def test_plot_without_matplotlib_says_what_to_install(llama, tmp_path, monkeypatch, capsys):
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    assert verify("--merged", llama["merged"], "--reference", llama["reference"], "--plot", tmp_path / "p.png") == 1
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert lines == ["distmerge: error: --plot needs matplotlib: pip install 'distmerge[plot]'"], lines
    assert "verify:" not in captured.out  # refused before the comparison
    assert not (tmp_path / "p.png").exists()


def test_plot_error_is_a_distmerge_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(plot.PlotError, match=r"pip install 'distmerge\[plot\]'"):
        plot.require_matplotlib()

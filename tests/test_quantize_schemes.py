"""The --quantize schemes as one registry (distmerge/quantize/schemes.py): a scheme is one object, the command line
offers what is registered, a new scheme gets its own config.json or cannot be made at all, each scheme's folder runs
in a plain from_pretrained whatever the merge's --dtype, and the messages name the `quantize` extra.

INT8_ROW below is a scheme of the test's own (int8 weights, one float32 scale per output row), registered as a user
would add one: its class and its registry line, nothing else. docs/extending.md shows it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import tomllib
import torch

from distmerge import api, options
from distmerge.errors import DistmergeError
from distmerge.quantize import compressed_config, schemes
from distmerge.quantize.scheme import Scheme
from tests.conftest import REPO, assert_refused, load_merged, merge_inproc, reference_dir
from tests.helpers.inputs import input_of

CASE = "fsdp2_llama_w2"  # a float32 Llama: q/k/v/o and gate/up are whole groups of 16 and 32; down_proj (138) is not
# The schemes distmerge ships, as docs/quantize.md lists them: the command line must offer each
SHIPPED = {"fp8-block", "fp8-channel", "nvfp4", "mxfp4"}
TOY_CONFIG = {"quant_method": "int8-row-toy", "bits": 8}


@dataclass(frozen=True, kw_only=True)
class Int8Row(Scheme):
    """int8 weights, w ~ q * scale with one float32 scale per output row: scale = amax(|row|) / 127, q = round(w /
    scale) (to nearest even), so |q * scale - w| <= scale / 2."""

    name: str = "int8-row"
    description: str = "int8 weights, one float32 scale per output row (a test's toy)"
    bits = "INT8"

    def takes(self, shape: tuple[int, ...]) -> bool:
        return len(shape) == 2

    def parts(self, name: str, shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...], str]]:
        return [(name, shape, "I8"), (f"{name}_scale", (shape[0], 1), "F32")]

    def quantize(self, weight: torch.Tensor, shared: torch.Tensor | None = None) -> list[torch.Tensor]:
        w = weight.to(torch.float32)
        scale = w.abs().amax(dim=1, keepdim=True).clamp(min=2.0**-100) / 127
        return [torch.round(w / scale).to(torch.int8), scale]

    def config(self, unconverted: list[str]) -> dict[str, Any]:
        return {**TOY_CONFIG, "ignore": unconverted}

    def recognises(self, quant: Mapping[str, Any]) -> bool:
        return quant.get("quant_method") == TOY_CONFIG["quant_method"]

    def stored(self, codes: Mapping[str, str]) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
        return {w: {"parts": (s,)} for s in codes if s.endswith("_scale")
                and (w := s.removesuffix("_scale")) in codes and codes[w] == "I8"}, {}

    def decoder(self, shape: tuple[int, ...], parts: list[torch.Tensor], device: torch.device) -> RowDecoder:
        return RowDecoder(shape[1], parts[0], device)

    def loader(self, transformers: Any) -> Any:
        raise DistmergeError("transformers has no loader for int8-row")


class RowDecoder:
    kind, dtype, per = "INT8", "I8", 1

    def __init__(self, cols: int, scale: torch.Tensor, device: torch.device) -> None:
        self.cols, self.scale = cols, scale.to(device, torch.float32, copy=True).reshape(-1)

    def decode(self, start: int, q: torch.Tensor, n: int, take: Any) -> tuple[torch.Tensor, torch.Tensor]:
        scale = self.scale[torch.arange(start, start + n, device=self.scale.device) // self.cols]
        return q.to(torch.float32) * scale, scale

    def limit(self, ref: torch.Tensor, scale: torch.Tensor, cast_unit: float, take: Any) -> torch.Tensor:
        r = ref.abs().to(torch.float32)
        return scale / 2 + r * (cast_unit + 2.0**-20)  # room for the float32 division and product


INT8_ROW = Int8Row()


@pytest.fixture
def registered(monkeypatch):
    """INT8_ROW in the registry, as its one line there would put it; the options table rebuilt around it."""
    monkeypatch.setitem(schemes.SCHEMES, INT8_ROW.name, INT8_ROW)
    options.rows.cache_clear()
    yield INT8_ROW
    options.rows.cache_clear()


def quantize_row(command: str = "merge") -> options.Opt:
    return next(r for r in options.rows(command) if r.name == "quantize")


def test_the_command_line_offers_every_registered_scheme(capsys):
    """merge's, inspect's, verify's and watch's --quantize offer the shipped schemes, each in --help with its line.
    Shown to fail with the declaration's choices written out by hand without mxfp4."""
    options.rows.cache_clear()
    for command in ("merge", "inspect", "verify", "watch"):
        row = quantize_row(command)
        assert set(row.choices) == SHIPPED, command
        for name in SHIPPED:
            assert f"{name}: " in row.help
    assert "nvfp4" in quantize_row().help and "(needs the quantize extra)" in quantize_row().help


def test_a_registered_scheme_gets_its_own_config(registered, fsdp_ckpts, tmp_path, capsys):
    """A scheme of the test's own, put in the registry and nowhere else: the command line offers it and describes
    it, the merge writes its tensors (int8 and a scale per row, from the plain merge's weights by the recipe written
    here) and its own quantization_config, not FP8's; verify decodes it with its decoder and bound. Shown to fail
    with Quantized.config falling back on fp8-channel's config for a scheme it does not know (as before #44)."""
    ckpt = fsdp_ckpts[CASE]
    assert "int8-row" in quantize_row().choices and registered.description in quantize_row().help
    out, plain = tmp_path / "int8", tmp_path / "plain"
    assert merge_inproc("--input", input_of(ckpt), "--output", out, "--quantize", "int8-row") == 0
    assert merge_inproc("--input", input_of(ckpt), "--output", plain) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"] == {**TOY_CONFIG, "ignore": ["lm_head", "model.embed_tokens"]}
    ours, full = load_merged(out), load_merged(plain)
    name = "model.layers.0.self_attn.q_proj.weight"
    w = full[name]
    scale = w.abs().amax(dim=1, keepdim=True) / 127
    assert torch.equal(ours[name + "_scale"], scale)
    assert torch.equal(ours[name], torch.round(w / scale).to(torch.int8))
    assert torch.equal(ours["model.embed_tokens.weight"], full["model.embed_tokens.weight"])  # left alone
    result = api.verify(out, reference_dir(ckpt))
    bounded = [c for c in result.checks if c.outcome == "within INT8 bound"]
    assert result.passed and len(bounded) >= 8


def test_a_scheme_without_its_config_cannot_be_made():
    """A scheme that leaves config.json's quantization_config out is refused when it is made (so it can never be
    registered, and never falls back on another scheme's config); an unknown name is refused in one line."""

    @dataclass(frozen=True, kw_only=True)
    class NoConfig(Scheme):
        name: str = "no-config"
        description: str = "a scheme that forgot its config"
        bits = "INT8"
        takes, parts, quantize = Int8Row.takes, Int8Row.parts, Int8Row.quantize
        recognises, stored, decoder, loader = Int8Row.recognises, Int8Row.stored, Int8Row.decoder, Int8Row.loader

    with pytest.raises(TypeError, match="abstract method '?config"):
        NoConfig()
    with pytest.raises(DistmergeError, match="--quantize 'int9': no such scheme .*fp8-block"):
        schemes.Quantized(scheme="int9", unconverted=()).config()


def test_api_refuses_an_unregistered_scheme(fsdp_ckpts, tmp_path):
    with pytest.raises(DistmergeError, match="quantize='int8-row': choose one of fp8-block"):
        api.merge(input_of(fsdp_ckpts[CASE]), tmp_path / "out", quantize="int8-row")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("dtype", ["float32", "bf16", "fp16"])
@pytest.mark.parametrize("scheme", list(schemes.SCHEMES))  # every registered one, without being told of it
def test_each_folder_runs_in_a_plain_from_pretrained(scheme, dtype, fsdp_ckpts, tmp_path):
    """The folder of every scheme, merged in every --dtype, loads with a plain AutoModelForCausalLM.from_pretrained
    (no dtype given) and runs: its logits follow the plain merge's. Shown to fail on the code before #44 for nvfp4 and
    mxfp4 merged in float32 or float16 ("expected m1 and m2 to have the same dtype, but got: float != BFloat16":
    transformers decompresses 4-bit weights into bfloat16 and loaded the rest in the config's dtype)."""
    from transformers import AutoModelForCausalLM

    ckpt, out, plain = fsdp_ckpts[CASE], tmp_path / "q", tmp_path / "plain"
    assert merge_inproc("--input", input_of(ckpt), "--output", out, "--dtype", dtype, "--quantize", scheme) == 0
    assert merge_inproc("--input", input_of(ckpt), "--output", plain, "--dtype", dtype) == 0
    ids = torch.arange(32).reshape(2, 16) * 7 % 100
    with torch.no_grad():
        got = AutoModelForCausalLM.from_pretrained(out).eval()(ids).logits.float()
        want = AutoModelForCausalLM.from_pretrained(plain).eval()(ids).logits.float()
    assert torch.isfinite(got).all()
    cosine = torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0).item()
    assert cosine > 0.98, cosine


def test_a_missing_library_names_the_quantize_extra(fsdp_ckpts, tmp_path, capsys, monkeypatch):
    """Without compressed-tensors, each scheme that needs it is refused in one line naming `distmerge[quantize]`
    before anything is written (not `[fp8]`, which --quantize nvfp4 named before #44); the config builders say the
    same when the import fails. Both extras install the same library."""
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "compressed_tensors"
                        else find_spec(name, *a))
    for scheme in ("fp8-channel", "nvfp4", "mxfp4"):
        assert_refused(input_of(fsdp_ckpts[CASE]), tmp_path / scheme, "pip install 'distmerge[quantize]'", capsys,
                       "--quantize", scheme)
        assert not (tmp_path / scheme / "config.json").exists()
    monkeypatch.setitem(__import__("sys").modules, "compressed_tensors", None)
    with pytest.raises(DistmergeError, match=r"--quantize nvfp4 .*distmerge\[quantize\]"):
        compressed_config.preset("NVFP4A16", "nvfp4-pack-quantized", [], "nvfp4")
    with pytest.raises(DistmergeError, match=r"--quantize fp8-channel .*distmerge\[quantize\]"):
        compressed_config.fp8_dynamic([], "fp8-channel")
    extras = tomllib.loads(Path(REPO, "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["quantize"] == extras["fp8"] and any(r.startswith("compressed-tensors") for r in extras["quantize"])

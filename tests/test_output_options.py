"""The options that shape the output are declared once (output_options.py): the row of the options table,
the setting, the resume fingerprint and verify's treatment all come from the declaration. A new one is one
declaration: shown with a toy registered here, not in the package."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest

from distmerge import api, options, output_options
from distmerge.average.units import AverageOptions
from distmerge.engine import prepare, resume
from distmerge.engine.inputs import InputSpec
from distmerge.engine.prepare import OutputSettings
from distmerge.errors import InputError
from distmerge.families.base import LoraOptions
from distmerge.options.cli_options import output_settings
from distmerge.output_options import OutputOption
from distmerge.verifier import kinds
from distmerge.verifier.listing import VerifyOptions
from tests.helpers.options import REQUIRED, subparser

CONFIG_DIGEST = "f9d86028c6e0d64e225186f96acb69338b2c59764df79162107f5c4bb34d1310"  # of {"a": 1}


@pytest.mark.parametrize("settings, recorded", [
    (OutputSettings(), [("--format", "fsdp"), ("--dtype", "keep"), ("--max-shard-size", 5000000000),
                        ("--lora", "auto"), ("--lora-alpha", None), ("--base-model", None),
                        ("config.json", CONFIG_DIGEST), ("--iteration", 3)]),
    (OutputSettings(dtype="bf16", quantize="fp8-block", max_shard_bytes=2 * 10**9,
                    lora=LoraOptions(mode="merge", alpha=16.0, base_model="base/")),
     [("--format", "fsdp"), ("--dtype", "bfloat16"), ("--max-shard-size", 2000000000), ("--lora", "merge"),
      ("--lora-alpha", 16.0), ("--base-model", "base/"), ("config.json", CONFIG_DIGEST), ("--iteration", 3),
      ("--quantize", "fp8-block")]),
], ids=["defaults", "each-given"])
def test_run_json_records_the_options_as_before(settings, recorded):
    """run.json's options, key by key and in order, are what the code before the declarations wrote (taken from
    it): a finished merge resumed by this code has the same fingerprint, so it is still 'already complete'."""
    assert list(resume.output_options(settings, "fsdp", {"iteration": 3}, {"a": 1}).items()) == recorded


@pytest.mark.parametrize("command", options.COMMANDS)
def test_the_settings_made_with_no_arguments_hold_each_default(command):
    """output_options.given compares with OutputSettings(): its defaults are the declarations' defaults parsed."""
    values = options.with_defaults(command, input=".", output=".", merged=".", reference=".")
    assert output_options.given(output_settings(values)) == []


SAMPLES = {"average_weights": "0.25,0.75"}  # a value of each option of kind "value" (its own parser's)


def another_value(opt: OutputOption) -> list[str]:
    """A value of the option other than its default, as the command line spells it (a switch: none)."""
    if opt.kind == "switch":
        return []
    if choices := opt.offered()[0]:  # its own, or its registry's (--quantize)
        return [next(c for c in reversed(choices) if c != opt.default)]
    if opt.kind == "value":
        return [SAMPLES[opt.name]]
    return [{"float": "2.5", "size": "1MB", "text": "somewhere"}[opt.kind]]


@pytest.mark.parametrize("opt", output_options.OUTPUT_OPTIONS, ids=lambda o: o.name)
def test_each_declaration_reaches_every_place(opt):
    """Given, each declared option sets its setting, is recorded by its flag, and verify of two finished models
    refuses it by its flag; its row is an option of its commands and a keyword of the API."""
    argv = [*REQUIRED["merge"], opt.flag, *another_value(opt)]
    values = options.from_namespace(subparser("merge").parse_args(argv), "merge")
    settings = api.merge_request(values).settings
    assert output_options.given(settings) == [opt]
    assert output_options.setting(opt, settings) == opt.typed(values[opt.name])
    assert opt.flag in resume.output_options(settings, "fsdp", {}, {})
    assert opt.name in inspect.signature(api.merge).parameters
    if "verify" in opt.commands:
        assert opt.name in inspect.signature(api.verify).parameters
        request = api.verify_request({**options.with_defaults("verify", merged=".", reference="."),
                                      opt.name: values[opt.name]})
        assert output_options.given(request.settings) == [opt] and kinds._settings_given(request) == [opt.flag]
        assert {k: getattr(request.criteria, k) for k in opt.criteria} == dict(opt.criteria)


def test_verify_refuses_a_declared_option_where_no_merge_takes_it(tmp_path):
    """Two finished models: every option given is named; --quantize with a checkpoint --reference: refused too."""
    for side in ("a", "b"):
        (tmp_path / side).mkdir()
        (tmp_path / side / "model.safetensors").write_bytes(b"")
    opts = VerifyOptions(merged=tmp_path / "a", reference=tmp_path / "b",
                         settings=OutputSettings(dtype="bf16", lora=LoraOptions(alpha=8.0)))
    with pytest.raises(InputError, match="is a finished model; --dtype, --lora-alpha: options of the merge"):
        kinds.kinds(opts)
    (tmp_path / "c").mkdir()  # no model files: a checkpoint to verify
    opts = VerifyOptions(merged=tmp_path / "a", reference=InputSpec(locations=tmp_path / "c", format="fsdp"),
                         settings=OutputSettings(quantize="fp8-block"))
    with pytest.raises(InputError, match="--quantize: --merged .* is a finished model .* leave --quantize out"):
        kinds.kinds(opts)


# -- a new option is one declaration ---------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class ToySettings(OutputSettings):
    """Where the engine would read the toy's setting: the field a new option's code adds."""

    toy_scale: float | None = None


TOY = OutputOption(name="toy_scale", flag="--toy-scale", kind="float", metavar="S", setting="toy_scale",
                   help="a toy option that scales the output", commands=("merge", "verify"))


@pytest.fixture
def toy(monkeypatch):
    monkeypatch.setattr(output_options, "OUTPUT_OPTIONS", (*output_options.OUTPUT_OPTIONS, TOY))
    monkeypatch.setattr(prepare, "OutputSettings", ToySettings)
    options.rows.cache_clear()
    yield
    options.rows.cache_clear()


def test_a_new_option_is_one_declaration(toy):
    """Registered here (not in the package): the toy is at once in merge's and verify's --help (not inspect's), a
    keyword of the API with its default, set in the request's settings, recorded in run.json only when given (so
    earlier outputs keep their fingerprint), named by resume's line, and refused by verify of two finished models."""
    assert "--toy-scale S" in subparser("merge").format_help() and "--toy-scale" in subparser("verify").format_help()
    assert "--toy-scale" not in subparser("inspect").format_help()
    assert options.signature("merge", "MergeResult").parameters["toy_scale"].default is None
    assert "toy_scale (--toy-scale): a toy option" in options.docstring("verify", "")
    with pytest.raises(InputError, match="toy_scale='big'"):
        options.from_keywords("merge", {"input": "a", "output": "b", "toy_scale": "big"})
    values = options.from_keywords("merge", {"input": "x", "output": "y", "toy_scale": 2})
    given = api.merge_request(values).settings
    plain = api.merge_request(options.from_keywords("merge", {"input": "x", "output": "y"})).settings
    assert given.toy_scale == 2.0 and plain.toy_scale is None
    args = subparser("merge").parse_args([*REQUIRED["merge"], "--toy-scale", "2"])
    assert api.merge_request(options.from_namespace(args, "merge")).settings == given

    before = resume.output_options(plain, "fsdp", {}, {})
    after = resume.output_options(given, "fsdp", {}, {})
    assert "--toy-scale" not in before and after == {**before, "--toy-scale": 2.0}
    line = resume.explain(SimpleNamespace(files=[]), resume.RunRecord(fingerprint="b", options=after, inputs={}),
                          resume.RunRecord(fingerprint="a", options=before, inputs={}), [])
    assert line == "resume: --toy-scale (unset -> 2.0) differs from the interrupted run: redoing all 0 file(s)"

    request = api.verify_request({**options.with_defaults("verify", merged=".", reference="."), "toy_scale": 2.0})
    assert request.settings.toy_scale == 2.0 and kinds._settings_given(request) == ["--toy-scale"]


def test_averaging_as_declarations():
    """--average (a switch) and --average-weights (a value of its own parser) set two fields of one setting: both
    command lines and the API agree, a bad weight is an InputError naming the keyword, and run.json records them
    only when given (an output merged before averaging existed keeps its fingerprint)."""
    args = subparser("merge").parse_args([*REQUIRED["merge"], "--average", "--average-weights", "0.25,0.75"])
    cli = api.merge_request(options.from_namespace(args, "merge")).settings
    for weights in ("0.25,0.75", [0.25, 0.75], (0.25, 0.75)):
        keywords = options.from_keywords("merge", {"input": "x", "output": "y", "average": True,
                                                   "average_weights": weights})
        assert api.merge_request(keywords).settings == cli
    assert cli.average == AverageOptions(on=True, weights=(0.25, 0.75))
    for bad in ("a,b", "1,inf", "0.5,", [1, "x"]):
        with pytest.raises(InputError, match="average_weights="):
            options.from_keywords("merge", {"input": "x", "output": "y", "average_weights": bad})
    recorded = resume.output_options(cli, "fsdp", {}, {})
    assert [recorded[f] for f in ("--average", "--average-weights")] == [True, [0.25, 0.75]]
    plain = api.merge_request(options.from_keywords("merge", {"input": "x", "output": "y"})).settings
    assert not {"--average", "--average-weights"} & set(resume.output_options(plain, "fsdp", {}, {}))


def test_input_is_repeated_for_an_average():
    """One --input is what it always was (a path, no other input); several are the average's inputs, in order,
    from the command line as from a list in the API."""
    one = api.merge_request(options.from_namespace(subparser("merge").parse_args(REQUIRED["merge"]), "merge"))
    assert one.input.locations == (Path(REQUIRED["merge"][1]),)
    args = subparser("merge").parse_args([*REQUIRED["merge"], "--input", "b", "-i", "s3://c/d", "--average"])
    many = api.merge_request(options.from_namespace(args, "merge"))
    assert many.input.locations == (one.input.location, Path("b"), "s3://c/d")
    keywords = api.merge_request(options.from_keywords("merge", {"input": [one.input.location, "b", "s3://c/d"],
                                                                 "output": REQUIRED["merge"][3], "average": True}))
    assert keywords.input == many.input

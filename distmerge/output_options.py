"""The options that shape the output, each declared once: OUTPUT_OPTIONS. A declaration says everything about its
option, and each place that needs one iterates over the declarations instead of naming it:

    what                             read by
    its row: flag, API keyword,      options.rows (at options.OUTPUT_OPTIONS): argparse (cli_options.add_options),
      kind, default, choices, help     the API's signature and checks (options.signature, from_keywords), docs/cli.md
    the OutputSettings it sets       settings(): cli_options.output_settings, for merge, inspect, verify
    what run.json records            recorded(): engine.resume.output_options (the resume fingerprint, and the
                                       `--dtype (keep -> bfloat16) differs` line)
    how verify treats it             given() and criteria(): verify.kinds (refused where no merge in memory takes
                                       it), api.verify_request (what it changes in the comparison)

Adding an option that shapes the output is one declaration here (plus the code that uses its setting: a field of
engine.prepare.OutputSettings that the engine reads). An option whose choices are a registry's (--quantize: the
scheme registry, quantize/schemes.py) names it in `registry`, read each time the options table is built. Light on
purpose (the command line imports it before it turns the GC off and imports torch: cli._start_up): a registry is
imported when it is read.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from distmerge.option_kinds import Kind

CAST_NAMES = ("keep", "bf16", "fp16", "fp32", "bfloat16", "float16", "float32")
EVERY = ("merge", "inspect", "verify", "watch")
# How verify treats an option given (verify.kinds): its merges in memory are shaped by it, and where none is, it is
# refused in one line.
VERIFY = {"every": "shapes the merge in memory of each side that is a checkpoint (refused when neither is)",
          "merged": "shapes only the merge of a --merged checkpoint, compared with a Hugging Face --reference "
                    "(refused with a checkpoint --reference: `refusals`)"}


def _same(value: Any) -> Any:
    return value


def average_weights(text: str) -> tuple[float, ...]:
    """--average-weights: numbers, comma-separated (`0.25,0.75`, `1,1,2`): any finite ones (docs/average.md)."""
    import argparse
    import math

    try:
        weights = tuple(float(w) for w in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not numbers separated by commas: {text!r} (e.g. 0.25,0.75)") from None
    if not all(math.isfinite(w) for w in weights):
        raise argparse.ArgumentTypeError(f"every weight must be a finite number: {text!r}")
    return weights


@dataclass(frozen=True, kw_only=True)
class OutputOption:
    """One option that shapes the output: its row of the options table, the setting it makes, what the resume
    fingerprint records of it and how verify treats it."""

    # its row of options.OPTIONS (options.Opt's fields of the same names; group "output")
    name: str  # the API's keyword, argparse's dest
    flag: str  # the command line's spelling
    help: str
    kind: Kind = Kind.TEXT
    parse: Callable[[str], Any] | None = None  # kind "value": its parser (a bad value: ValueError or ArgumentTypeError)
    default: Any = None  # as the command line spells it; None: not given
    choices: tuple[str, ...] | None = None
    # choices from a registry: each choice -> its line of help, appended to `help` (replaces `choices`)
    registry: Callable[[], Mapping[str, str]] | None = None
    metavar: str | None = None
    commands: tuple[str, ...] = EVERY
    # the output settings: the engine.prepare.OutputSettings field it sets ("lora.alpha": a field of that field),
    # from the parsed value by `typed` (not called on None)
    setting: str
    typed: Callable[[Any], Any] = _same
    # the resume fingerprint (run.json's options, by `flag`): `record` of the setting. "always": recorded at its
    # default too (the options recorded before run.json could leave one out); "given": recorded only when not at
    # its default, so an output merged before the option existed keeps its fingerprint (a new option's way)
    record: Callable[[Any], Any] = _same
    recorded: str = "given"
    # verify: a VERIFY key; `refusals`: a "merged" one's, with a checkpoint --reference ("checkpoint": --merged is one
    # too, "model": it is a finished model; {merged}, {reference}: the paths); `criteria`: the fields of
    # verify.report.Criteria it sets when given
    verify: str = "every"
    refusals: Mapping[str, str] = field(default_factory=dict)
    criteria: Mapping[str, Any] = field(default_factory=dict)

    def offered(self) -> tuple[tuple[str, ...] | None, str]:
        """The choices and help the command line shows: its registry's as it is now, when it has one, each choice
        with its line of help."""
        if self.registry is None:
            return self.choices, self.help
        registered = self.registry()
        return tuple(registered), f"{self.help}: " + "; ".join(f"{name}: {line}" for name, line in registered.items())


def _schemes() -> Mapping[str, str]:
    """--quantize's choices: the scheme registry's, each with its line of help."""
    from distmerge.quantize import schemes

    return schemes.choices()


def _dtype_record(name: str) -> str:
    """Aliases that give the same output are recorded alike (bf16 and bfloat16)."""
    from distmerge.dtypes import CAST_CHOICES, hf_dtype_name

    return hf_dtype_name(code) if (code := CAST_CHOICES[name]) else "keep"


# verify --average: the --merged checkpoints' average against a finished model (a checkpoint --reference is merged
# with the same settings, and the reference side is one checkpoint)
AVERAGE_REFUSALS = {
    "checkpoint": "--average checks the average of the --merged checkpoints against a finished model: pass a Hugging "
                  "Face folder as --reference (merge --average's output), not a checkpoint",
    "model": "--average averages training checkpoints: --merged {merged} is a finished model"}

OUTPUT_OPTIONS: tuple[OutputOption, ...] = (
    OutputOption(name="dtype", flag="--dtype", default="keep", choices=CAST_NAMES, setting="dtype",
                 help="cast floating tensors (default: keep the checkpoint's dtype)",
                 record=_dtype_record, recorded="always", criteria={"accept_cast": True}),
    OutputOption(name="quantize", flag="--quantize", registry=_schemes, metavar="SCHEME",
                 setting="quantize", verify="merged", refusals={
                     "checkpoint": "--quantize compares quantized weights with a full-precision reference: pass a "
                                   "Hugging Face folder as --reference (merge the reference checkpoint first), not a "
                                   "second checkpoint",
                     "model": "--quantize: --merged {merged} is a finished model (its quantized weights, if any, are "
                              "compared as written) and --reference {reference} a checkpoint, merged in full "
                              "precision; leave --quantize out"},
                 help="write the linear weights of attention and MLP blocks quantized from the merged tensors "
                 "(docs/quantize.md)"),
    OutputOption(name="max_shard_size", flag="--max-shard-size", kind=Kind.SIZE, default="5GB", metavar="SIZE",
                 setting="max_shard_bytes", recorded="always",
                 help="largest output file (default 5GB; one file is named model.safetensors)"),
    OutputOption(name="lora", flag="--lora", default="auto", choices=("auto", "adapter", "merge"),
                 setting="lora.mode", recorded="always",
                 help="LoRA checkpoints: base model + PEFT adapter (auto, adapter) or fused weights (merge)"),
    OutputOption(name="lora_alpha", flag="--lora-alpha", kind=Kind.FLOAT, metavar="ALPHA", setting="lora.alpha",
                 recorded="always", help="LoRA alpha when lora_train_meta.json is missing or wrong"),
    OutputOption(name="base_model", flag="--base-model", metavar="NAME_OR_DIR", setting="lora.base_model", typed=str,
                 recorded="always",
                 help="LoRA: the base model. A Hugging Face folder (config.json + safetensors): its weights complete a "
                      "LoRA-only save (base model + adapter, or fused with --lora merge). Any value: "
                      "base_model_name_or_path in adapter_config.json (default: the config's)"),
    OutputOption(name="average", flag="--average", kind=Kind.SWITCH, default=False, setting="average.on",
                 commands=("merge", "verify"), verify="merged", refusals=AVERAGE_REFUSALS,
                 help="write the weighted average of the inputs (--input, once per checkpoint "
                 "of one model): each floating tensor summed in float64 in the order given, then cast "
                 "(docs/average.md); verify: the average of the --merged checkpoints, in memory"),
    OutputOption(name="average_weights", flag="--average-weights", kind=Kind.VALUE, parse=average_weights,
                 metavar="W1,W2,...", setting="average.weights", record=list, commands=("merge", "verify"),
                 verify="merged", refusals=AVERAGE_REFUSALS,
                 help="--average: each input's weight, in --input (verify: --merged) order (default: 1/K each; any "
                      "finite numbers)"),
)


def names() -> frozenset[str]:
    return frozenset(o.name for o in OUTPUT_OPTIONS)


def settings(base: Any, values: Mapping[str, Any]) -> Any:
    """`base` (an OutputSettings) with the setting of each declared option of `values` (the parsed options by name;
    an option the command lacks is left at its default)."""
    for opt in OUTPUT_OPTIONS:
        if opt.name in values:
            value = values[opt.name]
            base = _set(base, opt.setting.split("."), None if value is None else opt.typed(value))
    return base


def _set(obj: Any, path: list[str], value: Any) -> Any:
    head, *rest = path
    return replace(obj, **{head: _set(getattr(obj, head), rest, value) if rest else value})


def setting(opt: OutputOption, settings_: Any) -> Any:
    for part in opt.setting.split("."):
        settings_ = getattr(settings_, part)
    return settings_


def given(settings_: Any) -> list[OutputOption]:
    """The declared options whose setting is not their default's (an OutputSettings made with no arguments holds
    each default: tests/test_output_options.py), in declaration order."""
    default = type(settings_)()
    return [o for o in OUTPUT_OPTIONS if setting(o, settings_) != setting(o, default)]


def recorded(settings_: Any, when: str) -> dict[str, Any]:
    """run.json's options (flag -> record) of the options recorded `when` ("always", or "given" and given)."""
    if when == "always":
        chosen = [o for o in OUTPUT_OPTIONS if o.recorded == "always"]
    else:
        chosen = [o for o in given(settings_) if o.recorded == "given"]
    return {o.flag: o.record(setting(o, settings_)) for o in chosen}


def criteria(settings_: Any) -> dict[str, Any]:
    """What the options given change in verify's comparison (verify.report.Criteria's fields)."""
    return {k: v for o in given(settings_) for k, v in o.criteria.items()}

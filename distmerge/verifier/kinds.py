"""Rank 0, before anything is read: what each side of a verify is (a finished model, compared as it is, or a training
checkpoint, merged in memory) and how a checkpoint side is read. Options that cannot apply to the kinds found are
refused here, in one line each.

    --merged      --reference    run by
    model         model          compare.py (two finished models)
    checkpoint    model          checkpoint.py (the checkpoint's targets compared as they are built)
    model         checkpoint     checkpoint.py, the sides' roles swapped inside (the report keeps the user's)
    checkpoint    checkpoint     two_checkpoints.py

--merged is read with --format, --hf-config, the formats' own options and --base-model; --reference with their
--reference- twins (options.py: REFERENCE_OPTIONS): each side one engine.inputs.InputSpec. --merged given several
times with --average is an average of checkpoints, merged in memory as `merge --input A --input B --average` would
(one --merged, or several without --average: refused with merge's words). A side given as s3://bucket/prefix or as
a Source object is a checkpoint: verify reads finished models from local paths only.

The options that shape the output (output_options.py) say how verify takes them: --dtype, --lora, --max-shard-size
(and --budget) shape every merge in memory; --quantize only a --merged checkpoint's, compared with a Hugging Face
--reference (bounded.py), and --average only the --merged checkpoints'.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, field
from pathlib import Path

from distmerge import output_options
from distmerge.average.units import AverageOptions
from distmerge.average.units import check as check_average
from distmerge.engine import discover as disc
from distmerge.engine.inputs import InputSpec, discover_spec
from distmerge.engine.prepare import OutputSettings
from distmerge.errors import DistmergeError, InputError
from distmerge.formats import registry
from distmerge.input import source
from distmerge.verifier.listing import VerifyOptions
from distmerge.verifier.sides import LAYOUTS

# What marks a finished model (save_pretrained's or a merge's), and the model files of a merge that did not finish
# (verify refuses that folder by name, as before, instead of trying it as a checkpoint).
MODEL_MARKS = (*(name for _, index, single in LAYOUTS for name in (index, single)), "model-*-of-*.safetensors")
# InputSpec fields that read --merged as a checkpoint, by their flags: given with a finished model, a mistake.
MERGE_FLAGS = {"format": "--format", "hf_config": "--hf-config", "format_options": "the format's own options",
               "base_model": "--base-model"}
REFERENCE_FLAGS = {"format": "--reference-format", "hf_config": "--reference-hf-config",
                   "format_options": "the format's own options for --reference (--reference-iteration ...)"}
# ... and the settings of the merges themselves, a mistake when neither side is a checkpoint: those of the options
# that shape the output (output_options.py: each says how verify treats it), and the run's --budget.
RUN_SETTINGS = {"budget_bytes": "--budget"}


@dataclass(frozen=True, kw_only=True)
class CheckpointSide:
    """A side of a verify that is a training checkpoint, and how to read it (merge's input options)."""

    role: str  # "merged" or "reference": the user's name for the side
    spec: InputSpec
    averaging: AverageOptions = field(default_factory=AverageOptions)  # --merged's, with several

    def discover(self) -> disc.Discovery:
        """Rank 0: the checkpoint's format, files and config (an average's inputs: each one's), as merge finds them.
        The errors of discovery name merge's flags (--hf-config, --iteration ...): for --reference, their twins."""
        try:
            return discover_spec(self.spec, self.averaging)
        except DistmergeError as err:
            if self.role == "merged":
                raise
            raise type(err)(_reference_flags(str(err))) from None


def _reference_flags(message: str) -> str:
    names = ["format", "hf-config", *(opt.flag.removeprefix("--") for opt, _ in registry.options())]
    return re.sub(rf"(?<![\w-])--({'|'.join(map(re.escape, names))})\b", r"--reference-\1", message)


def checkpoint_side(opts: VerifyOptions, role: str) -> CheckpointSide:
    if role == "merged":
        return CheckpointSide(role=role, spec=opts.merged, averaging=opts.settings.average)
    return CheckpointSide(role=role, spec=opts.reference)


def kinds(opts: VerifyOptions) -> tuple[bool, bool]:
    """Rank 0: is each side (merged, reference) a checkpoint? A folder a format detects is one; for --merged also
    a folder without a model's files, and an average's inputs; a format named for the side (--format,
    --reference-format), a URL or a Source object says so too."""
    check_average(opts.settings.average, len(opts.merged.locations), flag="--merged")
    averaged = len(opts.merged.locations) > 1
    merged = averaged or _is_checkpoint(opts.merged, also_unmarked=True)
    reference = _is_checkpoint(opts.reference, also_unmarked=False)
    if opts.logits and (merged or reference):
        which = f"--merged {opts.merged.named}" if merged else f"--reference {opts.reference.named}"
        raise InputError(f"--logits runs both models, and {which} is a checkpoint: merge it first (merge "
                         "--verify-against runs verify after the merge), then verify the merged folder with --logits")
    _refuse(_given(opts.merged, MERGE_FLAGS) if not merged else [], opts.merged, "--merged")
    _refuse(_given(opts.reference, REFERENCE_FLAGS) if not reference else [], opts.reference, "--reference")
    if not merged and not reference:
        _refuse(_settings_given(opts), opts.merged, "--merged")
    for opt in output_options.given(opts.settings):
        if reference and opt.verify == "merged":
            _refuse_merged_only(opts, opt, merged)
    return merged, reference


def _refuse_merged_only(opts: VerifyOptions, opt: output_options.OutputOption, merged: bool) -> None:
    """An option that shapes only the merge of --merged, compared with a Hugging Face reference (--quantize: FP8
    weights against full precision): the merge of a --reference checkpoint would be shaped by it too (the settings
    apply to every merge in memory). Its declaration's words."""
    said = opt.refusals["checkpoint" if merged else "model"]
    raise InputError(said.format(merged=source.name_of(opts.merged.location),
                                 reference=source.name_of(opts.reference.location)))


def _is_checkpoint(spec: InputSpec, *, also_unmarked: bool) -> bool:
    path = spec.location
    if not isinstance(path, Path):  # a URL or a Source: read through its source, as merge reads it
        return True
    src = source.of(path)  # the folder as it is, or as the nodes joined it (engine/nodes.py)
    if not src.is_dir(path):
        return False
    return spec.format != "auto" or registry.detect(path) is not None or (
        also_unmarked and not any(fnmatch.fnmatch(name, mark) for name in src.listdir(path) for mark in MODEL_MARKS))


def _refuse(given: list[str], spec: InputSpec, flag: str) -> None:
    if given:
        raise InputError(f"{flag} {spec.location} is a finished model; {', '.join(given)}: options of the merge of a "
                         f"training checkpoint, leave them out (or pass the checkpoint as {flag})")


def _given(spec: InputSpec, flags: dict[str, str]) -> list[str]:
    default = InputSpec(locations=spec.locations)
    return [flag for name, flag in flags.items() if getattr(spec, name) != getattr(default, name)]


def _settings_given(opts: VerifyOptions) -> list[str]:
    default = OutputSettings()
    run = [flag for name, flag in RUN_SETTINGS.items() if getattr(opts.settings, name) != getattr(default, name)]
    return [opt.flag for opt in output_options.given(opts.settings)] + run

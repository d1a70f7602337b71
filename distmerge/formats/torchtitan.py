"""torchtitan's checkpoints: DCP folders, one per saved step, whose keys are torchtitan's parameter names.

    <dump>/                          the run's dump folder (job.dump_folder)
      checkpoint/                    CheckpointManager's folder (checkpoint.folder)
        step-1000/                   one per save (components/checkpointer/dcp.py: step-{N}); a save counts
          .metadata                  when it has .metadata (or, saved with last_save_in_hf, the Hugging Face
          __0_0.distcp ...           index: already a Hugging Face model, nothing to merge)
      (no config.json: torchtitan writes none; huggingface/ beside the dump, or --hf-config DIR)

A full save holds the model's entries at the top level (older saves: under `model.`) beside
`optimizer.state.*`, `optimizer.param_groups.*`, `lr_scheduler.*`, `dataloader.*` and `train_state.*`,
which are skipped (formats/dcp/keys.py); the last step may be the model-only export, floating tensors cast
to `export_dtype`. The DCP reader does the work. MoE experts are stored stacked on a leading expert axis
(0.3: `moe.routed_experts.inner_experts.w1_EFD` [E, F, D], `w3_EFD`, `w2_EDF`; 0.2: `moe.experts.w1/w2/w3`),
FSDP-sharded over experts or, with more ranks than experts, over the next axis (Shard(1)). Each chunk is
renamed here to one fragment per expert it covers, `<name>.<e>`: the expert axis leads, so each expert's
slice of a chunk is one contiguous block in the file, and no byte moves.
"""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from distmerge import dtypes
from distmerge.errors import InputError
from distmerge.formats import base
from distmerge.formats.base import FormatDefaults, FormatOption, Fragment, Hints, InputFile, OpenedFile, Scan
from distmerge.formats.dcp import folder as dcp_folder
from distmerge.formats.dcp.folder import METADATA, DcpFormat
from distmerge.formats.dcp.keys import EMA_KEY, WRAPPER, model_names
from distmerge.input.source import Source

STEP_DIR = re.compile(r"^step-(\d+)$")
CHECKPOINT_DIR = "checkpoint"  # CheckpointManager's default folder, inside the dump folder
HF_INDEX = "model.safetensors.index.json"
# Stacked expert tensors, both generations: the leading axis numbers the experts.
STACKED = re.compile(r"^(?:mtp_)?layers\.\d+\.moe\.(?:routed_experts\.inner_experts\.w[123]_E[DF]{2}|experts\.w[123])$")
# Names only torchtitan's models use (Hugging Face: model.layers.*, Megatron: decoder.layers.*).
OWN_NAMES = re.compile(r"^(?:tok_embeddings\.weight|(?:mtp_)?layers\.\d+\.(?:attention|feed_forward|moe)\.)")


def _step(text: str) -> int:
    m = re.fullmatch(r"(?:step-)?(\d+)", text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a step: {text!r} (a number such as 1000, or step-1000)")
    return int(m[1])


STEP = FormatOption(picks_save=True, flag="--step", dest="step", metavar="N", parse=_step,
                    help="torchtitan: the checkpoint/step-N to merge (default: the highest)")


class TorchtitanFormat(FormatDefaults):
    name = "torchtitan"
    order = 35  # before dcp: a torchtitan step is a DCP folder too
    help = "torchtitan dump/checkpoint/step-N DCP folders"
    options = (STEP, EMA_KEY)

    def detect(self, source: Source) -> bool:
        try:  # what cannot be read is not claimed: the DCP format, asked next, reports it
            step = step_dir(source, source.root, None)
            return _is_hf(source, step) or any(OWN_NAMES.match(n) for n in own_names(source, step)[0])
        except (InputError, OSError):
            return False

    def scan(self, source: Source, options: Mapping[str, Any]) -> Scan:
        step = step_dir(source, source.root, options.get(STEP.dest))
        if _is_hf(source, step):
            raise InputError(f"{step} is already a Hugging Face model ({HF_INDEX}, torchtitan's last_save_in_hf): "
                             "load it with from_pretrained; there is nothing to merge")
        wrapped = own_names(source, step)[1]
        inner = DcpFormat().scan(source.at(step), {k: v for k, v in options.items() if k == EMA_KEY.dest})
        notes = (f"torchtitan checkpoint {step.name}", *inner.notes)
        chunks = inner.state
        if wrapped:  # a model-only save under a `model.` wrapper
            chunks = replace(chunks, names=tuple(n.removeprefix(WRAPPER) for n in chunks.names))
        return replace(inner, format=self.name, hf_dir=hf_dir_near(source, step), notes=notes,
                       hints=Hints(naming="torchtitan"), state=chunks)

    def open(self, source: Source, scan: Scan, file: InputFile) -> OpenedFile:
        opened = DcpFormat().open(source, scan, file)
        stacked = sum(frag.lengths[0] for frag in opened.fragments if STACKED.match(frag.name))
        opened.fragments = [piece for frag in opened.fragments for piece in per_expert(frag)]
        if stacked:
            opened.layout["stacked experts: one expert's slice of a chunk"] = stacked
        return opened

    def explain(self, source: Source) -> str | None:
        root = source.root
        folder = root / CHECKPOINT_DIR if source.is_dir(root / CHECKPOINT_DIR) else root
        if not STEP_DIR.match(root.name) and any(STEP_DIR.match(n) for n in source.listdir(folder)):
            steps = saved_steps(source, folder)
            if not steps:
                return f"{folder} has step-N folders but none with .metadata: is the save complete?"
            try:  # a .metadata that cannot be read (a link out, a bomb) is the first thing to fix
                own_names(source, folder / f"step-{max(steps)}")
            except InputError as err:
                return str(err)
            return (f"{folder}/step-{max(steps)} does not use torchtitan's names: pass the step folder itself "
                    "(--format dcp)")
        return None


def step_dir(src: Source, root: Path, step: int | None) -> Path:
    """The step folder to merge: `root` itself, or --step's (default: the highest) under root or root/checkpoint."""
    if src.is_file(root / METADATA) or (STEP_DIR.match(root.name) and _is_hf(src, root)):  # a step folder itself
        if step is not None and not (STEP_DIR.match(root.name) and step == int(STEP_DIR.match(root.name)[1])):
            raise InputError(f"--step {step}: {root} is one save already; pass the checkpoint folder above it "
                             "to choose a step")
        return root
    folder = root / CHECKPOINT_DIR if src.is_dir(root / CHECKPOINT_DIR) else root
    steps = saved_steps(src, folder)
    if not steps:
        raise InputError(f"{folder} holds no torchtitan step-N folder with .metadata")
    if step is None:
        return folder / f"step-{max(steps)}"
    if step not in steps:
        found = ", ".join(f"step-{s}" for s in sorted(steps))
        raise InputError(f"{folder} has no step-{step} (steps found: {found}); pass one of them with --step")
    return folder / f"step-{step}"


def saved_steps(src: Source, folder: Path) -> list[int]:
    """Steps whose folder holds a finished save (torchtitan's own rule: .metadata, or the HF index)."""
    steps = []
    for name in src.listdir(folder):
        m = STEP_DIR.match(name)
        if m and (src.is_file(folder / name / METADATA) or _is_hf(src, folder / name)):
            steps.append(int(m[1]))
    return steps


def _is_hf(src: Source, step: Path) -> bool:
    return src.is_file(step / HF_INDEX) and not src.is_file(step / METADATA)


def own_names(src: Source, step: Path) -> tuple[list[str], bool]:
    """The model's names, and whether a `model.` wrapper was left on them: dcp/keys.py strips it from full saves
    (the other groups give it away) but not from a model-only save, whose torchtitan names do."""
    md = dcp_folder.load_metadata(src, step)
    names = list(model_names(sorted(md.fqns), str(step)).values())
    if all(n.startswith(WRAPPER) for n in names) and any(OWN_NAMES.match(n.removeprefix(WRAPPER)) for n in names):
        return [n.removeprefix(WRAPPER) for n in names], True
    return names, False


def hf_dir_near(src: Source, step: Path) -> str | None:
    """huggingface/config.json in the step folder, the checkpoint folder or the dump folder (torchtitan writes
    none; users put the config of hf_assets_path there, or pass --hf-config)."""
    return base.config_dir(src, (step, step.parent, step.parent.parent))


def per_expert(frag: Fragment) -> list[Fragment]:
    """A chunk of a stacked expert tensor -> one fragment per expert it covers, named `<name>.<e>`."""
    if not STACKED.match(frag.name) or len(frag.global_shape) != 3:
        return [frag]
    stride = math.prod(frag.lengths[1:]) * dtypes.itemsize(frag.dtype)
    return [Fragment(
        name=f"{frag.name}.{expert}", dtype=frag.dtype, global_shape=frag.global_shape[1:],
        offsets=frag.offsets[1:], lengths=frag.lengths[1:], file_index=frag.file_index, key=frag.key,
        byte_offset=frag.byte_offset + k * stride if frag.byte_offset >= 0 else -1,
    ) for k, expert in enumerate(range(frag.offsets[0], frag.offsets[0] + frag.lengths[0]))]

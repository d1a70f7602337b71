"""DeepSpeed checkpoint folders as trainers leave them, and which files of a save hold what.

    ckpt/                              engine.save_checkpoint(ckpt): the folder holding `latest`
      latest                           the tag of the last save ("global_step2", no newline)
      global_step2/                    the tag folder: one save
        mp_rank_00_model_states.pt                         stages 0-2: the whole 16-bit module, param_shapes
        zero_pp_rank_{r}_mp_rank_00_model_states.pt        stage 3: one per data-parallel rank
        {bf16_|fp16_|}zero_pp_rank_{r}_mp_rank_00_optim_states.pt   one per data-parallel rank: the fp32
                                                           master partition and the optimizer moments
      zero_to_fp32.py                  DeepSpeed's own converter, copied beside the save
    HF Trainer (TRL, LLaMA-Factory):   output/checkpoint-N/ holds `latest`, global_stepN/, config.json,
                                       tokenizer, generation config (and adapter_config.json for PEFT)
    OpenRLHF:                          ckpt/_actor/ holds `latest` and global_stepN/ (config: --hf-config)
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from distmerge.errors import InputError, LayoutError
from distmerge.formats import copies
from distmerge.formats.base import FormatOption, config_dir
from distmerge.input import tree
from distmerge.input.source import Source

LATEST = "latest"
MODEL_STATES = re.compile(r"^(?:zero_pp_rank_(\d+)_)?mp_rank_(\d{2})_model_states\.pt$")
OPTIM_STATES = re.compile(r"^(?:bf16_|fp16_)?zero_pp_rank_(\d+)_mp_rank_(\d{2})_optim_states\.pt$")
EXPERT_FILES = re.compile(r"^expp_rank_\d+_mp_rank_\d+_")  # DeepSpeed-MoE expert-parallel files
TRAINER_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")
HF_DIRS = ("huggingface", "hf_config_and_tokenizer")
# What a Trainer checkpoint folder (also the config folder) holds besides the model's own files.
TRAINER_FILES = (LATEST, "zero_to_fp32.py", "zero_to_torch.py", "trainer_state.json")

def _choice(value: str) -> str:
    import argparse

    if value not in ("masters", "module"):
        raise argparse.ArgumentTypeError(f"--weights takes masters or module, not {value!r}")
    return value


TAG = FormatOption(picks_save=True, flag="--tag", dest="tag", metavar="TAG",
                   help="DeepSpeed: the save to merge, a tag folder such as global_step1000 (default: the one "
                        "named in `latest`)")
WEIGHTS = FormatOption(flag="--weights", dest="weights", metavar="masters|module", parse=_choice,
                       help="DeepSpeed: the fp32 master weights from the optimizer files (default, what "
                            "zero_to_fp32 gives) or the 16-bit module weights (stages 0-2, no optimizer file read)")


def holds_save(src: Source, folder: Path) -> bool:
    return src.is_dir(folder) and any(MODEL_STATES.match(n) for n in src.listdir(folder))


def tags(src: Source, root: Path) -> list[str]:
    return [n for n in src.listdir(root) if holds_save(src, root / n)]


def looks_like(src: Source, root: Path) -> bool:
    return holds_save(src, root) or src.is_file(root / LATEST) or bool(tags(src, root))


def tag_dir(src: Source, root: Path, options: Mapping[str, Any]) -> Path:
    """The folder of the save to merge: the input itself, --tag's, or the one `latest` names."""
    if holds_save(src, root):
        return root
    tag = options.get(TAG.dest)
    if tag is None:
        if not src.is_file(root / LATEST):
            found = ", ".join(tags(src, root)) or "none"
            raise InputError(f"{root} has no `latest` file: pass --tag (tags found: {found})")
        tag = src.read_text(root / LATEST, tree.TRACKER_CAP, "DeepSpeed `latest` tag file").strip()
    if "/" in tag or tag in ("", ".", "..") or not holds_save(src, root / tag):
        found = ", ".join(tags(src, root)) or "none"
        raise InputError(f"{root} has no save {tag!r} (tags found: {found}); pass --tag with one of them")
    src.folder(root / tag)  # a tag folder that links out is refused before it is read
    return root / tag


def check_own_files(src: Source, save: Path, models: list[str], optims: list[str]) -> None:
    """Each rank's file is its own, not a copy of or a link to another rank's (which would give that rank's
    partition twice and lose this one's). A renamed one is refused when opened (archive_name); one renamed
    and relabelled inside by its tensor bytes: the optimizer files hold each rank's own partition of the
    fp32 masters, never equal on two ranks (copies.payload_twin; model states may be: buffers only)."""
    if copy := copies.first_copy(src, [save / p for p in models + optims]):
        raise LayoutError(f"{save}: {copy[1].name} is the same file as {copy[0].name} (a copy or a link): each "
                          "data-parallel rank's file must be the one it saved; restore the original files")
    if twin := copies.payload_twin(src, [save / p for p in optims]):
        raise LayoutError(f"{save}: {twin[1].name} holds the same tensor bytes as {twin[0].name}, record for record "
                          "(whatever its names say): a copy of another rank's file; each data-parallel rank's file "
                          "must be the one it saved; restore the original files")


def partition_owner(recorded: dict, layout_of: Callable[[int], dict], world: int) -> int | None:
    """The data-parallel rank whose partition a file's own record (param_slice_mappings: name -> (start,
    numel) in the partition) describes, or None: tells a file renamed to another rank's name."""
    return next((r for r in range(world) if layout_of(r) == recorded), None)


def hf_dir_near(src: Source, save: Path, root: Path) -> str | None:
    """config.json: in the folder passed (HF Trainer's checkpoint-N), a huggingface/ folder there, or beside."""
    return config_dir(src, dict.fromkeys((root, save.parent, root.parent)), ("", *HF_DIRS))


def explain(src: Source) -> str | None:
    """The Trainer's output folder (checkpoint-N inside), or a folder of DeepSpeed MoE files."""
    root = src.root
    found = sorted((n for n in src.listdir(root) if TRAINER_CHECKPOINT.match(n) and looks_like(src, root / n)),
                   key=lambda n: int(n.split("-")[1]))
    if found:
        return f"{root} holds Hugging Face Trainer checkpoints: pass one of them, e.g. {root / found[-1]}"
    return None

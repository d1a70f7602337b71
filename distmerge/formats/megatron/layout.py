"""Megatron-LM checkpoint facts shared by the legacy (`mp_rank_*`) and torch_dist formats, as data.

    ckpt/                                   (Megatron-LM training/checkpointing.py)
      latest_checkpointed_iteration.txt     "1000" or "release"
      iter_0001000/ | release/              one folder per saved iteration
        mp_rank_{tp:02d}[_{pp:03d}][_{ep:03d}]/model_optim_rng.pt     legacy (--ckpt-format torch)
        metadata.json, common.pt, .metadata, __R_k.distcp             torch_dist (dist_checkpointing)
    verl:  actor/dist_ckpt/ (+ actor/huggingface/), newer actor/model/dist_ckpt/ (+ model/huggingface/);
           older verl saves model.pt instead of model_optim_rng.pt in each mp_rank_* folder.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from distmerge.errors import InputError
from distmerge.formats.base import FormatOption, config_dir
from distmerge.input import tree
from distmerge.input.source import Source

TRACKER = "latest_checkpointed_iteration.txt"
ITERATION_DIR = re.compile(r"^iter_(\d{7})$")
RANK_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?$")
MODEL_FILES = ("model_optim_rng.pt", "model.pt")
DIST_MARKER = "metadata.json"
# Where verl puts the data folder of a Megatron checkpoint, relative to the folder users pass.
NESTED = ("dist_ckpt", "model/dist_ckpt")
HF_DIRS = ("huggingface", "hf_config_and_tokenizer")

# Tensor-parallel split dimension, by parameter suffix: ColumnParallelLinear and VocabParallelEmbedding
# split dim 0, RowParallelLinear dim 1 (megatron/core/tensor_parallel/layers.py). Anything not listed
# (norms, router, row-parallel biases, q/k layernorm) is replicated on every TP rank.
TP_SPLIT_DIMS = (
    ("embedding.word_embeddings.weight", 0),
    ("output_layer.weight", 0),
    (".linear_qkv.weight", 0),
    (".linear_qkv.bias", 0),
    (".linear_fc1.weight", 0),
    (".linear_fc1.bias", 0),
    (".linear_proj.weight", 1),
    (".linear_fc2.weight", 1),
    # multi-latent attention (transformer/multi_latent_attention.py): the up projections are column-parallel
    (".linear_q_proj.weight", 0),
    (".linear_q_up_proj.weight", 0),
    (".linear_kv_up_proj.weight", 0),
    # multi-token prediction (transformer/multi_token_prediction.py): eh_proj is column-parallel; the block's
    # transformer layer splits as the decoder's layers do (the suffixes above)
    (".eh_proj.weight", 0),
)
# MLA's down projections (hidden -> latent): the local spec builds them as ColumnParallelLinear (split on dim 0;
# the attention gathers their output), the Transformer Engine spec as TELinear(parallel_mode="duplicated"), a
# full copy on every TP rank. A layer built with TE fuses kv_layernorm into linear_kv_up_proj (TE_MLA_MARK).
MLA_DOWN = (".linear_q_down_proj.weight", ".linear_kv_down_proj.weight")
TE_MLA_MARK = ".self_attention.linear_kv_up_proj.layer_norm_weight"
# verl's critic replaces the output layer with a plain Linear(hidden, 1) (LinearForLastLayer): one row, a full
# copy on every TP rank. A vocabulary-parallel output layer never has one row per rank (the vocabulary is padded
# to a multiple of 128 x TP).
VALUE_HEAD = "output_layer.weight"
# Grouped-GEMM experts name each expert's weight with a suffix number (TEGroupedMLP: linear_fc1.weight3).
GROUPED_EXPERT = re.compile(r"^(.*\.mlp\.experts\.linear_fc[12]\.(?:weight|bias))(\d+)$")
SEQUENTIAL_EXPERT = re.compile(r"^(.*\.mlp\.experts\.local_experts\.)(\d+)(\..*)$")
LAYER = re.compile(r"^(.*?decoder\.layers\.)(\d+)(\..*)$")


def _iteration(text: str) -> str:
    if text != "release" and not text.isdigit():
        raise argparse.ArgumentTypeError(f"not an iteration: {text!r} (a number such as 1000, or release)")
    return text


ITERATION = FormatOption(
    picks_save=True,
    flag="--iteration", dest="iteration", metavar="N", parse=_iteration,
    help="Megatron: the save to merge, a number or 'release' (default: the one named in "
         "latest_checkpointed_iteration.txt)",
)


def save_dir(src: Source, root: Path, options: Mapping[str, Any]) -> Path:
    """The folder of the save to merge: --iteration's, else the latest."""
    iteration = options.get(ITERATION.dest)
    save = iteration_dir(src, root, iteration) if iteration is not None else latest_dir(src, root)
    src.folder(save)  # a linked iter_N/ that leads out is refused before anything is read
    return save


def explain(src: Source) -> str | None:
    root = src.root
    if RANK_DIR.match(root.name):
        return (f"{root} is one rank's folder of a Megatron save: pass the folder that holds the mp_rank_* "
                "folders (or the checkpoint folder above it)")
    return None


def tp_split_dim(name: str, local_shape: tuple[int, ...] = (), te_mla: bool = False) -> int | None:
    """Split dimension of a parameter (grouped expert suffix numbers ignored), None when replicated.
    `te_mla`: the file's MLA layers were built with Transformer Engine (their down projections are copies)."""
    m = GROUPED_EXPERT.match(name)
    base = m[1] if m else name
    if base.endswith(MLA_DOWN):
        return None if te_mla else 0
    if base == VALUE_HEAD and local_shape[:1] == (1,):
        return None
    return next((dim for suffix, dim in TP_SPLIT_DIMS if base.endswith(suffix)), None)


def is_expert(name: str) -> bool:
    return ".mlp.experts." in name


def expert_number(name: str) -> int | None:
    m = SEQUENTIAL_EXPERT.match(name) or GROUPED_EXPERT.match(name)
    return None if m is None else int(m[2])


def renumber(name: str, layer_offset: int, expert_offset: int) -> str:
    """Local layer and expert numbers -> global ones."""
    if (m := LAYER.match(name)) and layer_offset:
        name = f"{m[1]}{int(m[2]) + layer_offset}{m[3]}"
    if expert_offset:
        if m := SEQUENTIAL_EXPERT.match(name):
            name = f"{m[1]}{int(m[2]) + expert_offset}{m[3]}"
        elif m := GROUPED_EXPERT.match(name):
            name = f"{m[1]}{int(m[2]) + expert_offset}"
    return name


def layer_number(name: str) -> int | None:
    m = LAYER.match(name)
    return None if m is None else int(m[2])


def iteration_dir(src: Source, root: Path, iteration: int | str) -> Path:
    """`--iteration N` (or `release`): the folder of that save under a Megatron checkpoint folder."""
    base = data_root(src, root)
    name = "release" if str(iteration) == "release" else f"iter_{int(iteration):07d}"
    if not src.is_dir(base / name):
        found = ", ".join(saved_iterations(src, base)) or "none"
        raise InputError(f"{base} has no {name}/ (iterations found: {found})")
    return base / name


def saved_iterations(src: Source, base: Path) -> list[str]:
    return [n for n in src.listdir(base) if src.is_dir(base / n) and (ITERATION_DIR.match(n) or n == "release")]


def data_root(src: Source, root: Path) -> Path:
    """The folder that holds the checkpoint: the input itself, or verl's dist_ckpt/ inside it."""
    for nested in NESTED:
        if src.is_dir(root / nested):
            return root / nested
    return root


def latest_dir(src: Source, root: Path) -> Path:
    """The folder with the files of the save to merge: the input itself when it holds them, else the
    iteration named by latest_checkpointed_iteration.txt."""
    base = data_root(src, root)
    if holds_save(src, base):
        return base
    tracker = base / TRACKER
    if not src.is_file(tracker):
        found = saved_iterations(src, base)
        hint = f"pass --iteration N (found {', '.join(found)})" if found else "pass the folder of one save"
        raise InputError(f"{base} has no {TRACKER}: {hint}")
    text = src.read_text(tracker, tree.TRACKER_CAP, "Megatron iteration tracker").strip()
    if text != "release" and not text.isdigit():
        raise InputError(f"{tracker} holds {text[:40]!r}, not an iteration number or 'release'")
    return iteration_dir(src, base, text)


def holds_save(src: Source, folder: Path) -> bool:
    return src.is_file(folder / DIST_MARKER) or any(RANK_DIR.match(n) for n in src.listdir(folder)
                                                    if src.is_dir(folder / n))


def looks_like(src: Source) -> Path | None:
    """A save folder that shows which Megatron layout the input has (the one to merge when it can be told;
    otherwise any saved iteration, and scan() then explains what is wrong), or None."""
    try:
        return latest_dir(src, src.root)
    except (InputError, OSError):
        base = data_root(src, src.root)
        found = saved_iterations(src, base) if src.is_dir(base) else []
        return base / found[-1] if found else None


def hf_dir_near(src: Source, save: Path, root: Path) -> str | None:
    """config.json's folder: next to the save, or up to the folder the user passed (and its parent)."""
    folders = [save, *save.parents]
    stop = folders.index(root.parent) + 1 if root.parent in folders else 3
    return config_dir(src, folders[:stop], HF_DIRS)

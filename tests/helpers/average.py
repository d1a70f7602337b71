"""Averages as the formula gives them, and the inputs of averaging merges (test_average*.py, test_verify_average.py,
test_docs_examples.py)."""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import torch
from safetensors.torch import load_file

from tests.conftest import reference_dir


def average(refs: list[dict[str, torch.Tensor]], weights: list[float] | None = None,
            dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The formula, in torch float64, over the reference state dicts; integer and bool tensors as they are."""
    weights = weights if weights is not None else [1 / len(refs)] * len(refs)
    out = {}
    for name, first in refs[0].items():
        if not first.is_floating_point():
            out[name] = first
            continue
        acc = torch.zeros(first.shape, dtype=torch.float64)
        for w, ref in zip(weights, refs, strict=True):
            acc += w * ref[name].double()
        out[name] = acc.to(dtype or first.dtype)
    return out


def inputs(*ckpts: Path) -> list[str]:
    return [a for c in ckpts for a in ("--input", str(c))]


def dcp_save(tensors: dict, folder: Path, config_of: Path) -> Path:
    """A real dcp.save folder (one process) of `tensors`, with the config folder of the checkpoint `config_of`."""
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save(tensors, checkpoint_id=str(folder))
    shutil.copytree(config_of / "huggingface", folder / "huggingface")
    return folder


def ckpt(spec: str, request) -> Path:
    family, case = spec.split(":")
    return request.getfixturevalue(f"{family}_ckpts")[case]


def ema_save(dcp_ckpts, folder: Path) -> tuple[Path, dict, dict]:
    """A dcp.save of a model and two EMA copies of every tensor but the final norm (torchtitan's EMA tracks what
    requires grad: a frozen tensor has no copy), as torchtitan's CheckpointManager flattens its `ema` state."""
    ckpt = dcp_ckpts["dcp_llama_w2"]
    live = load_file(reference_dir(ckpt) / "model.safetensors")
    copy = {k: v * 0.5 for k, v in live.items() if k != "model.norm.weight"}
    ema = {k: {"ema_params": {"decay_0p999": v, "decay_0p9": v * 0.5}} for k, v in copy.items()}
    return dcp_save({**live, "ema": {"state": ema}}, folder, ckpt), live, copy

"""A Hugging Face `TrainerCallback` that merges the Trainer's sharded checkpoint into a Hugging Face folder in the
training processes themselves, once the Trainer has saved it on every rank (docs/api.md, "Hugging Face Trainer"):

    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[DistmergeCallback("merged/")])

Imported by the training script only (transformers is loaded there already); nothing on the merge path imports it.

What the Trainer's `checkpoint-N/` holds decides what is merged (SAVES, first match wins):

    DeepSpeed, any ZeRO stage            latest + global_stepN/            checkpoint-N itself: its config.json,
                                                                           tokenizer and generation config too
    accelerate FSDP, SHARDED_STATE_DICT  pytorch_model_fsdp_0/.metadata    that DCP folder, with the model's config
                                                                           (written for the merge, then removed)
    a full save (FSDP FULL_STATE_DICT)   model.safetensors[.index.json]    nothing: it is a Hugging Face model already
"""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from distmerge.api import merge
from distmerge.errors import InputError, OutputError
from distmerge.results import MergeResult

log = logging.getLogger("distmerge")


@dataclass(frozen=True, kw_only=True)
class Save:
    """One kind of Trainer save: the file that says so, and what of checkpoint-N distmerge merges."""

    kind: str
    marker: str  # relative to checkpoint-N
    input: str | None  # relative to checkpoint-N; None: nothing to merge
    needs_config: bool = False  # the save holds no config.json: the model's is written for the merge


SAVES = (
    # engine.save_checkpoint(checkpoint-N): `latest` names the global_stepN/ tag (deepspeed/runtime/engine.py)
    Save(kind="DeepSpeed ZeRO", marker="latest", input="."),
    # accelerate.utils.fsdp_utils.save_fsdp_model: dcp.save({"model": ...}) into pytorch_model_fsdp_0/
    Save(kind="accelerate FSDP (sharded, DCP)", marker="pytorch_model_fsdp_0/.metadata",
         input="pytorch_model_fsdp_0", needs_config=True),
    Save(kind="a Hugging Face model", marker="model.safetensors.index.json", input=None),
    Save(kind="a Hugging Face model", marker="model.safetensors", input=None),
)


def which_save(checkpoint: Path) -> Save:
    for save in SAVES:
        if (checkpoint / save.marker).exists():
            return save
    raise InputError(f"{checkpoint} holds no DeepSpeed ZeRO save (latest) and no accelerate FSDP sharded save "
                     "(pytorch_model_fsdp_0/): DistmergeCallback merges those; merge other saves with distmerge.merge")


class DistmergeCallback(TrainerCallback):
    """Merge the checkpoint of the last step (`every_save=True`: of every save) into `output`, a Hugging Face folder.

    `output`: with every_save, a pattern with `{step}` (e.g. "merged/step-{step}"); it may hold `{step}` anyway.
    `options`: those of distmerge.merge (dtype, max_shard_size, budget, overwrite, progress, ...). Every rank of the
    Trainer runs the merge over the job's group (with NCCL: fragments on the GPU, a gloo side group of the API's
    for the small messages). `results`: step ->
    MergeResult. A failed merge raises its DistmergeError on every rank, and training stops there.
    """

    def __init__(self, output: str | os.PathLike, *, every_save: bool = False, **options: Any) -> None:
        self.output = str(output)
        if every_save and "{step}" not in self.output:
            raise InputError(f"DistmergeCallback(every_save=True): output {self.output!r} needs a {{step}} in it, "
                             "or every save would be merged into the same folder")
        if {"input", "output", "group"} & set(options):
            raise InputError("DistmergeCallback: the callback sets input, output and group itself")
        self.every_save = every_save
        self.options = options
        self.results: dict[int, MergeResult] = {}
        self._saved: int | None = None  # the step of the newest save seen

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._saved = state.global_step
        if self.every_save or state.global_step >= state.max_steps:
            self._merge(args, state.global_step, kwargs.get("model"), kwargs.get("processing_class"))

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # Stopped before max_steps (early stopping): the last step's save, if there was one, is merged now.
        if self._saved == state.global_step and state.global_step not in self.results:
            self._merge(args, state.global_step, kwargs.get("model"), kwargs.get("processing_class"))

    def _merge(self, args: Any, step: int, model: Any, processing_class: Any) -> None:
        checkpoint = Path(args.output_dir) / f"checkpoint-{step}"
        group = None  # the job's default group; with NCCL the API adds its own gloo side group (Comm.borrow)
        _barrier(group)  # every rank has finished the Trainer's save (rank 0 writes config.json, latest last)
        save = which_save(checkpoint)
        if save.input is None:
            log.info("distmerge: %s is %s already; nothing to merge", checkpoint, save.kind)
            return
        output = Path(self.output.replace("{step}", str(step)))
        options = dict(self.options)
        config_dir = None
        if save.needs_config and options.get("hf_config") is None:
            config_dir = output.parent / f".{output.name}.distmerge-config"
            _write_config(config_dir, model, processing_class, group)
            options["hf_config"] = config_dir
        try:
            result = merge(checkpoint / save.input, output, group=group, **options)
        finally:
            if config_dir is not None:
                _barrier(group)
                if _rank(group) == 0:
                    shutil.rmtree(config_dir, ignore_errors=True)
        log.info("distmerge: merged %s (%s) into %s: %d tensors", checkpoint, save.kind, output, result.tensors)
        self.results[step] = result


def _rank(group: Any) -> int:
    import torch.distributed as dist

    return dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0


def _barrier(group: Any) -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier(group=group)


def _write_config(folder: Path, model: Any, processing_class: Any, group: Any) -> None:
    """What the Trainer's own full save writes beside the weights (config, generation config, tokenizer or
    processor), into `folder`, by rank 0; the other ranks wait for it, and raise what it raised."""
    if model is None:
        raise InputError("DistmergeCallback: the Trainer passed no model, so its config is unknown: pass "
                         "hf_config=DIR with the model's config.json")
    failed = [None]
    if _rank(group) == 0:
        try:
            base = model.get_base_model() if hasattr(model, "get_base_model") else model  # PEFT: the base's
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir(parents=True)
            base.config.save_pretrained(folder)
            if getattr(base, "generation_config", None) is not None and base.can_generate():
                base.generation_config.save_pretrained(folder)
            if processing_class is not None:
                processing_class.save_pretrained(folder)
        except OSError as err:
            failed[0] = f"{type(err).__name__}: {err}"
    _broadcast(failed, group)
    if failed[0]:
        raise OutputError(f"DistmergeCallback could not write the model's config into {folder} ({failed[0]}): "
                          "pass hf_config=DIR with the model's config.json")


def _broadcast(objects: list[Any], group: Any) -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.broadcast_object_list(objects, src=dist.get_global_rank(group, 0) if group is not None else 0,
                                   group=group)

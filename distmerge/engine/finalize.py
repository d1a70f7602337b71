"""Finalize (rank 0, after every output file is committed): config, tokenizer and generation config, custom code,
and last the index, the commit marker of a finished merge. Everything goes through the output store."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

from distmerge import dtypes
from distmerge.engine.plan import Plan
from distmerge.engine.resume import write_manifest
from distmerge.input import tree
from distmerge.input.source import Source
from distmerge.output.names import INDEX_NAME, MODEL_FILES
from distmerge.output.store import Store

# Files of huggingface/ that are weights or indexes, never copied (the merge writes its own).
SKIP_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".index.json")


def main_dtype(plan: Plan) -> str | None:
    """The floating dtype holding most bytes: what config.json should announce (of those it can: dtypes.announced)."""
    by_bytes: Counter[str] = Counter()
    for f in plan.model_files:
        for t in f.targets:
            if dtypes.announced(t.dtype):
                by_bytes[t.dtype] += t.nbytes
    return by_bytes.most_common(1)[0][0] if by_bytes else None


def announced_dtype(plan: Plan) -> str | None:
    """The dtype config.json names: the main one, unless a value made late says the model loads in another (a
    quantized model whose loader decodes its weights into a dtype of its own: a plain from_pretrained must run it)."""
    dtype = main_dtype(plan)
    for value in plan.config_later.values():
        dtype = value.dtype(dtype)
    return dtype


def write_config(out: Store, config: dict[str, Any], dtype: str | None) -> None:
    """config.json with the dtype updated: transformers 5 reads `dtype`, 4.x `torch_dtype`."""
    config = dict(config)
    if dtype:
        keys = [k for k in ("dtype", "torch_dtype") if k in config] or ["torch_dtype"]
        for key in keys:
            config[key] = dtypes.hf_dtype_name(dtype)
    out.write_small("config.json", (json.dumps(config, indent=2, sort_keys=True) + "\n").encode())


def copy_hf_files(config: Source, out: Store, skip: tuple[str, ...] = ()) -> list[str]:
    """Tokenizer, generation config, chat template, custom code of the config folder (`config`: a source looking
    at it, discover.config_source): its regular files only, never links, each opened once through the source and
    checked (tree.read_chunks). Inside the input the source opens only what discovery walked, so a config folder
    that leads out of the input is never read. `skip`: what the format knows to be the trainer's own (a Trainer
    checkpoint folder doubles as the config folder)."""
    folder = Path(config.root)
    copied = []
    for name in config.listdir(folder):
        if name == "config.json" or name in skip or name.endswith(SKIP_SUFFIXES):
            continue
        if config.stat(folder / name, follow=False).kind != "file":  # a link, a folder, a FIFO: not copied
            continue
        out.put_stream(name, tree.read_chunks(folder / name, opener=config.open))
        copied.append(name)
    return copied


def remove_strays(out: Store, plan: Plan) -> None:
    """Model files of an earlier, differently split run that --resume left behind."""
    planned = {f.name for f in plan.files}
    for pattern in MODEL_FILES:
        for name in out.list(pattern):
            if name not in planned:
                out.remove(name)


def write_extra_files(out: Store, plan: Plan) -> None:
    """JSON files a family asked for (a LoRA adapter's adapter_config.json)."""
    for rel, content in plan.extra_files.items():
        out.write_small(rel, (json.dumps(content, indent=2, sort_keys=True) + "\n").encode())


def write_index(out: Store, plan: Plan) -> None:
    files = plan.model_files
    weight_map = {t.name: f.name for f in files for t in f.targets}
    total = sum(f.nbytes for f in files)
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    out.write_small(INDEX_NAME, (json.dumps(index, indent=2) + "\n").encode())


def finalize(out: Store, plan: Plan, config: dict[str, Any], hf_source: Source, skip: tuple[str, ...] = ()) \
        -> list[str]:
    """`hf_source`: the config folder, as a source looking at it (discover.config_source)."""
    if not plan.model_files:  # only other groups (a LoRA adapter without its base): no config.json, no index, so
        write_manifest(out, plan)  # nothing looks like a model; the family's JSON (adapter_config.json) comes last
        write_extra_files(out, plan)
        return []
    copied = copy_hf_files(hf_source, out, skip)
    later = {key: value.config() for key, value in plan.config_later.items()}  # made here, on rank 0 only
    write_config(out, {**config, **plan.config_updates, **later}, announced_dtype(plan))
    remove_strays(out, plan)
    write_extra_files(out, plan)
    write_manifest(out, plan)
    write_index(out, plan)  # last: its presence means every file above is complete
    return copied


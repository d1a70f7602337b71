"""The --base-model folder: a Hugging Face model folder whose weights complete a checkpoint that lacks them
(a LoRA-only save: verl's `checkpoint.save_lora_only`, the HF Trainer's DeepSpeed save of a PEFT model).

    BASE/
      config.json
      model.safetensors                                    one file, or
      model.safetensors.index.json + model-0000i-of-0000n.safetensors   the files its weight_map names

Its files join the checkpoint's input files as a second input root (InputFile.root), so the engine reads
them like any other: headers at discovery, each byte once by the rank the file is assigned to, never the
whole model in memory. Tensor names get BASE_MODEL_PREFIX, so they never meet the checkpoint's names.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from distmerge.errors import InputError
from distmerge.formats.base import BASE_MODEL_PREFIX, Fragment, InputFile, OpenedFile, Scan, input_file
from distmerge.formats.safetensors_header import read_header
from distmerge.input.source import Source

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
LAYOUT = "Hugging Face base model file (--base-model)"
INDEX_CAP = 64 * 1024 * 1024  # the index names each tensor once (~100 bytes a tensor): a real one is far smaller


def attach(scan: Scan, src: Source) -> Scan:
    """The scan with the base folder's weight files appended (indices after the checkpoint's own), the folder
    looked at through `src` (its root: the folder as the user named it, nothing walked, its links judged when each
    file is sized; or a folder the nodes' listings joined, engine/nodes.py)."""
    folder = src.root  # resolved by the source: the name each file is opened by on every rank
    names = weight_files(src, folder)
    first = len(scan.files)
    files = tuple(replace(input_file(src, folder, first + i, name), root=str(folder)) for i, name in enumerate(names))
    return replace(scan, files=(*scan.files, *files))  # the family says whether it used them (a note)


def weight_files(src: Source, folder: Path) -> list[str]:
    """The safetensors files of a Hugging Face folder, as save_pretrained writes them; a one-line error else."""
    what = f"--base-model {folder}"
    if not src.is_file(folder / "config.json"):
        raise InputError(f"{what} has no config.json: pass the Hugging Face folder of the base model")
    if src.is_file(folder / INDEX):
        try:
            weight_map = json.loads(src.read_text(folder / INDEX, INDEX_CAP, INDEX))["weight_map"]
            names = sorted(set(weight_map.values()))
        except (ValueError, KeyError, TypeError, AttributeError):
            raise InputError(f"{what}: {INDEX} is not valid JSON with a weight_map") from None
        if missing := [n for n in names if not src.is_file(folder / n)]:
            raise InputError(f"{what}: {missing[0]} named by {INDEX} is missing")
        if bad := [n for n in names if not n.endswith(".safetensors") or "/" in n]:
            raise InputError(f"{what}: {INDEX} names {bad[0]}, not a safetensors file beside it")
        return names
    if src.is_file(folder / SINGLE):
        return [SINGLE]
    raise InputError(f"{what} has neither {SINGLE} nor {INDEX}: save the base model with safetensors "
                     "(save_pretrained's default) and pass that folder")


def open_file(src: Source, file: InputFile) -> OpenedFile:
    """One whole tensor per header entry; the header is checked before any byte is trusted. `src`: the source
    that holds the file (the reader's choice), or the input's, which opens a file of a folder it does not hold as
    the user named it."""
    header = read_header(src, Path(file.root) / file.path)
    opened = OpenedFile(fragments=[], layout={LAYOUT: len(header.entries)})
    for key, entry in header.entries.items():
        opened.fragments.append(Fragment(
            name=BASE_MODEL_PREFIX + key, dtype=entry.dtype, global_shape=entry.shape,
            offsets=(0,) * len(entry.shape), lengths=entry.shape, file_index=file.index, byte_offset=entry.start,
            key=key,
        ))
    return opened

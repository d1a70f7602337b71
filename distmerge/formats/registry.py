"""The registered input formats: detection, --format choices, help text and format options all come from here.

Every format is listed here, one line each (FORMATS): a format module defines its class and registers nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from distmerge.errors import InputError
from distmerge.formats import base_model, fsdp, torchtitan
from distmerge.formats.base import (
    FormatOption,
    Fragment,
    InputFile,
    InputFormat,
    OpenedFile,
    Part,
    Scan,
    input_prefix,
)
from distmerge.formats.dcp import folder as dcp_folder
from distmerge.formats.dcp import hf_writer as dcp_hf_writer
from distmerge.formats.deepspeed import folder as deepspeed_folder
from distmerge.formats.megatron import dist as megatron_dist
from distmerge.formats.megatron import legacy as megatron_legacy
from distmerge.input import source
from distmerge.input.source import Source

# Every input format, in any order: detection tries them in each one's declared `order`.
FORMATS: tuple[type, ...] = (
    fsdp.FsdpFormat,
    dcp_folder.DcpFormat,
    dcp_hf_writer.DcpHfFormat,
    deepspeed_folder.DeepSpeedFormat,
    megatron_dist.MegatronDistFormat,
    megatron_legacy.MegatronLegacyFormat,
    torchtitan.TorchtitanFormat,
)


def _by_name(classes: tuple[type, ...]) -> dict[str, InputFormat]:
    """Make one instance of each format, by its name (two of one name is a bug)."""
    made = [cls() for cls in classes]
    names = [f.name for f in made]
    assert len(set(names)) == len(names), f"two input formats share a name: {sorted(names)}"
    return {f.name: f for f in made}


# Detection, --format, --help and the contract tests read this.
REGISTERED: dict[str, InputFormat] = _by_name(FORMATS)


def all_formats() -> list[InputFormat]:
    """In detection order."""
    return sorted(REGISTERED.values(), key=lambda f: (f.order, f.name))


def get(name: str) -> InputFormat:
    if name not in REGISTERED:
        raise InputError(f"unknown format {name!r}; known: {', '.join(f.name for f in all_formats())}")
    return REGISTERED[name]


def choices() -> list[str]:
    return ["auto", *(f.name for f in all_formats())]


def help_text() -> str:
    described = ", ".join(f"{f.name} ({f.help})" for f in all_formats())
    return f"input layout: auto (default: detected), {described}"


def options() -> list[tuple[FormatOption, list[str]]]:
    """Each format option once, with the formats that take it."""
    found: dict[str, tuple[FormatOption, list[str]]] = {}
    for fmt in all_formats():
        for opt in fmt.options:
            found.setdefault(opt.dest, (opt, []))[1].append(fmt.name)
    return list(found.values())


def detect(where: Source | Path) -> InputFormat | None:
    """The format auto-detection picks for the input (a Source; or a folder: source.looking_at), or None (then
    `pick` explains why)."""
    src = source.looking_at(where)
    return next((fmt for fmt in all_formats() if fmt.detect(src)), None)


def pick(where: Source | Path, requested: str = "auto") -> InputFormat:
    if requested != "auto":
        return get(requested)
    src = source.looking_at(where)
    if found := detect(src):
        return found
    for fmt in all_formats():
        if hint := fmt.explain(src):
            raise InputError(hint)
    root = src.root
    if any(src.is_file(root / name) for name in HF_MODEL_FILES):
        raise InputError(f"{root} is already a Hugging Face model (safetensors weights and their index): "
                         "load it as it is, or pass the training checkpoint it came from")
    if inner := _checkpoint_inside(src):
        raise InputError(f"{root} is not a checkpoint but holds one: pass {inner} ({pick(src.at(inner)).name})")
    listing = src.listdir(root)[:8]
    raise InputError(
        f"{root} is not a checkpoint distmerge recognises (found: {', '.join(listing) or 'nothing'}); "
        f"known formats: {', '.join(f.name for f in all_formats())}"
    )


# What marks a folder distmerge (or save_pretrained) already wrote.
HF_MODEL_FILES = ("model.safetensors.index.json", "model.safetensors", "distmerge.manifest.json")
LOOKED_AT = 64  # subfolders tried when the folder passed is one level too high


def _checkpoint_inside(src: Source) -> Path | None:
    """The one subfolder a format detects (verl's actor/, torchtitan's checkpoint/, a save's parent ...)."""
    folders = [src.root / n for n in src.listdir(src.root) if src.is_dir(src.root / n)][:LOOKED_AT]
    found = [p for p in folders if any(f.detect(src.at(p)) for f in all_formats())]
    return found[-1] if found else None


def check_options(fmt: InputFormat, given: Mapping[str, Any]) -> None:
    """An option for another format is a mistake worth saying (--iteration on an FSDP folder)."""
    takes = {o.dest for o in fmt.options}
    for opt, names in options():
        if opt.dest in given and opt.dest not in takes:
            raise InputError(f"{opt.flag} applies to {', '.join(names)} input; {fmt.name} has no such choice")


# -- a second input root: the --base-model folder, read by the engine beside the checkpoint's own files -------------
def with_base_model(scan: Scan, folder: Source) -> Scan:
    """The scan plus the weight files of a Hugging Face base-model folder (formats/base_model.py), looked at
    through `folder`, a source whose root is the folder."""
    return base_model.attach(scan, folder)


def open_file(fmt: InputFormat, src: Source, scan: Scan, file: InputFile) -> OpenedFile:
    """A file of the checkpoint through its format; a file of the second input root through its reader (both
    opened through the input's source); a file of an average's other input through that input's format, handed
    that input's source (`src` then: the source holding it), its fragments named and numbered in the combined
    scan (input_prefix, Part.first)."""
    part = part_of(scan, file.index)
    if part is not None:
        return _open_part(part, src, file)
    return base_model.open_file(src, file) if file.root else fmt.open(src, scan, file)


def part_of(scan: Scan, file_index: int) -> Part | None:
    """The other input of an average a file of the combined scan belongs to (None: the first input's, or the
    --base-model folder's)."""
    return next((p for p in scan.parts if p.holds(file_index)), None)


def _open_part(part: Part, src: Source, file: InputFile) -> OpenedFile:
    own = replace(file, index=file.index - part.first, root="")
    opened = get(part.scan.format).open(src, part.scan, own)
    prefix = input_prefix(part.index)
    opened.fragments = [Fragment.make(prefix + f.name, f.dtype, f.global_shape, f.offsets, f.lengths, file.index,
                                      f.byte_offset, f.key, f.flat) for f in opened.fragments]
    return opened

"""What an import is asked for and what it answers: the command line (front/import_cli.py) and the API
(api.import_checkpoint) build the one, run.run_import returns the other.

The input and the output are locations as the options table's `location` kind keeps them (options.location): a
folder's Path, or an object-store URL as typed (`s3://bucket/prefix`; a Path would fold it into the folder
`s3:/bucket/prefix`), or a Source or Store object from the API. The input is opened as merge opens its own
(input/source.open_source), the output as merge's (output.open_store).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from distmerge.errors import InputError
from distmerge.importer.plan import Layout


@dataclass(frozen=True, kw_only=True)
class ImportOptions:
    input: Path | str | Any  # a folder, a URL (s3://...), or a Source object
    output: Path | str | Any  # a folder, a URL (s3://...), or a Store object
    layout: Layout
    to: str = "megatron"  # the training layout written: a key of targets.TARGETS
    overwrite: bool = False
    hf_config: Path | None = None  # config.json's folder, for an input that is a training checkpoint (source.py)


@dataclass(frozen=True, kw_only=True)
class ImportResult:
    files: int  # .distcp files written
    tensors: int  # the training layout's tensors
    chunks: int
    nbytes: int  # tensor bytes written
    padded_vocab: int  # the vocabulary's rows as written (Megatron-LM pads them; torchtitan does not)
    seconds: float
    processes: int


def local_folder(location: Any, flag: str) -> Path:
    """`location` as a folder of this machine; one line for a URL or an object (a folder the import reads with the
    local file system: --hf-config's config.json, read by the merge engine's discovery as a Path)."""
    if not isinstance(location, Path):
        shown = getattr(location, "url", location)
        raise InputError(f"{flag} {shown}: config.json's folder is read from this machine's disk: pass a local "
                         "folder (copy config.json out of the bucket)")
    return location

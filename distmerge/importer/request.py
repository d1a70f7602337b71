"""What an import is asked for and what it answers: the command line (front/import_cli.py) and the API
(api.import_checkpoint) build the one, run.run_import returns the other."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from distmerge.importer.plan import Layout


@dataclass(frozen=True, kw_only=True)
class ImportOptions:
    input: Path
    output: Path
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

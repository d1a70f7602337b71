"""Rank 0's first look: input and output checks, format detection, the file listing and the config.

Nothing here reads tensor data. The result is broadcast so every rank plans from the same listing.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from distmerge.errors import ConfigError, InputError, OutputError
from distmerge.formats import registry
from distmerge.formats.base import Scan
from distmerge.output_files import FINISHED, INDEX_NAME, PARTIAL, RECORDS


@dataclass(frozen=True, kw_only=True)
class Discovery:
    scan: Scan
    config: dict[str, Any]
    hf_dir: str


def discover(root: Path, fmt_name: str, hf_config: Path | None, options: Mapping[str, Any]) -> Discovery:
    """Format, files and config of a checked input folder (see check_input). `options` are the format's
    own (formats/base.FormatOption), e.g. the Megatron save to take."""
    fmt = registry.pick(root, fmt_name)
    registry.check_options(fmt, options)
    scan = fmt.scan(root, options)
    hf_dir = Path(hf_config) if hf_config else (Path(scan.hf_dir) if scan.hf_dir else None)
    if hf_dir is None:
        raise ConfigError(
            f"no config.json: {root} has no huggingface/ folder; pass --hf-config DIR with the model's config.json"
        )
    return Discovery(scan=scan, config=read_config(hf_dir), hf_dir=str(hf_dir))


def check_input(input_dir: Path) -> Path:
    root = Path(input_dir).resolve()
    if not root.exists():
        raise InputError(f"input {input_dir} does not exist")
    if not root.is_dir():
        raise InputError(f"input {input_dir} is not a folder: pass the checkpoint folder")
    if not any(root.iterdir()):
        raise InputError(f"input {input_dir} is empty")
    return root


def read_config(hf_dir: Path) -> dict[str, Any]:
    path = hf_dir / "config.json"
    if not path.is_file():
        raise ConfigError(f"{path} does not exist; pass --hf-config DIR with the model's config.json")
    try:
        config = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as err:
        raise ConfigError(f"{path} is not valid JSON ({err}); fix it or pass --hf-config DIR") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{path} is not a JSON object; fix it or pass --hf-config DIR")
    return config


def check_output(output_dir: Path, input_dir: Path, overwrite: bool) -> Path:
    """Refuse outputs that would touch the input or clobber work; never modify anything here."""
    out, src = Path(output_dir).resolve(), Path(input_dir).resolve()
    if out == src or src in out.parents:
        raise OutputError(f"output {output_dir} is inside the input {input_dir}: choose a folder outside it")
    if out.exists() and not out.is_dir():
        raise OutputError(f"output {output_dir} exists and is not a folder")
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise OutputError(
            f"output {output_dir} is not empty: pass --overwrite to replace its model files, or --resume to "
            "finish an interrupted merge"
        )
    return out


def prepare_output(out: Path, keep_finished: bool = False) -> None:
    """Create the folder and remove the old index first, so a stale model never looks done. --overwrite
    also removes earlier model files and their records; --resume keeps them for resume.py to judge."""
    out.mkdir(parents=True, exist_ok=True)
    (out / INDEX_NAME).unlink(missing_ok=True)
    patterns = PARTIAL if keep_finished else PARTIAL + FINISHED
    for pattern in patterns:
        for path in out.glob(pattern):
            path.unlink()
    if not keep_finished:
        shutil.rmtree(out / RECORDS, ignore_errors=True)

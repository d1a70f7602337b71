"""Rank 0's first look: input checks, format detection, the file listing and the config (the output store
checks the output: output/store.py).

Nothing here reads tensor data. The result is broadcast so every rank plans from the same listing.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from distmerge.errors import ConfigError, InputError
from distmerge.formats import registry
from distmerge.formats.base import Scan
from distmerge.input import source, tree
from distmerge.input.nodes import NodesSource
from distmerge.input.source import Source


@dataclass(frozen=True, kw_only=True)
class Discovery:
    scan: Scan
    config: dict[str, Any]
    hf_dir: str


def discover(root: Path | Source, fmt_name: str, hf_config: Path | None, options: Mapping[str, Any],
             base_model: Path | None = None) -> Discovery:
    """Format, files and config of a checked input folder (see check_input; a folder no check walked is read as it
    is) or of a Source. `options` are the format's own (formats/base.FormatOption), e.g. the Megatron save to
    take. `base_model`: a second input root, a Hugging Face folder whose weight files join the input (a LoRA-only
    save's base); its config.json serves when the checkpoint has none."""
    src = source.looking_at(root)
    root = src.root
    scan = scan_input(src, fmt_name, options)
    hf_dir = Path(hf_config) if hf_config else (Path(scan.hf_dir) if scan.hf_dir else None)
    if base_model is not None:
        scan = _with_base_model(scan, Path(base_model))
        if not hf_config and (hf_dir is None or not src.is_file(hf_dir / "config.json")):
            hf_dir = Path(base_model)
    if hf_dir is None:
        raise ConfigError(
            f"no config.json: {root} has no huggingface/ folder; pass --hf-config DIR with the model's config.json"
        )
    config = config_source(hf_dir)
    if not hf_config and src.holds(hf_dir):
        _check_hf_dir(config, hf_dir)
    return Discovery(scan=scan, config=read_config(config), hf_dir=str(hf_dir))


def _with_base_model(scan: Scan, folder: Path) -> Scan:
    """The scan with the base folder's weight files, and the record of them where the nodes' listings of the folder
    were joined (each rank then opens its files by its node's record: input/nodes.py)."""
    src = source.looking_at(folder)  # the folder as it is, or the nodes' joined listing of it
    scan = registry.with_base_model(scan, src)
    if not isinstance(src, NodesSource):
        return scan
    paths = [Path(f.root) / f.path for f in scan.files if f.root == str(src.root)]
    return replace(scan, base_walked=src.record(src.root, paths))


def config_source(hf_dir: Path | str) -> Source:
    """The config folder as a source looking at it (`root` = the folder): the input's source where the folder is
    the input's (inside it, or beside or above it in the same bucket: the format found it there), else the folder
    as it is (--hf-config, --base-model: the user's own). Rank 0, at discovery and at finalize."""
    return source.looking_at(hf_dir)


def scan_input(src: Source, fmt_name: str, options: Mapping[str, Any]) -> Scan:
    """The input's format (detected, or `fmt_name`) and its scan, with the walk's record of its files."""
    fmt = registry.pick(src, fmt_name)
    registry.check_options(fmt, options)
    scan = fmt.scan(src, options)
    paths = [Path(scan.root) / f.path for f in scan.files]
    return replace(scan, walked=src.record(scan.root, paths) if src.tree is not None else None)


def _check_hf_dir(config: Source, hf_dir: Path) -> None:
    """The config folder the format found inside the input is copied from: it must not lead out of it
    (an outside folder is the user's to name, with --hf-config)."""
    try:
        config.folder(hf_dir)
    except InputError:
        raise InputError(f"{hf_dir} leads outside the input folder (or is not a folder): distmerge does not "
                         "follow it; pass --hf-config DIR with the model's config folder if you trust it") from None


def check_input(input_dir: Any) -> Path:
    """The input's source (input/source.py: a folder, `s3://bucket/prefix`, or a Source object), walked once and
    made the input of this merge: later lookups go through that walk. Returns where the formats look."""
    src = source.open_source(input_dir)
    src.walk()
    source.session().use(src)
    return src.root


def read_config(config: Source) -> dict[str, Any]:
    """config.json of the config folder (`config`: a source looking at it, config_source)."""
    path = Path(config.root) / "config.json"
    if not config.is_file(path):
        raise ConfigError(f"{path} does not exist; pass --hf-config DIR with the model's config.json")
    try:
        found = config.read_json(path, tree.CONFIG_CAP, "model config")
    except InputError as err:
        raise ConfigError(f"{err}; or pass --hf-config DIR") from None
    if not isinstance(found, dict):
        raise ConfigError(f"{path} is not a JSON object; fix it or pass --hf-config DIR")
    return found

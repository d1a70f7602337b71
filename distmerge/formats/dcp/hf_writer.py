"""PyTorch's HuggingFaceStorageWriter in distributed mode: each saving rank writes safetensors files of its
own chunks, whose header metadata `DCP_SHARDING_INFO` gives every chunk's offsets in the full tensor.

    ckpt/
      sharded/shard-00001-model-00001-of-00001.safetensors ...   (or the shard files directly in ckpt/)
      huggingface/                                                config.json, tokenizer

There is no `.metadata`: full shapes are the extent of the chunks, found from the headers at discovery.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from distmerge.errors import CorruptInputError, InputError
from distmerge.formats.base import FormatDefaults, Fragment, InputFile, OpenedFile, Scan, input_file
from distmerge.formats.dcp.folder import hf_dir_near
from distmerge.formats.dcp.keys import model_names
from distmerge.formats.safetensors_header import Header, read_header
from distmerge.input.source import Source

SHARD = re.compile(r"^shard-(\d+)-model-\d+-of-\d+\.safetensors$")
INFO_KEY = "DCP_SHARDING_INFO"


def shard_dir(src: Source, root: Path) -> Path:
    return root / "sharded" if src.is_dir(root / "sharded") else root


def sharding_info(path: Path, header: Header) -> dict[str, tuple[int, ...]]:
    try:
        info = json.loads(header.metadata[INFO_KEY])
        return {name: tuple(int(o) for o in info[name]["saved_offsets"]) for name in header.entries}
    except (KeyError, ValueError, TypeError):
        reason = f"no usable {INFO_KEY} in its header (not a distributed HF-writer shard)"
        raise CorruptInputError(f"{path}: {reason}") from None


@dataclass(frozen=True, kw_only=True)
class _State:
    """Found at scan from every header: each model tensor's output name and full shape."""

    names: dict[str, str]
    shapes: dict[str, tuple[int, ...]]


def _rank(path: Path) -> int:
    return int(SHARD.match(path.name)[1]) - 1  # shard numbers count saving ranks from 1


class DcpHfFormat(FormatDefaults):
    name = "dcp-hf"
    order = 50
    help = "shard-*-model-*.safetensors of PyTorch's distributed HuggingFaceStorageWriter"

    def detect(self, source: Source) -> bool:
        folder = shard_dir(source, source.root)
        return source.is_dir(folder) and any(SHARD.match(n) for n in source.listdir(folder))

    def scan(self, source: Source, options: Mapping[str, Any]) -> Scan:
        root = source.root
        folder = shard_dir(source, root)
        paths = [folder / n for n in source.listdir(folder) if SHARD.match(n)]
        extent: dict[str, list[int]] = {}
        for path in paths:
            header = read_header(source, path)
            for name, offsets in sharding_info(path, header).items():
                ends = [o + n for o, n in zip(offsets, header.entries[name].shape, strict=True)]
                extent[name] = [max(a, b) for a, b in zip(extent.get(name, ends), ends, strict=True)]
        names = model_names(sorted(extent), str(root))
        files = tuple(
            input_file(source, root, i, str(p.relative_to(root)), rank=_rank(p))
            for i, p in enumerate(paths)
        )
        if not files:
            raise InputError(f"{root} has no shard-*-model-*.safetensors files")
        return Scan(format=self.name, root=str(root), files=files, hf_dir=hf_dir_near(source, root),
                    world_size=len(files),
                    state=_State(names=names, shapes={n: tuple(extent[n]) for n in names}))

    def open(self, source: Source, scan: Scan, file: InputFile) -> OpenedFile:
        path = Path(scan.root) / file.path
        header = read_header(source, path)
        names, shapes = scan.state.names, scan.state.shapes
        opened = OpenedFile(fragments=[], layout={"HF-writer shard": 0})
        for key, offsets in sharding_info(path, header).items():
            if key not in names:
                opened.skipped.append(key)
                continue
            entry = header.entries[key]
            opened.fragments.append(Fragment(
                name=names[key], dtype=entry.dtype, global_shape=shapes[key], offsets=offsets, lengths=entry.shape,
                file_index=file.index, byte_offset=entry.start, key=key,
            ))
            opened.layout["HF-writer shard"] += 1
        return opened

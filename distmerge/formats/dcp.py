"""torch.distributed.checkpoint folders: torchtitan, accelerate's SHARDED_STATE_DICT, `dcp.save` in user code.

    ckpt/
      .metadata            every tensor's global shape and chunks, and where each chunk's bytes are
      __0_0.distcp ...     the chunks, one file per saving rank (and writer thread)
      huggingface/         config.json, tokenizer (or beside the folder, or --hf-config DIR)

Only `.metadata` is read at discovery on rank 0; each rank then opens its `.distcp` files, locates the
bytes of every chunk inside them, and the engine reads exactly those byte ranges.
"""

from __future__ import annotations

import functools
import math
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from distmerge import dtypes, input_tree
from distmerge.errors import CorruptInputError, InputError
from distmerge.formats.base import FormatDefaults, Fragment, InputFile, OpenedFile, Scan, input_file, inside, register
from distmerge.formats.dcp_keys import model_names
from distmerge.formats.torch_private import dcp as private

METADATA = ".metadata"
RANK_OF = re.compile(r"^__(\d+)_\d+\.distcp$")


@functools.lru_cache(maxsize=4)
def _metadata(path: str, mtime_ns: int, size: int) -> private.DcpMetadata:
    return private.read_metadata(Path(path))


def load_metadata(root: Path) -> private.DcpMetadata:
    st = (root / METADATA).stat()
    return _metadata(str(root / METADATA), st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=4)
def _chunks_by_file(path: str, mtime_ns: int, size: int) -> tuple[dict[str, str], dict[str, tuple]]:
    """The model's output names and each file's model chunks, in metadata order, made once per process: a rank
    opens ceil(W/N) files, and filtering all F chunks for each was O(F x W/N) (about 1 s at 405B, W=1024, N=64)."""
    md = _metadata(path, mtime_ns, size)
    names = model_names(sorted({c.fqn for c in md.chunks}), str(Path(path).parent))
    by_file: dict[str, list] = {}
    for c in md.chunks:
        if c.fqn in names:
            by_file.setdefault(c.file, []).append(c)
    return names, {f: tuple(chunks) for f, chunks in by_file.items()}


def hf_dir_near(root: Path) -> str | None:
    for candidate in (root / "huggingface", root.parent / "huggingface"):
        if (candidate / "config.json").is_file():
            return str(candidate)
    return None


@register
class DcpFormat(FormatDefaults):
    name = "dcp"
    order = 40
    help = ".metadata + .distcp folders of dcp.save: torchtitan, accelerate"

    def detect(self, root: Path) -> bool:
        return (root / METADATA).is_file() and any(p.suffix == ".distcp" for p in root.iterdir())

    def scan(self, root: Path, options: Mapping[str, Any]) -> Scan:
        md = load_metadata(root)
        names = model_names(sorted({c.fqn for c in md.chunks}), str(root))
        paths = sorted({c.file for c in md.chunks if c.fqn in names})
        missing = [p for p in paths if not inside(root, p).is_file()]
        if missing:
            raise InputError(f"{root}/.metadata points at {', '.join(missing[:4])}, which is missing: copy it back")
        files = tuple(input_file(root, i, p) for i, p in enumerate(paths))
        _check_chunks(root, [c for c in md.chunks if c.fqn in names], {f.path: f.size for f in files})
        ranks = {int(m[1]) for p in os.listdir(root) if (m := RANK_OF.match(p))}
        skipped = len({c.fqn for c in md.chunks}) - len(names) + len(md.non_tensors)
        what = "optimizer, train state, extra state, ..."
        notes = [f"skipped {skipped} entries that are not model weights ({what})"] * bool(skipped)
        return Scan(format=self.name, root=str(root), files=files, hf_dir=hf_dir_near(root),
                    world_size=len(ranks) or len(files), notes=tuple(notes))

    def open(self, scan: Scan, file: InputFile) -> OpenedFile:
        root = Path(scan.root)
        st = (root / METADATA).stat()
        names, by_file = _chunks_by_file(str(root / METADATA), st.st_mtime_ns, st.st_size)
        opened = OpenedFile(fragments=[], layout={"DCP chunk": 0})
        with input_tree.open_input(root / file.path) as fd:  # the file the walk listed, no link or FIFO instead
            for chunk in by_file.get(file.path, ()):
                code = dtypes.code_of(chunk.dtype)
                opened.fragments.append(Fragment(
                    name=names[chunk.fqn], dtype=code, global_shape=chunk.global_shape, offsets=chunk.offsets,
                    lengths=chunk.lengths, file_index=file.index, key=chunk.fqn,
                    byte_offset=private.chunk_data_offset(fd, chunk, dtypes.itemsize(code)),
                ))
                opened.layout["DCP chunk"] += 1
        return opened


def _check_chunks(root: Path, chunks: list, sizes: dict[str, int]) -> None:
    """What .metadata declares, against what is on disk, before anything is built from it: every chunk's block
    inside its tensor (no negative sizes), its bytes inside its file, and a file's chunks no more bytes than the
    file holds (DCP writes them one after another), so the chunk count is bounded by the files' sizes."""
    used = dict.fromkeys(sizes, 0)
    for c in chunks:
        dims = (*c.global_shape, *c.offsets, *c.lengths)
        inside_tensor = len(c.offsets) == len(c.lengths) == len(c.global_shape) and all(
            o + n <= g for o, n, g in zip(c.offsets, c.lengths, c.global_shape, strict=True))
        if min(dims, default=0) < 0 or not inside_tensor:
            raise CorruptInputError(f"{root}/.metadata: {c.fqn} has a chunk at {list(c.offsets)} of "
                                    f"{list(c.lengths)} outside its shape {list(c.global_shape)}: corrupt metadata")
        if c.offset < 0 or c.length < min(1, math.prod(c.lengths)) or c.offset + c.length > sizes[c.file]:
            raise CorruptInputError(f"{root}/.metadata puts a chunk of {c.fqn} at bytes {c.offset}+{c.length} of "
                                    f"{c.file}, which holds {sizes[c.file]}: truncated file or corrupt metadata")
        used[c.file] += c.length
    over = next((f for f, n in used.items() if n > sizes[f]), None)
    if over is not None:
        raise CorruptInputError(f"{root}/.metadata declares {used[over]} bytes of chunks in {over}, which holds "
                                f"{sizes[over]}: corrupt metadata")

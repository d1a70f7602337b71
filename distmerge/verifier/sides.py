"""The two sides of a verify run: a merged model and a reference, listed from headers, read one tensor at a time.

Neither side is ever loaded whole: safetensors files are opened with `safe_open`, pytorch_model*.bin are read as
a checkpoint's torch.save files are (torch_save.read: zip records and pickle checked against budgets, a tensors-only
allow-list, no torch.load), their tensors views of one mapping of the file.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from distmerge import dtypes
from distmerge.errors import CorruptInputError, InputError
from distmerge.formats.base_model import INDEX_CAP
from distmerge.formats.safetensors_header import read_header
from distmerge.formats.torch_private import torch_save
from distmerge.formats.torch_private.restricted import TENSOR_GLOBALS, TensorRef
from distmerge.input import source
from distmerge.output.names import INDEX_NAME

TORCH_SUFFIXES = (".bin", ".pt", ".pth")
# (kind, index file, single file), the order Hugging Face prefers them in.
LAYOUTS = (
    ("safetensors", INDEX_NAME, "model.safetensors"),
    ("torch", "pytorch_model.bin.index.json", "pytorch_model.bin"),
)



@dataclass(frozen=True, kw_only=True)
class Loc:
    file: int  # index into Side.files
    dtype: str  # safetensors dtype code
    shape: tuple[int, ...]


@dataclass(frozen=True, kw_only=True)
class Side:
    path: str
    kind: str  # "safetensors" | "torch"
    files: tuple[str, ...]
    sizes: tuple[int, ...]
    tensors: dict[str, Loc]
    # per file, the nodes whose disks hold it, when the side lies on the nodes' own disks (engine/nodes.py: a folder
    # the nodes list differently); () when every rank can open every file (one node, or a shared folder)
    held: tuple[tuple[int, ...], ...] = ()


def open_side(path: Path, *, role: str, allow_torch: bool) -> Side:
    """The side's files and tensors from its index and headers. Looked up through the source this verify reads
    `path` by (source.of): the folder as it is, or one the nodes joined, whose files on other nodes are asked of
    them (rank 0, while they answer)."""
    src = source.of(path)
    if not src.exists(path):
        raise InputError(f"{role} {path} does not exist: pass a model folder or a weights file")
    kind, files, weight_map = (_folder_layout(src, path, role, allow_torch) if src.is_dir(path)
                               else _one_file(src, path, role))
    if kind == "torch" and not allow_torch:
        raise InputError(f"{role} {path} is not safetensors: distmerge writes model.safetensors files")
    listed = [_list_safetensors(f) if kind == "safetensors" else _list_torch(f) for f in files]
    tensors: dict[str, Loc] = {}
    for i, (f, entries) in enumerate(zip(files, listed, strict=True)):
        for name, (dtype, shape) in entries.items():
            if name in tensors:
                raise CorruptInputError(f"{name} is in both {files[tensors[name].file]} and {f}: use one model's files")
            tensors[name] = Loc(file=i, dtype=dtype, shape=shape)
    if weight_map is not None:
        _check_index(path, files, weight_map, tensors)
    held = getattr(src, "nodes_holding", None)  # a folder the nodes joined (input/nodes.py)
    return Side(path=str(path), kind=kind, files=tuple(map(str, files)), sizes=tuple(src.stat(f).size for f in files),
                tensors=tensors, held=tuple(held(f) for f in files) if held is not None else ())


def _folder_layout(src: source.Source, folder: Path, role: str, allow_torch: bool
                   ) -> tuple[str, list[Path], dict[str, str] | None]:
    for kind, index, single in LAYOUTS if allow_torch else LAYOUTS[:1]:
        if src.is_file(folder / index):
            weight_map = _read_index(src, folder / index)
            return kind, [folder / f for f in sorted(set(weight_map.values()))], weight_map
        if src.is_file(folder / single):
            return kind, [folder / single], None
    if not allow_torch:  # the merged side: distmerge always writes the index, last
        raise InputError(f"{role} {folder} has no {INDEX_NAME}: the merge did not finish; run it again")
    loose = [folder / name for name in src.listdir(folder) if name.endswith(".safetensors")]
    if loose:  # sharded without an index: the files together are the model
        return "safetensors", loose, None
    raise InputError(f"{role} {folder} holds no model.safetensors, pytorch_model.bin or index of either: "
                     "pass the folder of a Hugging Face model or one weights file")


def _one_file(src: source.Source, path: Path, role: str) -> tuple[str, list[Path], dict[str, str] | None]:
    if path.name.endswith(".index.json"):
        weight_map = _read_index(src, path)
        kind = "torch" if any(f.endswith(TORCH_SUFFIXES) for f in weight_map.values()) else "safetensors"
        return kind, [path.parent / f for f in sorted(set(weight_map.values()))], weight_map
    if path.suffix == ".safetensors":
        return "safetensors", [path], None
    if path.suffix in TORCH_SUFFIXES:
        return "torch", [path], None
    raise InputError(f"{role} {path}: not a .safetensors, .bin or .index.json file")


def _read_index(src: source.Source, path: Path) -> dict[str, str]:
    try:
        weight_map = json.loads(src.read_text(path, INDEX_CAP, path.name))["weight_map"]
    except (ValueError, KeyError, TypeError):
        raise CorruptInputError(f"{path} is not a weights index (JSON with a weight_map)") from None
    ok = isinstance(weight_map, dict) and all(isinstance(v, str) and Path(v).name == v for v in weight_map.values())
    if not ok:
        raise CorruptInputError(f"{path}: weight_map must map tensor names to file names in the same folder")
    missing = sorted({f for f in weight_map.values() if not src.is_file(path.parent / f)})
    if missing:
        raise InputError(f"{path} names files that are not there: {', '.join(missing)}; copy them or fix the index")
    return weight_map


def _check_index(path: Path, files: list[Path], weight_map: dict[str, str], tensors: dict[str, Loc]) -> None:
    """The index and the files' own headers must tell the same story, else loaders disagree on the model."""
    for name, file in weight_map.items():
        if name not in tensors or files[tensors[name].file].name != file:
            raise CorruptInputError(f"{path} puts {name} in {file} but that file does not hold it: fix the index")
    unlisted = sorted(set(tensors) - set(weight_map))
    if unlisted:
        raise CorruptInputError(f"{path} does not list {', '.join(unlisted[:5])} that its files hold: fix the index")


def _list_safetensors(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    return {e.name: (e.dtype, e.shape) for e in read_header(source.of(path), path).entries.values()}


def _list_torch(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    return {name: (dtypes.code_of(t.dtype), tuple(t.shape)) for name, t in load_torch(path).items()}


def load_torch(path: Path) -> dict[str, torch.Tensor]:
    """A flat state dict, memory-mapped: a tensor's bytes are read only when it is used."""
    saved = torch_save.read(source.of(path), path, inert_modules=(), allowed=TENSOR_GLOBALS)
    state = saved.value
    if not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(v, TensorRef) for k, v in
                                              state.items()):
        raise CorruptInputError(f"{path} is not a flat state dict of tensors (name -> tensor)")
    return torch_save.mapped_views(source.of(path), path, saved.storage_offsets, state)


class TensorFiles:
    """Reads one side's tensors by name, one at a time. safetensors tensors are read with `pread` into memory the
    caller frees when it drops the tensor: a mapping (safe_open) kept every page it had touched resident, so a
    process that compared a whole model held the whole model (1.9 GB of RSS for the 0.78 GB bench model)."""

    def __init__(self, side: Side) -> None:
        self.side = side
        self._open: dict[int, Any] = {}
        self._flat: tuple[str, torch.Tensor | None] = ("", None)  # the .bin tensor `read` last flattened
        self._buf = torch.empty(0, dtype=torch.uint8)  # `read`'s, reused

    def get(self, name: str) -> torch.Tensor:
        """The whole tensor (verify --logits loads the reference's weights into a model)."""
        handle = self._handle(name)
        if self.side.kind != "safetensors":
            return handle[name]
        entry = handle[1].entries[name]
        data = torch.empty(entry.nbytes, dtype=torch.uint8)
        _pread(handle[0], entry.start, data, name, self.side.files[self.side.tensors[name].file])
        return data.view(dtypes.torch_dtype(entry.dtype)).view(entry.shape)

    def read(self, name: str, start: int, count: int) -> torch.Tensor:
        """Elements [start, start + count) of tensor `name`, flattened in row-major order (verifier/blocks.py):
        a safetensors tensor's byte range read with `pread` into a buffer the next `read` reuses (allocating one
        per block fragmented the heap: blocks.Scratch), a .bin tensor's view of its mapping."""
        handle = self._handle(name)
        if self.side.kind != "safetensors":
            if self._flat[0] != name:  # a view of the mapping; a copy, once, when the saved tensor is strided
                self._flat = (name, handle[name].reshape(-1))
            return self._flat[1][start : start + count]
        entry = handle[1].entries[name]
        dtype = dtypes.torch_dtype(entry.dtype)
        begin, nbytes = entry.start + start * dtype.itemsize, count * dtype.itemsize
        assert start >= 0 and begin + nbytes <= entry.start + entry.nbytes, f"{name}: [{start}, {start + count})"
        if self._buf.numel() < nbytes:
            self._buf = torch.empty(nbytes, dtype=torch.uint8)
        return _pread(handle[0], begin, self._buf[:nbytes], name, self.side.files[self.side.tensors[name].file]
                      ).view(dtype)

    def _handle(self, name: str) -> Any:
        loc = self.side.tensors[name]
        if loc.file not in self._open:
            path = Path(self.side.files[loc.file])
            if self.side.kind == "safetensors":
                src = source.of(path)  # the folder as it is (a merged model), or an input's source
                self._open[loc.file] = (src.open(path), read_header(src, path))
            else:
                self._open[loc.file] = load_torch(path)
        return self._open[loc.file]

    def close(self) -> None:
        for handle in self._open.values():
            if isinstance(handle, tuple):
                handle[0].close()
        self._open.clear()  # .bin mappings close when dropped
        self._flat = ("", None)


def _pread(f: Any, offset: int, data: torch.Tensor, name: str, path: str) -> torch.Tensor:
    """Fills `data` (uint8) with the file's bytes from offset (`f`: a source.InFile); returns it."""
    view, done = memoryview(data.numpy()), 0
    while done < len(view):
        got = f.readinto(view[done:], offset + done)
        if got == 0:
            raise CorruptInputError(f"{path} ends inside {name}: the file is truncated")
        done += got
    return data

"""verl's rank files (each rank's `torch.save(model.state_dict())`) read without torch.load: the pickle goes
through the restricted reader (torch_save.read), DTensors and ShardedTensors become inert records, and their
local tensors `TensorRef`s into the file. No torch class is rebuilt from a checkpoint, so a file saved by
one torch reads the same on any other, and `torch.distributed.tensor` is never imported.

How torch.save pickles each kind of state-dict value (the forms read here; meshes: mesh_record.py):

    plain tensor, Parameter   _rebuild_tensor_v2 (inside _rebuild_parameter)                    every torch
    DTensor (FSDP2, HSDP,     _rebuild_from_type_v2(_rebuild_wrapper_subclass, DTensor, (DTensor, dtype,
      FSDP1 with a mesh)        global size, stride, ...), {"_local_tensor": tensor, "_spec": DTensorSpec})
                              DTensor in torch.distributed._tensor.api (2.4), torch.distributed.tensor (2.5+)
      DTensorSpec             mesh, placements (a tuple), tensor_meta: TensorMeta(shape, stride, dtype),
                              shard_order (2.10+, ignored); in ..._tensor.placement_types (2.4),
                              torch.distributed.tensor._dtensor_spec (2.5+)
      placements              Shard(dim) and Replicate(), read; _StridedShard(dim, split_factor) and
                              Partial(reduce_op) refused by name; in ..._tensor.placement_types (2.4),
                              torch.distributed.tensor.placement_types (2.5+)
    ShardedTensor (FSDP1      _rebuild_from_type_v2(_rebuild_wrapper_subclass, ShardedTensor, (...),
      without a mesh)           (local shards, metadata, process group state, sharding spec, init_rrefs))
                              each local shard: Shard(tensor, ShardMetadata(shard_offsets, shard_sizes, ...));
                              the same module paths from torch 2.0 to 2.15
"""

from __future__ import annotations

import math
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from distmerge.errors import CorruptInputError, LayoutError
from distmerge.formats.torch_private import torch_save
from distmerge.formats.torch_private.mesh_record import Mesh, MeshCache
from distmerge.formats.torch_private.restricted import (
    TENSOR_GLOBALS,
    Record,
    SubclassTensor,
    TensorRef,
    WrapperArgs,
    as_text,
    rebuild_wrapper_subclass,
    record_class,
)
from distmerge.input.source import Source

_DTENSOR_MODULES = ("torch.distributed.tensor", "torch.distributed.tensor._api", "torch.distributed._tensor.api",
                    "torch.distributed._tensor")
_SPEC_MODULES = ("torch.distributed.tensor._dtensor_spec", "torch.distributed._tensor.placement_types",
                 "torch.distributed._tensor._dtensor_spec")
_PLACEMENT_MODULES = ("torch.distributed.tensor.placement_types", "torch.distributed._tensor.placement_types")
_SHARDED = "torch.distributed._shard."
SHARDED_TENSOR = record_class(f"{_SHARDED}sharded_tensor.api", "ShardedTensor", tensor_subclass=True)


def _nested_class(owner: Any, name: str) -> Any:
    """Pickle reaches nested classes through getattr(owner, name); allow exactly one such lookup."""
    if owner is SHARDED_TENSOR and name == "ProcessGroupState":
        return record_class(f"{_SHARDED}sharded_tensor.api", "ShardedTensor.ProcessGroupState")
    raise pickle.UnpicklingError(f"getattr({getattr(owner, '__name__', owner)!r}, {name!r}) is not allowed")


def _records(modules: tuple[str, ...], names: tuple[str, ...], **kind: bool) -> dict[tuple[str, str], Any]:
    return {(m, n): record_class(m, n, **kind) for m in modules for n in names}


# Every global a rank file may name, each mapped to an inert stand-in: nothing else is resolvable.
RANK_FILE_GLOBALS: dict[tuple[str, str], Any] = {
    **TENSOR_GLOBALS,
    ("torch._utils", "_rebuild_wrapper_subclass"): rebuild_wrapper_subclass,
    ("torch.serialization", "_get_layout"): as_text,
    ("builtins", "getattr"): _nested_class,
    **_records(_DTENSOR_MODULES, ("DTensor",), tensor_subclass=True),
    **_records(_SPEC_MODULES, ("DTensorSpec", "TensorMeta", "ShardOrderEntry")),
    **_records(_PLACEMENT_MODULES, ("Shard", "Replicate", "_StridedShard", "Partial")),
    **_records(("torch.distributed.device_mesh",), ("DeviceMesh",)),
    **_records(("torch.distributed._mesh_layout",), ("_MeshLayout", "_FlatLayout")),
    (f"{_SHARDED}sharded_tensor.api", "ShardedTensor"): SHARDED_TENSOR,
    **{(f"{_SHARDED}{m}", n): record_class(f"{_SHARDED}{m}", n) for m, n in (
        ("sharded_tensor.shard", "Shard"), ("metadata", "ShardMetadata"),
        ("sharded_tensor.metadata", "ShardedTensorMetadata"), ("sharded_tensor.metadata", "TensorProperties"),
        ("sharded_tensor.metadata", "MEM_FORMAT_ENCODING"),
        ("sharding_spec.chunk_sharding_spec", "ChunkShardingSpec"))},
    **_records(("torch.distributed.remote_device",), ("_remote_device",)),
}


KNOWN_TORCH = "2.6 to 2.14"  # the releases whose saves tests/data holds (tests/test_torch_versions.py)


def _unknown_class(module: str, name: str) -> str:
    if not module.startswith("torch."):
        return ""
    return (f"a torch class distmerge does not know; it reads the DTensor, DeviceMesh and ShardedTensor forms of "
            f"torch {KNOWN_TORCH} saves: a newer torch may pickle a new one, so update distmerge or report it")


@dataclass(frozen=True, kw_only=True)
class RankFile:
    """A rank file's state dict (tensors as TensorRef, DTensors and ShardedTensors as SubclassTensor) and where
    each storage record starts in the file."""

    path: Path
    state: dict[str, Any]
    storage_offsets: dict[str, int]
    source: Source  # the input's, which opened the file (read_ints reads through it again)

    def file_offset(self, ref: TensorRef) -> int:
        return self.storage_offsets[ref.storage.key] + ref.storage_offset * ref.storage.dtype.itemsize

    def read_ints(self, ref: TensorRef, count: int) -> list[int]:
        """The first `count` values of a small contiguous int tensor (a mesh's ranks), read from the file."""
        if not ref.contiguous or ref.storage.dtype.is_floating_point or math.prod(ref.size) != count:
            raise LayoutError(f"{self.path}: a device mesh's rank list is not a contiguous int tensor of {count}")
        size = ref.storage.dtype.itemsize
        with self.source.open(self.path) as f:
            data = f.pread(count * size, self.file_offset(ref))
        if len(data) != count * size:
            raise CorruptInputError(f"{self.path} ends inside a device mesh's rank list: the file is truncated")
        return torch.frombuffer(bytearray(data), dtype=ref.storage.dtype).tolist()


def read_rank_file(src: Source, path: Path) -> RankFile:
    """The state dict of one rank file (opened through the input's source), with the zip and the pickle checked
    first (torch_save.read)."""
    with src.open(path) as f:
        empty = f.size == 0
    if empty:
        raise CorruptInputError(f"{path} is empty (0 bytes): the save was interrupted; use another checkpoint")
    saved = torch_save.read(src, path, inert_modules=(), allowed=RANK_FILE_GLOBALS, unknown=_unknown_class)
    if not isinstance(saved.value, dict):
        raise CorruptInputError(f"{path} holds a {type(saved.value).__name__}, not a state dict")
    return RankFile(path=path, state=saved.value, storage_offsets=saved.storage_offsets, source=src)


@dataclass(frozen=True)
class Block:
    """One local piece of a state-dict entry: its tensor in the file and its place in the global tensor."""

    ref: TensorRef
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]


def kind_of(value: Any) -> str:
    """"dtensor", "sharded" (FSDP1's ShardedTensor), "tensor", or "" for what holds no tensor."""
    if isinstance(value, SubclassTensor):
        return "sharded" if value.kind is SHARDED_TENSOR else "dtensor"
    return "tensor" if isinstance(value, TensorRef) else ""


def local_blocks(key: str, value: Any, meshes: MeshCache) -> list[Block]:
    """The blocks one state-dict entry holds; [] for entries that are not tensors."""
    kind = kind_of(value)
    if kind == "dtensor":
        return [_dtensor_block(key, value, meshes)]
    if kind == "sharded":
        return _sharded_blocks(key, value)
    if kind == "tensor":
        return [Block(value, value.size, (0,) * len(value.size))]
    return []


def _global_shape(key: str, value: SubclassTensor) -> tuple[int, ...]:
    wrapper = value.wrapper
    if not isinstance(wrapper, WrapperArgs) or len(wrapper.args) < 3:
        raise LayoutError(f"{key}: a {value.kind.pickled_as} not rebuilt by _rebuild_wrapper_subclass")
    shape = wrapper.size
    if not all(type(n) is int and n >= 0 for n in shape):
        raise LayoutError(f"{key}: its global shape {shape} is not a list of sizes")
    return shape


def dtensor_parts(key: str, value: SubclassTensor) -> tuple[TensorRef, Any]:
    state = value.state[1] if isinstance(value.state, tuple) and len(value.state) == 2 else value.state
    local, spec = (state.get("_local_tensor"), state.get("_spec")) if isinstance(state, dict) else (None, None)
    if not isinstance(local, TensorRef) or not isinstance(spec, Record):
        raise LayoutError(f"{key}: a DTensor without a local tensor and a spec: not a DTensor torch 2.4 to 2.15 saves")
    return local, spec


def placement_of(key: str, placement: Any, ndim: int) -> int | None:
    """The tensor dim a placement shards (None: replicated); other placements are refused by name."""
    name = getattr(placement, "pickled_as", "").rsplit(".", 1)[-1]
    if name == "Replicate":
        return None
    if name != "Shard":
        shown = name or type(placement).__name__
        raise LayoutError(f"{key}: placement {shown} is not supported (only Shard and Replicate): merge a save "
                          "without tensor-parallel strided or partial placements")
    dim = vars(placement).get("dim", placement._args[0] if placement._args else None)
    if type(dim) is not int or not -ndim <= dim < ndim:
        raise LayoutError(f"{key}: placement Shard({dim}) names a dimension its {ndim}-dimensional tensor does not "
                          "have: the file is corrupt")
    return dim % ndim


def _dtensor_block(key: str, value: SubclassTensor, meshes: MeshCache) -> Block:
    """Global offsets of a DTensor's local block: torch.chunk rules, applied mesh dim by mesh dim."""
    local, spec = dtensor_parts(key, value)
    mesh: Mesh = meshes.get(key, vars(spec).get("mesh"))
    placements = vars(spec).get("placements")
    if not isinstance(placements, tuple) or len(placements) != len(mesh.sizes):
        raise LayoutError(f"{key}: {len(placements or ())} placements on a {len(mesh.sizes)}-dimensional mesh")
    whole = _global_shape(key, value)
    shape, offsets = list(whole), [0] * len(whole)
    for placement, parts, index in zip(placements, mesh.sizes, mesh.coordinate, strict=True):
        dim = placement_of(key, placement, len(shape))
        if dim is None:
            continue
        chunk = math.ceil(shape[dim] / parts) if shape[dim] else 0
        start = min(chunk * index, shape[dim])
        shape[dim] = max(0, min(shape[dim], start + chunk) - start)
        offsets[dim] += start
    if tuple(shape) != local.size:
        raise LayoutError(f"{key}: local shape {local.size} does not match its placements (expected {tuple(shape)})")
    return Block(local, whole, tuple(offsets))


def _sharded_blocks(key: str, value: SubclassTensor) -> list[Block]:
    shape = _global_shape(key, value)
    shards = value.state[0] if isinstance(value.state, tuple) and value.state else None
    if not isinstance(shards, list):
        raise LayoutError(f"{key}: a ShardedTensor without its local shards: not one torch saves")
    blocks = []
    for shard in shards:
        tensor, meta = vars(shard).get("tensor"), vars(shard).get("metadata")
        offsets = tuple(getattr(meta, "__dict__", {}).get("shard_offsets") or ())
        if not isinstance(tensor, TensorRef) or len(offsets) != len(shape) or any(type(o) is not int for o in offsets):
            raise LayoutError(f"{key}: a ShardedTensor shard without a tensor and its offsets")
        if math.prod(tensor.size) > 0:
            blocks.append(Block(tensor, shape, offsets))
    return blocks


def describe(key: str, value: Any, meshes: MeshCache) -> str:
    """A short human description of an entry's sharding, for `distmerge inspect`."""
    kind = kind_of(value)
    if kind == "dtensor":
        spec = dtensor_parts(key, value)[1]
        mesh = meshes.get(key, vars(spec)["mesh"])
        shown = ", ".join(_placement_text(p) for p in vars(spec)["placements"])
        return f"DTensor mesh({mesh.describe()}) {shown}"
    if kind == "sharded":
        return "ShardedTensor (FSDP1, no mesh)"
    return "plain tensor"


def _placement_text(placement: Any) -> str:
    name = placement.pickled_as.rsplit(".", 1)[-1]
    dim = vars(placement).get("dim", placement._args[0] if placement._args else None)
    return f"{name}(dim={dim})" if name == "Shard" else f"{name}()"

"""The one module that touches private PyTorch details: torch.save zip records, DTensor specs and the
pickled form of FSDP1's ShardedTensor. A torch upgrade that changes any of them is a change here only.

Everything is loaded with `torch.load(weights_only=True, mmap=True)`: nothing in a checkpoint can run
code. torch's loader has no budgets, so each file is checked first (`check_before_load`): its zip records
(zip_records) and its pickle against a budget and an allow-list of the globals an FSDP save names
(pickle_scan): names only, nothing imported. ShardedTensor cannot be unpickled without the process group it
was saved with, so its pickle globals are mapped to inert stand-ins (below) that only record the local
shards and their offsets.
"""

from __future__ import annotations

import logging
import math
import os
import pickle
import re
from pathlib import Path
from typing import Any

import torch

from distmerge import input_tree
from distmerge.errors import CorruptInputError, LayoutError
from distmerge.formats.torch_private import pickle_scan, zip_records
from distmerge.formats.torch_private.restricted import DTYPES, STORAGE_DTYPES, itemsize_of
from distmerge.formats.torch_private.restricted import Record as _Record


class _QuietMeshUnpickle(logging.Filter):
    """Unpickling a DeviceMesh without process groups warns about torch.compile, once per tensor."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "unpickling of the DeviceMesh" not in record.getMessage()


logging.getLogger("torch.distributed.device_mesh").addFilter(_QuietMeshUnpickle())


class _ShardedTensorStandIn(torch.Tensor):
    """Stand-in for torch.distributed._shard.sharded_tensor.ShardedTensor (FSDP1 without a mesh)."""

    def __setstate__(self, state: Any) -> None:
        self.local_shards = state[0]  # list of Shard records: .tensor, .metadata.shard_offsets/sizes

    __torch_function__ = torch._C._disabled_torch_function_impl  # plain attribute access, no dispatch

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise TypeError(f"{func}: a ShardedTensor read by distmerge is only a record of its local shards")


def _nested_class(owner: Any, name: str) -> Any:
    """Pickle reaches nested classes through getattr(owner, name); allow exactly one such lookup."""
    if owner is _ShardedTensorStandIn and name == "ProcessGroupState":
        return _Record
    raise pickle.UnpicklingError(f"getattr({getattr(owner, '__name__', owner)!r}, {name!r}) is not allowed")


_SHARDED_TENSOR_GLOBALS = [
    (_nested_class, "builtins.getattr"),
    (_ShardedTensorStandIn, "torch.distributed._shard.sharded_tensor.api.ShardedTensor"),
    (_Record, "torch.distributed._shard.sharded_tensor.shard.Shard"),
    (_Record, "torch.distributed._shard.metadata.ShardMetadata"),
    (_Record, "torch.distributed._shard.sharded_tensor.metadata.ShardedTensorMetadata"),
    (_Record, "torch.distributed._shard.sharded_tensor.metadata.TensorProperties"),
    (_Record, "torch.distributed._shard.sharded_tensor.metadata.MEM_FORMAT_ENCODING"),
    (_Record, "torch.distributed._shard.sharded_tensor.api.ShardedTensor.ProcessGroupState"),
    (_Record, "torch.distributed._shard.sharding_spec.chunk_sharding_spec.ChunkShardingSpec"),
    (_Record, "torch.distributed.remote_device._remote_device"),
]


# What torch.save of a state dict names: tensors, parameters, DTensors with their specs and meshes (several
# torch versions' module paths), and FSDP1's ShardedTensor (above). torch.load's own allow-list is wider
# (bytearray, ...); these files never need more than this.
_STATE_DICT_NAMES = {
    ("collections", "OrderedDict"), ("torch", "Size"), ("torch", "device"), ("torch", "Tensor"),
    ("torch.serialization", "_get_layout"), ("torch._utils", "_rebuild_tensor_v2"),
    ("torch._utils", "_rebuild_parameter"), ("torch._utils", "_rebuild_wrapper_subclass"),
    ("torch._tensor", "_rebuild_from_type_v2"),
    *((m, "DTensor") for m in ("torch.distributed.tensor", "torch.distributed.tensor._api",
                               "torch.distributed._tensor.api", "torch.distributed._tensor")),
    *((m, n) for m in ("torch.distributed.tensor._dtensor_spec", "torch.distributed._tensor.placement_types")
      for n in ("DTensorSpec", "TensorMeta", "ShardOrderEntry")),
    *((m, n) for m in ("torch.distributed.tensor.placement_types", "torch.distributed._tensor.placement_types")
      for n in ("Shard", "Replicate", "_StridedShard", "Partial")),
    ("torch.distributed.device_mesh", "DeviceMesh"), ("torch.distributed._mesh_layout", "_MeshLayout"),
    ("torch.distributed._mesh_layout", "_FlatLayout"),
    *(tuple(name.rsplit(".", 1)) for _, name in _SHARDED_TENSOR_GLOBALS),
}
# Plain torch.save(state_dict) files (Hugging Face's pytorch_model*.bin): tensors only.
PLAIN_STATE_DICT_NAMES = {
    ("collections", "OrderedDict"), ("torch._utils", "_rebuild_tensor_v2"), ("torch._utils", "_rebuild_parameter"),
    ("torch._tensor", "_rebuild_from_type_v2"), ("torch", "Tensor"), ("torch", "Size"), ("torch", "device"),
}


def check_before_load(path: Path, names: set[tuple[str, str]], fd: int | None = None) -> None:
    """The zip records and the pickle of a torch.save file, checked before torch.load sees it: stored
    disjoint records, a pickle within pickle_scan's budget naming only `names`, torch dtypes and storage
    classes, and storages that fit their records. `fd`: the file, already opened through input_tree."""

    def permitted(module: str, name: str) -> bool:
        return (module, name) in names or (module == "torch" and (name in DTYPES or name in STORAGE_DTYPES))

    own = fd is None
    fd = input_tree.open_input(path)[0] if fd is None else fd
    try:
        found = zip_records.records(fd, str(path))
        pkl, prefix = zip_records.pickle_record(found, str(path))
        if pkl.size > pickle_scan.DEFAULT.max_bytes:
            raise CorruptInputError(f"{path}: its pickle is {pkl.size} bytes, over the limit of "
                                    f"{pickle_scan.DEFAULT.max_bytes} (max_bytes)")
        storages = {n[len(prefix) :]: r.size for n, r in found.items() if n.startswith(prefix)}
        pickle_scan.check(zip_records.read(fd, pkl), str(path), permitted, storages=storages, itemsize=itemsize_of)
    finally:
        if own:
            os.close(fd)


def register_dtensor() -> None:
    """Importing torch.distributed.tensor registers DTensor with the weights_only loader. It costs ~0.8 s,
    so it happens on the first rank file read, not when distmerge starts (DCP merges never need it)."""
    import torch.distributed.tensor  # noqa: F401


def _is_dtensor(value: Any) -> bool:
    return type(value).__name__ == "DTensor" and isinstance(value, torch.distributed.tensor.DTensor)


def load_pickle(path: Path) -> dict[str, Any]:
    """torch.load(mmap=True, weights_only=True) with the ShardedTensor stand-ins; clear errors. torch.load
    opens the file by name: it is given the name of the descriptor that was checked (input_tree.fd_name), so
    it maps the file that passed the checks, not whatever lies at `path` by then."""
    fd, _ = input_tree.open_input(path)
    try:
        if os.fstat(fd).st_size == 0:
            raise CorruptInputError(f"{path} is empty (0 bytes): the save was interrupted; use another checkpoint")
        register_dtensor()
        check_before_load(path, _STATE_DICT_NAMES, fd)
        with torch.serialization.safe_globals(_SHARDED_TENSOR_GLOBALS):
            obj = torch.load(input_tree.fd_name(fd), map_location="cpu", mmap=True, weights_only=True)
    except pickle.UnpicklingError as err:
        raise CorruptInputError(f"{path}: {_refused(str(err))}; distmerge never runs code from checkpoints") from None
    except (RuntimeError, EOFError, ValueError, OSError) as err:
        reason = str(err).splitlines()[0][:160]
        raise CorruptInputError(f"{path} cannot be read ({reason}): truncated or corrupt") from None
    finally:
        os.close(fd)
    if not isinstance(obj, dict):
        raise CorruptInputError(f"{path} holds a {type(obj).__name__}, not a state dict")
    return obj


def _refused(message: str) -> str:
    """The global torch's weights_only loader refused, named in a few words (its own message is a page)."""
    found = re.search(r"GLOBAL ([\w.]+)", message) or re.search(r"global ['`]?([\w.]+)", message)
    if found:
        return f"its pickle calls {found[1]}, which is not allowed"
    first = message.split("WeightsUnpickler error:")[-1].strip().splitlines()
    return f"it holds objects that are not tensors ({(first[0] if first else '')[:100]})"


def record_base(path: Path, tensors: list[torch.Tensor]) -> tuple[int, set[int]] | None:
    """Address of file byte 0 in the mmap torch.load made, and the offsets of the data records.

    torch.load(mmap=True) maps the whole file once and slices every storage out of it, so a storage's
    address minus its record's offset is the same for all: the lowest address belongs to the lowest
    record. Callers check each tensor against the record set and fall back to the view otherwise.
    """
    fd, _ = input_tree.open_input(path)  # checked like every open of an input file, never torch's reader by name
    try:
        found = zip_records.records(fd, str(path))
        prefix = zip_records.pickle_record(found, str(path))[1]
    finally:
        os.close(fd)
    offsets = {r.start for n, r in found.items() if n.startswith(prefix)}
    ptrs = [t.untyped_storage().data_ptr() for t in tensors if t.untyped_storage().nbytes() > 0]
    if not offsets or not ptrs:
        return None
    return min(ptrs) - min(offsets), offsets


def byte_offset_of(tensor: torch.Tensor, base: tuple[int, set[int]] | None) -> int:
    """Where the tensor's bytes start in the file, or -1 when they are not one run we can locate."""
    if base is None or not tensor.is_contiguous() or tensor.numel() == 0:
        return -1
    record = tensor.untyped_storage().data_ptr() - base[0]
    if record not in base[1]:
        return -1
    return record + tensor.storage_offset() * tensor.element_size()


class MeshCache:
    """`mesh.mesh` (global ranks laid out on the mesh) once per unpickled mesh object: the DTensors
    of a file share a few meshes, and rebuilding that tensor costs ~0.1 ms per call."""

    def __init__(self) -> None:
        self._seen: dict[int, tuple[Any, torch.Tensor]] = {}

    def ranks(self, mesh: Any) -> torch.Tensor:
        hit = self._seen.get(id(mesh))
        if hit is None:
            hit = self._seen[id(mesh)] = (mesh, mesh.mesh)  # holding `mesh` keeps its id unique
        return hit[1]


def _dtensor_offsets(key: str, value: Any, file_rank: int, meshes: MeshCache) -> tuple[int, ...]:
    """Global offsets of a DTensor's local block: torch.chunk rules, applied mesh dim by mesh dim."""
    spec = value._spec
    mesh = meshes.ranks(spec.mesh)
    where = (mesh == file_rank).nonzero()
    if where.numel() == 0:
        raise LayoutError(f"{key}: saved by rank {file_rank}, which is not in its device mesh {mesh.tolist()}")
    coord = where[0].tolist()
    shape = list(value.shape)
    offsets = [0] * len(shape)
    for mesh_dim, placement in enumerate(spec.placements):
        kind = type(placement).__name__
        if kind == "Replicate":
            continue
        if kind != "Shard":
            raise LayoutError(f"{key}: placement {placement} is not supported (only Shard and Replicate)")
        dim, parts, index = placement.dim, mesh.shape[mesh_dim], coord[mesh_dim]
        chunk = math.ceil(shape[dim] / parts) if shape[dim] else 0
        start = min(chunk * index, shape[dim])
        shape[dim] = max(0, min(shape[dim], start + chunk) - start)
        offsets[dim] += start
    local = tuple(value._local_tensor.shape)
    if tuple(shape) != local:
        raise LayoutError(f"{key}: local shape {local} does not match its placements (expected {tuple(shape)})")
    return tuple(offsets)


def local_pieces(
    key: str, value: Any, file_rank: int, meshes: MeshCache
) -> list[tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]]:
    """(local tensor, global shape, offsets) for one state-dict entry: DTensor, ShardedTensor or plain."""
    if _is_dtensor(value):
        return [(value._local_tensor, tuple(value.shape), _dtensor_offsets(key, value, file_rank, meshes))]
    if isinstance(value, _ShardedTensorStandIn):
        shape = tuple(value.shape)
        return [
            (s.tensor, shape, tuple(s.metadata.shard_offsets))
            for s in value.local_shards
            if s.tensor.numel() > 0
        ]
    if isinstance(value, torch.Tensor):
        return [(value, tuple(value.shape), (0,) * value.dim())]
    return []


def describe(value: Any, meshes: MeshCache) -> str:
    """A short human description of an entry's sharding, for `distmerge inspect`."""
    if _is_dtensor(value):
        mesh = value._spec.mesh
        ranks = meshes.ranks(mesh)
        names = mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(ranks.dim()))
        dims = ", ".join(f"{n}={s}" for n, s in zip(names, ranks.shape, strict=True))
        return f"DTensor mesh({dims}) {', '.join(map(str, value._spec.placements))}"
    if isinstance(value, _ShardedTensorStandIn):
        return "ShardedTensor (FSDP1, no mesh)"
    return "plain tensor"

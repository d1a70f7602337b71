"""A DTensor's DeviceMesh read from its pickled state as plain numbers, never materialised: the mesh's
sizes, where the saving rank sits on it, which rank saved the file.

DeviceMesh has no `__reduce__`: torch.save pickles its `__dict__`, whose fields changed across releases.
The forms below are told apart by the fields present, not by a version number (the pickle carries none):

    form          seen in saves of   fields read here
    mesh tensor   torch 2.6, 2.8     `mesh`: int tensor of global ranks shaped like the mesh; `mesh_dim_names`
    cute layout   torch 2.11         `_layout`: _MeshLayout, a pycute Layout with (nested) `shape` and `stride`
                                     per mesh dim; `_rank_map`: 1-D int tensor of global ranks; `_mesh_dim_names`
    flat axes     torch 2.13, 2.14   `_layout`: _MeshLayout with `axes`, one _FlatLayout(shape, stride) per
                                     mesh dim; `_rank_map`; `_mesh_dim_names`
    any form                         `_rank`: the global rank that pickled it (2.11 on; absent in 2.6 and 2.8);
                                     `_coordinate_on_dim`: that rank's coordinates on the mesh (every release)

(The saves are in tests/data/torch_versions, made by its make_saves.py; releases between them write one of the
neighbouring forms, which is all the reader needs: it goes by the fields, never by a version.)

A layout's numbers are checked before any rank list is read (at most `world` ranks, no repeated rank, every
index inside the rank map): a crafted layout cannot make anything large. The saving rank's coordinates are
the pickled ones, checked against the rank map where the mesh covers it, else found in the mesh tensor.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from itertools import product
from typing import Any

from distmerge.errors import LayoutError
from distmerge.formats.torch_private.restricted import TensorRef

KNOWN = "DeviceMesh as torch 2.6 to 2.14 pickle it"
ReadInts = Callable[[TensorRef, int], list[int]]  # a small int tensor's values, at most n of them


@dataclass(frozen=True, kw_only=True)
class Mesh:
    sizes: tuple[int, ...]  # ranks along each mesh dim
    coordinate: tuple[int, ...]  # the saving rank's place on the mesh
    names: tuple[str, ...]

    def describe(self) -> str:
        return ", ".join(f"{n}={s}" for n, s in zip(self.names, self.sizes, strict=True))


def _ints(value: Any) -> list[int]:
    """The integers of a (possibly nested) layout tuple; anything else is not a layout."""
    if isinstance(value, bool):
        raise TypeError
    if isinstance(value, int):
        return [value]
    if isinstance(value, tuple):
        return [i for v in value for i in _ints(v)]
    raise TypeError


def _axes(layout: Any) -> list[tuple[list[int], list[int]]]:
    """(sizes, strides) per mesh dim: the flat-axes form, or the cute-layout form (one mode per dim)."""
    state = vars(layout)
    if "axes" in state:
        return [(_ints(a.shape), _ints(a.stride)) for a in state["axes"]]
    shape, stride = state.get("shape", layout._args[0] if layout._args else None), state.get("stride")
    if stride is None and len(layout._args) > 1:
        stride = layout._args[1]
    if isinstance(shape, int):
        return [([shape], _ints(stride))]
    return [(_ints(s), _ints(t)) for s, t in zip(shape, stride, strict=True)]


def _index(coordinate: tuple[int, ...], axes: list[tuple[list[int], list[int]]]) -> int:
    """Position in the rank map of a coordinate: per mesh dim, the coordinate split lexicographically over
    the dim's (nested) sizes, times their strides (torch's layouts are lexicographic, unlike CuTe's)."""
    at = 0
    for c, (sizes, strides) in zip(coordinate, axes, strict=True):
        for size, stride in reversed(list(zip(sizes, strides, strict=True))):
            c, digit = divmod(c, size)
            at += digit * stride
    return at


def _check_layout(key: str, axes: list[tuple[list[int], list[int]]], map_size: int, world: int) -> None:
    sizes = [n for s, _ in axes for n in s]
    strides = [t for _, t in axes for t in t]
    if len(sizes) != len(strides) or any(s < 1 for s in sizes) or any(s < 0 for s in strides):
        raise LayoutError(f"{key}: its device mesh layout {sizes}:{strides} is not valid")
    if math.prod(sizes) > world or not 0 < map_size <= world:
        raise LayoutError(f"{key}: its device mesh spans {math.prod(sizes)} ranks (rank map {map_size}), more "
                          f"than the {world} ranks that saved this checkpoint")
    if any(size > 1 and stride == 0 for size, stride in zip(sizes, strides, strict=True)):
        raise LayoutError(f"{key}: its device mesh repeats ranks (a stride-0 dimension): not a mesh a job saves")
    if sum((n - 1) * s for n, s in zip(sizes, strides, strict=True)) >= map_size:
        raise LayoutError(f"{key}: its device mesh layout reaches past its rank map")


def _coordinate(key: str, state: dict, sizes: tuple[int, ...]) -> tuple[int, ...] | None:
    coord = state.get("_coordinate_on_dim")
    if coord is None:
        return None
    try:
        coord = tuple(_ints(tuple(coord)))
    except TypeError:
        raise LayoutError(f"{key}: its device mesh records coordinates that are not integers") from None
    if len(coord) != len(sizes) or not all(0 <= c < s for c, s in zip(coord, sizes, strict=True)):
        raise LayoutError(f"{key}: its device mesh places its saver at {list(coord)}, outside the mesh {list(sizes)}")
    return coord


def _from_layout(key: str, state: dict, file_rank: int, world: int, read_ints: ReadInts) -> Mesh:
    try:
        axes = _axes(state["_layout"])
    except (TypeError, AttributeError, ValueError, IndexError):
        raise LayoutError(f"{key}: its device mesh has a layout that is not sizes and strides: not a DTensor "
                          f"{KNOWN}") from None
    rank_map = state.get("_rank_map")
    map_size = math.prod(rank_map.size) if isinstance(rank_map, TensorRef) else -1
    _check_layout(key, axes, map_size, world)
    sizes = tuple(math.prod(s) for s, _ in axes)
    coord = _coordinate(key, state, sizes)
    if coord is None or math.prod(sizes) == map_size:  # the mesh covers its rank map: the saver's place is known
        ranks = read_ints(rank_map, map_size)
        found = [c for c in product(*map(range, sizes)) if ranks[_index(c, axes)] == file_rank]
        if coord is None and not found:
            raise LayoutError(f"{key}: saved by rank {file_rank}, which is not in its device mesh")
        if coord is not None and coord not in found:
            raise LayoutError(f"{key}: its device mesh places rank {file_rank} at {list(coord)}, where its rank map "
                              "holds another rank")
        coord = coord or found[0]
    return Mesh(sizes=sizes, coordinate=coord, names=_names(state, "_mesh_dim_names", len(sizes)))


def _from_mesh_tensor(key: str, state: dict, file_rank: int, world: int, read_ints: ReadInts) -> Mesh:
    mesh = state["mesh"]
    if not isinstance(mesh, TensorRef) or not mesh.check_shape() or math.prod(mesh.size) > world:
        raise LayoutError(f"{key}: its device mesh spans more than the {world} ranks that saved this checkpoint")
    sizes = mesh.size
    ranks = read_ints(mesh, math.prod(sizes))
    found = [c for c, r in zip(product(*map(range, sizes)), ranks, strict=True) if r == file_rank]
    if not found:
        raise LayoutError(f"{key}: saved by rank {file_rank}, which is not in its device mesh {ranks}")
    coord = _coordinate(key, state, sizes)
    if coord is not None and coord != found[0]:  # these releases record no `_rank`: the saver's place tells
        saver = ranks[_index(coord, [([n], [math.prod(sizes[i + 1:])]) for i, n in enumerate(sizes)])]
        raise _replaced(key, saver, file_rank)
    return Mesh(sizes=tuple(sizes), coordinate=found[0], names=_names(state, "mesh_dim_names", len(sizes)))


def _replaced(key: str, saver: int, file_rank: int) -> LayoutError:
    return LayoutError(f"{key}: this file was saved by rank {saver} (its device mesh says so), not by rank "
                       f"{file_rank} as its name says: a rank file replaced by another rank's; restore the "
                       "original files")


def _names(state: dict, field: str, n: int) -> tuple[str, ...]:
    names = state.get(field)
    if isinstance(names, tuple) and len(names) == n and all(isinstance(x, str) for x in names):
        return names
    return tuple(f"dim{i}" for i in range(n))


# The forms, newest first: the first whose field is in the state reads it.
FORMS: tuple[tuple[str, Callable[..., Mesh]], ...] = (("_layout", _from_layout), ("mesh", _from_mesh_tensor))


def read_mesh(key: str, record: Any, file_rank: int, world: int, read_ints: ReadInts) -> Mesh:
    """The mesh of the DTensor at `key`, refused from its numbers alone when no job of `world` ranks saves it
    or when another rank pickled it (a rank file replaced by another rank's)."""
    state = getattr(record, "__dict__", None)
    if getattr(record, "pickled_as", "") != "torch.distributed.device_mesh.DeviceMesh" or not isinstance(state, dict):
        raise LayoutError(f"{key}: its device mesh is a {getattr(record, 'pickled_as', type(record).__name__)}, not "
                          f"a {KNOWN}")
    saver = state.get("_rank")
    if isinstance(saver, int) and not isinstance(saver, bool) and saver != file_rank:
        raise _replaced(key, saver, file_rank)
    for field, read in FORMS:
        if field in state:
            return read(key, state, file_rank, world, read_ints)
    raise LayoutError(f"{key}: its device mesh has neither a layout nor a mesh tensor ({sorted(state)[:6]}): not "
                      f"a {KNOWN}; tell distmerge's developers which torch saved it")


class MeshCache:
    """Each distinct mesh record of a file read once (a file's DTensors share a few meshes)."""

    def __init__(self, file_rank: int, world: int, read_ints: ReadInts) -> None:
        self.file_rank, self.world, self.read_ints = file_rank, world, read_ints
        self._seen: dict[int, tuple[Any, Mesh]] = {}

    def get(self, key: str, record: Any) -> Mesh:
        hit = self._seen.get(id(record))
        if hit is None:
            mesh = read_mesh(key, record, self.file_rank, self.world, self.read_ints)
            hit = self._seen[id(record)] = (record, mesh)  # holding the record keeps its id unique
        return hit[1]

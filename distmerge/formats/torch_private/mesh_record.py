"""A DTensor's DeviceMesh read as a record, never materialised: which rank saved the file, and whether the
mesh's layout is one a job of the checkpoint's world size can have.

`DeviceMesh.mesh` builds a tensor from the pickled layout (sizes and strides per mesh dimension) and rank
map; a crafted layout (huge sizes, stride 0) makes that allocation as large as the sizes ask. So the
layout is checked first, from its numbers: at most `world` ranks, no repeated rank (a stride-0 dimension
of size > 1), every index inside the rank map. The mesh also records the global rank of the process that
pickled it (`_rank`): a rank file replaced by another rank's file says so.
"""

from __future__ import annotations

import math
from typing import Any

from distmerge.errors import LayoutError


def is_dtensor(value: Any) -> bool:
    return type(value).__name__ == "DTensor" and hasattr(value, "_spec")


def _ints(value: Any) -> list[int]:
    """The integers of a (possibly nested) layout tuple; anything else is not a layout."""
    if isinstance(value, bool):
        raise TypeError
    if isinstance(value, int):
        return [value]
    if isinstance(value, tuple):
        return [i for v in value for i in _ints(v)]
    raise TypeError


def _layout_numbers(mesh: Any) -> tuple[list[int], list[int]] | None:
    """(sizes, strides) of the mesh's layout, or None for a torch that pickles the mesh tensor itself."""
    layout = getattr(mesh, "__dict__", {}).get("_layout")
    if layout is None:
        return None
    sizes, strides = [], []
    for axis in getattr(layout, "axes", ()):
        sizes += _ints(axis.shape)
        strides += _ints(axis.stride)
    return sizes, strides


def check_mesh(key: str, mesh: Any, file_rank: int, world: int) -> None:
    """Refuse, from the record alone, a mesh no job of `world` ranks saves, or one pickled by another rank."""
    state = getattr(mesh, "__dict__", {})
    try:
        numbers = _layout_numbers(mesh)
    except (TypeError, AttributeError):
        raise LayoutError(f"{key}: its device mesh has a layout that is not sizes and strides: not a DTensor "
                          "this PyTorch saved") from None
    if numbers is not None:
        sizes, strides = numbers
        rank_map = state.get("_rank_map")
        map_size = rank_map.numel() if hasattr(rank_map, "numel") else -1
        if len(sizes) != len(strides) or any(s < 1 for s in sizes) or any(s < 0 for s in strides):
            raise LayoutError(f"{key}: its device mesh layout {sizes}:{strides} is not valid")
        if math.prod(sizes) > world or not 0 < map_size <= world:
            raise LayoutError(f"{key}: its device mesh spans {math.prod(sizes)} ranks (rank map {map_size}), more "
                              f"than the {world} ranks that saved this checkpoint")
        if any(size > 1 and stride == 0 for size, stride in zip(sizes, strides, strict=True)):
            raise LayoutError(f"{key}: its device mesh repeats ranks (a stride-0 dimension): not a mesh a job saves")
        if sum((n - 1) * s for n, s in zip(sizes, strides, strict=True)) >= map_size:
            raise LayoutError(f"{key}: its device mesh layout reaches past its rank map")
    elif hasattr(state.get("mesh"), "shape") and math.prod(state["mesh"].shape) > world:
        raise LayoutError(f"{key}: its device mesh spans more than the {world} ranks that saved this checkpoint")
    saver = state.get("_rank")
    if isinstance(saver, int) and not isinstance(saver, bool) and saver != file_rank:
        raise LayoutError(f"{key}: this file was saved by rank {saver} (its device mesh says so), not by rank "
                          f"{file_rank} as its name says: a rank file replaced by another rank's; restore the "
                          "original files")


class MeshChecks:
    """Each distinct mesh object of a file checked once (a file's DTensors share a few meshes)."""

    def __init__(self, file_rank: int, world: int) -> None:
        self.file_rank, self.world = file_rank, world
        self._seen: dict[int, Any] = {}

    def check(self, key: str, value: Any) -> None:
        if not is_dtensor(value):
            return
        mesh = value._spec.mesh
        if id(mesh) not in self._seen:
            check_mesh(key, mesh, self.file_rank, self.world)
            self._seen[id(mesh)] = mesh  # holding it keeps its id unique

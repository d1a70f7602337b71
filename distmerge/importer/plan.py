"""The import's plan, made alike on every rank from what rank 0 discovered: the Megatron tensors (the family's
table walked backwards), their chunks in the files megatron-core's ranks would have saved, and which process
writes each file. What is written depends only on the model and the layout (TP, PP, EP); which process writes a
file, only on N.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

from distmerge import catalog, dtypes
from distmerge.families.base import SourceMeta
from distmerge.families.megatron import inverse
from distmerge.formats.megatron import dist_layout as dl
from distmerge.formats.megatron import pipeline
from distmerge.importer.discover import Model


@dataclass(frozen=True, kw_only=True)
class Layout:
    """The training layout asked for."""

    tp: int
    pp: int
    divisible_by: int = 128  # Megatron-LM's --make-vocab-size-divisible-by
    ep: int = 1  # expert parallel size: an MoE model's experts split over EP ranks
    vpp: int | None = None  # virtual pipeline stages per pipeline rank (Megatron-LM's interleaved schedule)
    first: int | None = None  # layers of the first pipeline rank (--decoder-first-pipeline-num-layers), else even
    last: int | None = None  # layers of the last pipeline rank (--decoder-last-pipeline-num-layers), else even

    def split(self, layers: int) -> pipeline.Split:
        """The pipeline split of a model of `layers` layers at this layout."""
        return pipeline.Split(layers=layers, pp=self.pp, vpp=self.vpp, first=self.first, last=self.last)


@dataclass(frozen=True, kw_only=True)
class DistFile:
    name: str  # relative to the iteration folder
    chunks: tuple[dl.Chunk, ...]  # in the order written: key, then offsets
    objects: tuple[dl.ObjectChunk, ...]
    nbytes: int  # the chunks' tensor bytes (the blobs add a little)


@dataclass(frozen=True, kw_only=True)
class ImportPlan:
    sizes: inverse.Sizes
    grid: dl.Grid
    tensors: dict[str, inverse.Imported]  # by Megatron name
    files: tuple[DistFile, ...]  # by name
    owners: tuple[int, ...]  # the process that writes files[i]


def make_plan(model: Model, layout: Layout, world: int) -> ImportPlan:
    """The plan, or ConfigError / InputError / LayoutError in one line (a TP, PP or EP the model does not allow, a
    tensor no row maps, a config.json that does not fit the tensors)."""
    catalog.install()  # the transforms' inverses, by name
    sizes, grid = check_layout(model.config, layout)
    metas = {n: SourceMeta(name=n, dtype=t.dtype, shape=t.shape) for n, t in model.tensors.items()}
    tensors = {t.name: t for t in inverse.megatron_tensors(metas, model.config, sizes)}
    by_rank: dict[int, list[dl.Chunk]] = {}
    for t in tensors.values():
        for chunk in dl.chunks(t.name, t.shape, t.parts, grid):
            by_rank.setdefault(chunk.rank, []).append(chunk)
    objects: dict[int, list[dl.ObjectChunk]] = {}
    for obj in dl.extra_state_objects(list(tensors), grid):
        objects.setdefault(obj.rank, []).append(obj)
    files = tuple(_file(rank, by_rank.get(rank, []), objects.get(rank, []), tensors)
                  for rank in sorted(set(by_rank) | set(objects)))
    return ImportPlan(sizes=sizes, grid=grid, tensors=tensors, files=files, owners=owners(files, world))


def check_layout(config: dict, layout: Layout) -> tuple[inverse.Sizes, dl.Grid]:
    """The model's sizes and the layout's grid, after the refusals config.json alone decides (an architecture not
    written, a TP, PP or EP that does not divide the heads, layers or experts, a pipeline split megatron-core
    refuses: pipeline.check)."""
    sizes = inverse.sizes(config, layout.tp, layout.divisible_by)
    grid = dl.Grid(tp=layout.tp, pp=layout.pp, layers=sizes.layers, ep=layout.ep, experts=sizes.experts,
                   per_layer=sizes.per_layer,
                   layer_ranks=pipeline.layer_ranks(layout.split(sizes.layers)))
    dl.check_grid(grid)
    return sizes, grid


def _file(rank: int, chunks: list[dl.Chunk], objects: list[dl.ObjectChunk],
          tensors: dict[str, inverse.Imported]) -> DistFile:
    ordered = tuple(sorted(chunks, key=lambda c: (c.key, c.offsets)))
    nbytes = sum(math.prod(c.lengths) * dtypes.itemsize(tensors[c.tensor].dtype) for c in ordered)
    return DistFile(name=dl.file_name(rank), chunks=ordered, objects=tuple(sorted(objects, key=lambda o: o.key)),
                    nbytes=nbytes)


def owners(files: tuple[DistFile, ...], world: int) -> tuple[int, ...]:
    """Each file to the least loaded process, largest files first (ties: the lower file, the lower rank)."""
    heap = [(0, rank) for rank in range(world)]
    out = [0] * len(files)
    for i in sorted(range(len(files)), key=lambda i: (-files[i].nbytes, i)):
        load, rank = heapq.heappop(heap)
        out[i] = rank
        heapq.heappush(heap, (load + files[i].nbytes, rank))
    return tuple(out)

"""`--to torchtitan`'s plan: the torchtitan tensors (families/torchtitan/inverse.py) each saved whole, one chunk,
in files grouped by layer, and which process writes each file.

torchtitan's checkpointer loads a DCP save at any world size (DCP reshards on load: each rank reads the rows of
the chunks its FSDP shard needs), so a save of whole tensors is the one layout for every job. The files:

    step-0/__0_0.distcp          tok_embeddings, norm, lm_head (what is outside the layers)
    step-0/__{1+i}_0.distcp      layer i's tensors
    step-0/__{1+L+j}_0.distcp    DeepSeek-V3's multi-token prediction layer j (mtp_layers.j), after the L layers
    step-0/.metadata             DCP's index of the chunks, written last

The file names and bytes depend only on the model; which process writes a file, only on N (plan.owners).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from distmerge import catalog, dtypes
from distmerge.families.base import SourceMeta
from distmerge.families.megatron.inverse import Imported
from distmerge.families.torchtitan import family, inverse
from distmerge.formats.megatron import dist_layout as dl
from distmerge.importer.discover import Model
from distmerge.importer.plan import DistFile, owners

STEP = "step-0"  # torchtitan's checkpointer starts a step-0 save as model weights only (dcp.py: model_only = step == 0)
LAYER = re.compile(r"^(mtp_)?layers\.(\d+)\.")


@dataclass(frozen=True, kw_only=True)
class TitanPlan:
    arch: str
    tensors: dict[str, Imported]  # by torchtitan name
    files: tuple[DistFile, ...]  # in file order
    owners: tuple[int, ...]  # the process that writes files[i]


def make_titan_plan(model: Model, world: int) -> TitanPlan:
    """The plan, or ConfigError / InputError / LayoutError in one line (a family torchtitan lacks, a tensor no row
    maps, a config.json that does not fit the tensors)."""
    catalog.install()  # the transforms' inverses, by name
    arch = inverse.architecture(model.config)
    metas = {n: SourceMeta(name=n, dtype=t.dtype, shape=t.shape) for n, t in model.tensors.items()}
    tensors = {t.name: t for t in inverse.torchtitan_tensors(metas, model.config)}
    layers = family.sizes(model.config, arch)["layers"] or 0  # an MTP layer's file follows the decoder's
    groups: dict[int, list[dl.Chunk]] = {}
    for t in tensors.values():
        groups.setdefault(file_number(t.name, layers), []).append(whole_chunk(t))
    files = tuple(_file(k, groups[k], tensors) for k in sorted(groups))
    return TitanPlan(arch=arch, tensors=tensors, files=files, owners=owners(files, world))


def file_number(name: str, layers: int) -> int:
    """The file a tensor is saved in: 1 + its layer, 1 + `layers` + j for MTP layer j, or 0 outside the layers."""
    m = LAYER.match(name)
    if m is None:
        return 0
    return 1 + int(m[2]) + (layers if m[1] else 0)


def whole_chunk(t: Imported) -> dl.Chunk:
    """The one chunk of a tensor saved whole: all its rows, at offset zero. The rows are counted in its
    segments' rows (read.rows_of): a stacked expert tensor [E, F, D] is E x F rows of its sources, reshaped."""
    return dl.Chunk(key=t.name, global_shape=t.shape, offsets=(0,) * len(t.shape), lengths=t.shape, tensor=t.name,
                    rows=(0, sum(s.rows for s in t.segments)), cols=None, rank=0)


def _file(number: int, chunks: list[dl.Chunk], tensors: dict[str, Imported]) -> DistFile:
    ordered = tuple(sorted(chunks, key=lambda c: c.key))
    nbytes = sum(math.prod(c.lengths) * dtypes.itemsize(tensors[c.tensor].dtype) for c in ordered)
    return DistFile(name=dl.file_name(number), chunks=ordered, objects=(), nbytes=nbytes)

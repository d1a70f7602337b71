"""Megatron-core `dist_checkpointing` saves with the torch_dist backend: a DCP folder with Megatron names.

    iter_0001000/  metadata.json {"sharded_backend": "torch_dist"}, common.pt (args, iteration: not read),
                   .metadata, __R_k.distcp        (verl: dist_ckpt/ or model/dist_ckpt/)

megatron-core 0.19 writes no common.pt: the common state is a bytes entry `common_state/shard_0_<world>` of
__0_0.distcp, skipped like every DCP entry that is not a tensor (tests/data/megatron_core_0_19).

The DCP reader does the work. Megatron stacks the layers of a homogeneous decoder on a leading axis:
`decoder.layers.self_attention.linear_qkv.weight` has shape (layers, rows, cols) and every chunk covers one
layer (`prepend_axis_num`); SequentialMLP experts add an expert axis after it. Each chunk is renamed
here to its layer (and expert), `decoder.layers.{i}.…`, which drops those axes without moving a byte, so
one layer's tensor is one unit of work and the output files split between layers. linear_fc1 is stored as
the global [gate; up].
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import replace
from itertools import product
from pathlib import Path
from typing import Any

from distmerge import dtypes
from distmerge.errors import InputError
from distmerge.formats.base import FormatDefaults, Fragment, Hints, InputFile, OpenedFile, Scan
from distmerge.formats.dcp.folder import DcpFormat
from distmerge.formats.megatron import layout as mg
from distmerge.input import tree
from distmerge.input.source import Source

# Stacked name prefix -> the per-layer (and per-expert) name; longest first. `{}` takes the axis index.
STACKED = (
    # SequentialMLP experts (megatron-core 0.16 saves them as experts.experts.*), named like legacy files' experts
    ("decoder.layers.mlp.experts.experts.", "decoder.layers.{}.mlp.experts.local_experts.{}."),
    ("decoder.layers.mlp.experts.local_experts.", "decoder.layers.{}.mlp.experts.local_experts.{}."),
    ("decoder.layers.", "decoder.layers.{}."),
)
# A decoder of mixed dense and MoE layers (DeepSeek's first_k_dense_replace) is saved per layer, under global
# numbers, yet each MoE layer's SequentialMLP experts are still stacked on a leading expert axis; so are those of
# a multi-token prediction block's layer (mtp.layers.{j}.transformer_layer.…, mtp_model_layer in megatron-core 0.19;
# always saved per block).
LAYER_EXPERTS = re.compile(
    r"^((?:decoder\.layers\.\d+|mtp\.layers\.\d+\.(?:transformer_layer|mtp_model_layer))\.mlp\.experts\.)experts\.")


class MegatronDistFormat(FormatDefaults):
    name = "megatron-dist"
    order = 30  # before dcp: a torch_dist save is a DCP folder too
    help = "Megatron-core torch_dist folders"
    options = (mg.ITERATION,)

    def detect(self, source: Source) -> bool:
        save = mg.looks_like(source)
        return save is not None and _is_torch_dist(source, save)

    def scan(self, source: Source, options: Mapping[str, Any]) -> Scan:
        root = source.root
        save = mg.save_dir(source, root, options)
        if not _is_torch_dist(source, save):
            raise InputError(f"{save} is not a Megatron torch_dist save (no metadata.json with that backend)")
        inner = DcpFormat().scan(source.at(save), {})
        notes = (f"Megatron torch_dist checkpoint {save.name}", *inner.notes)
        # linear_fc1 is stored as the global [gate; up]: one shard for the family's split
        return replace(inner, format=self.name, hf_dir=mg.hf_dir_near(source, save, root), notes=notes,
                       hints=Hints(naming="megatron"))

    def open(self, source: Source, scan: Scan, file: InputFile) -> OpenedFile:
        opened = DcpFormat().open(source, scan, file)
        opened.fragments = [piece for frag in opened.fragments for piece in unstack(frag)]
        return opened


def _is_torch_dist(src: Source, save: Path) -> bool:
    try:
        meta = src.read_json(save / mg.DIST_MARKER, tree.MARKER_CAP, "torch_dist marker")
    except (OSError, InputError):  # bounded, regular files only: a huge or special marker is not this layout
        return False
    return isinstance(meta, dict) and meta.get("sharded_backend") == "torch_dist"


def unstack(frag: Fragment) -> list[Fragment]:
    """A chunk of a stacked tensor -> one fragment per layer (and expert) it covers, named by them."""
    if m := LAYER_EXPERTS.match(frag.name):
        prefix, template = m[0], m[1] + "local_experts.{}."
    elif mg.LAYER.match(frag.name):
        return [frag]  # already per layer (non-homogeneous models save decoder.layers.{i}.…)
    else:
        prefix, template = next(((p, t) for p, t in STACKED if frag.name.startswith(p)), (None, None))
    if prefix is None:
        return [frag]
    axes = template.count("{}")
    inner_shape, inner_offsets = frag.global_shape[axes:], frag.offsets[axes:]
    inner_lengths = frag.lengths[axes:]
    stride = math.prod(inner_lengths) * dtypes.itemsize(frag.dtype)
    ranges = [range(o, o + n) for o, n in zip(frag.offsets[:axes], frag.lengths[:axes], strict=True)]
    out = []
    for k, index in enumerate(product(*ranges)):
        out.append(Fragment(
            name=template.format(*index) + frag.name[len(prefix):], dtype=frag.dtype, global_shape=inner_shape,
            offsets=inner_offsets, lengths=inner_lengths, file_index=frag.file_index, key=frag.key,
            byte_offset=frag.byte_offset + k * stride if frag.byte_offset >= 0 else -1,
        ))
    return out

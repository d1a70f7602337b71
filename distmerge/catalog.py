"""Every plug-in the planning looks up by name, listed in one place: the model families (claimed by
families.base.claim), the layout transforms and folds a unit names (families.transforms.apply / folded), and the
rewrites an output option makes of any family's result (families.base.rewrite).

No module registers itself when imported: `install` puts the lists below in those registries, once, and the places
that start a planning call it first (engine/prepare.py, front/inspect.py, verifier/listing.py). A new family,
transform, fold or rewrite is one line here.

It sits above families/, quantize/ and average/ (it names them all) and below the engine, which reaches the
plug-ins only through the registries.
"""

from __future__ import annotations

from distmerge.average import fold as average_fold
from distmerge.families import base, hf, joined, transforms, value_head
from distmerge.families.lora import family as lora_family
from distmerge.families.lora import transforms as lora_transforms
from distmerge.families.megatron import family as megatron_family
from distmerge.families.megatron import transforms as megatron_transforms
from distmerge.families.torchtitan import family as torchtitan_family
from distmerge.families.torchtitan import transforms as torchtitan_transforms
from distmerge.quantize import table as quantize_table

# In any order: claim tries them in each one's declared `order`.
FAMILIES = (hf.HF, lora_family.LORA_FAMILY, megatron_family.MEGATRON, torchtitan_family.TORCHTITAN,
            value_head.VALUE_HEAD)
# A unit's transform, by its function's name.
TRANSFORMS = (
    transforms.identity, transforms.trim_rows, transforms.copies,
    megatron_transforms.split_qkv, megatron_transforms.split_gate_up, megatron_transforms.mla_rope_halves,
    torchtitan_transforms.rope_permute,
    lora_transforms.lora_fuse,
    value_head.with_zero_bias,
    quantize_table.quantized, joined.joined,
)
# Each transform the import walks backwards, and its inverse (families/transforms.Segment: the target's rows as
# rows of the Hugging Face tensors), declared beside it.
INVERSES = (
    (transforms.identity, transforms.identity_rows), (transforms.trim_rows, transforms.pad_rows),
    (megatron_transforms.split_qkv, megatron_transforms.fuse_qkv_rows),
    (megatron_transforms.split_gate_up, megatron_transforms.fuse_gate_up_rows),
    (megatron_transforms.mla_rope_halves, megatron_transforms.mla_rope_pairs_rows),
    (torchtitan_transforms.rope_permute, torchtitan_transforms.rope_interleave_rows),
)
# Transforms made in steps (engine/fold.py assembles a unit naming one a group at a time).
FOLDS = {"average": average_fold.AVERAGE}
# What a wrapping transform does to its inner transform's targets, so that a fold it wraps is still a fold:
# --quantize of an --average is built one input at a time.
AFTER = {"quantized": quantize_table.quantize_targets}
# An output option's rewrite of any family's result, by the OutputSettings field that turns it on.
REWRITES = {"quantize": quantize_table.quantize}

_installed: list[bool] = []  # one entry once install has run: the registries are per process


def install() -> None:
    """Put every family, transform, fold and rewrite above in the registries the lookups read; once per process
    (a second call does nothing)."""
    if _installed:
        return
    for family in FAMILIES:
        base.register(family)
    transforms.add(*TRANSFORMS)
    for forward, rows in INVERSES:
        transforms.add_inverse(forward, rows)
    for name, made in FOLDS.items():
        transforms.add_fold(name, made)
    for name, change in AFTER.items():
        transforms.add_after(name, change)
    for setting, rewrite in REWRITES.items():
        base.add_rewrite(setting, rewrite)
    _installed.append(True)

"""verl's FSDP/FSDP2 layout: one `torch.save(model.state_dict())` per training rank.

    ckpt/
      model_world_size_{W}_rank_{r}.pt      DTensor (FSDP2, FSDP1 with a mesh), ShardedTensor (FSDP1
                                            without a mesh) or plain tensors (W=1, buffers)
      optim_world_size_*.pt, extra_state_*  ignored
      fsdp_config.json                      {"FSDP_version": 1|2, "world_size": W}; older saves lack it
      huggingface/                          config.json, tokenizer, generation config, custom code
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from distmerge import dtypes
from distmerge.errors import InputError, LayoutError
from distmerge.formats import base, copies
from distmerge.formats.base import FormatDefaults, Fragment, Hints, InputFile, OpenedFile, Scan, input_file
from distmerge.formats.torch_private import archive_name, state_dicts, torch_save
from distmerge.formats.torch_private.mesh_record import MeshCache
from distmerge.input import tree
from distmerge.input.source import Source

RANK_FILE = re.compile(r"^model_world_size_(\d+)_rank_(\d+)\.pt$")
LORA_META = "lora_train_meta.json"  # verl writes r, lora_alpha, task_type beside the rank files of a LoRA run
OPTIM_FILE = re.compile(r"^optim_world_size_(\d+)_rank_(\d+)\.pt$")
# Wrapper modules whose names can leak into state-dict keys (FSDP1 flat params, activation checkpointing).
WRAPPER_SEGMENTS = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")


class FsdpFormat(FormatDefaults):
    name = "fsdp"
    order = 10
    help = "verl's model_world_size_W_rank_R.pt files"

    def detect(self, source: Source) -> bool:
        """Model rank files, or the traces of a verl save without them (scan then says what is missing)."""
        root = source.root
        return source.is_file(root / "fsdp_config.json") or any(
            RANK_FILE.match(n) or OPTIM_FILE.match(n) for n in source.listdir(root)
        )

    def scan(self, source: Source, options: Mapping[str, Any]) -> Scan:
        root = source.root
        names = source.listdir(root)
        matched = [(int(m[1]), int(m[2]), n) for n in names if (m := RANK_FILE.match(n))]
        found = {rank: (world, n) for world, rank, n in matched}
        if not found:
            if any(OPTIM_FILE.match(n) for n in names):
                raise InputError(f"{root} holds only optimizer files (optim_world_size_*): no model weights to merge")
            raise InputError(f"{root} has no model_world_size_*_rank_*.pt files")
        sizes = {w for w, _, _ in matched}  # every file's, not only those `found` kept for a rank number
        if len(sizes) > 1:
            raise InputError(f"{root} mixes checkpoints of world sizes {sorted(sizes)}: keep one set of rank files")
        world = sizes.pop()
        notes = _check_config(source, root, world)
        _check_ranks(root, world, set(found))  # before anything is built from the world size in the names
        files = tuple(input_file(source, root, r, found[r][1], rank=r) for r in range(world))
        if copy := copies.first_copy(source, [root / f.path for f in files]):
            raise LayoutError(f"{root}: {copy[1].name} is the same file as {copy[0].name} (a copy or a link): "
                              "each rank file must be the one its rank saved; restore the original files")
        archive_name.check_saved_names(source, [root / f.path for f in files])  # renamed to another rank's name
        hints = Hints(lora_meta=_lora_meta(source, root) if source.is_file(root / LORA_META) else None)
        return Scan(
            format=self.name,
            root=str(root),
            files=files,
            hf_dir=base.config_dir(source, (root,)),
            world_size=world,
            notes=tuple(notes),
            hints=hints,
        )

    def open(self, source: Source, scan: Scan, file: InputFile) -> OpenedFile:
        saved = state_dicts.read_rank_file(source, Path(scan.root) / file.path)
        meshes = MeshCache(file.rank, scan.world_size, saved.read_ints)
        opened = OpenedFile(fragments=[], skipped=[], layout={})
        strided = {}
        for key, value in saved.state.items():
            blocks = state_dicts.local_blocks(key, value, meshes)  # meshes checked before anything is read
            if not blocks or key.endswith("_extra_state"):
                opened.skipped.append(key)
                continue
            kind = state_dicts.describe(key, value, meshes)
            opened.layout[kind] = opened.layout.get(kind, 0) + 1
            for block in blocks:
                opened.fragments.append(_fragment(key, block, file.index, saved))
                if not block.ref.contiguous:  # torch.save keeps a view's strides: read through a mapped view
                    strided[(key, block.offsets)] = block.ref
        opened.views.update(torch_save.mapped_views(source, saved.path, saved.storage_offsets, strided))
        return opened


def _fragment(key: str, block: state_dicts.Block, index: int, saved: state_dicts.RankFile) -> Fragment:
    ref = block.ref
    return Fragment(
        name=_clean(key),
        dtype=dtypes.code_of(ref.storage.dtype),
        global_shape=block.global_shape,
        offsets=block.offsets,
        lengths=ref.size,
        file_index=index,
        byte_offset=saved.file_offset(ref) if ref.contiguous else -1,
        key=key,
    )


def _check_ranks(root: Path, world: int, ranks: set[int]) -> None:
    """The rank numbers present are exactly 0..world-1; the world size of the names is never enumerated
    (`model_world_size_99999999999_rank_0.pt` is one file, not a hundred billion missing ones)."""
    extra = sorted(r for r in ranks if r >= world)
    if extra:
        raise InputError(f"{root}: unexpected rank files for ranks {_short(extra)} (world size is {world})")
    if len(ranks) < world:
        missing, r = [], 0
        while len(missing) < 8 and r < world:  # at most len(ranks) + 8 steps
            if r not in ranks:
                missing.append(r)
            r += 1
        more = world - len(ranks) - len(missing)
        shown = ", ".join(map(str, missing)) + (f" and {more:,} more" if more else "")
        raise InputError(f"{root}: rank files missing for ranks {shown} of world size {world:,}")


def _check_config(source: Source, root: Path, world: int) -> list[str]:
    config = root / "fsdp_config.json"
    if not source.exists(config):  # a link counts: reading it says what is wrong with it
        return [f"fsdp_config.json is missing: world size {world} inferred from the file names"]
    try:
        saved = source.read_json(config, tree.MARKER_CAP, "fsdp_config.json")["world_size"]
    except (KeyError, TypeError):
        raise InputError(f"{config} is not valid JSON with a world_size: fix or remove it") from None
    if saved != world:
        raise InputError(f"{config} says world_size {saved} but the rank files are for world size {world}")
    return []


def _lora_meta(source: Source, root: Path) -> dict:
    meta = source.read_json(root / LORA_META, tree.MARKER_CAP, LORA_META)
    if not isinstance(meta, dict):
        raise InputError(f"{root / LORA_META} is not a JSON object")
    return meta


def _clean(key: str) -> str:
    for segment in WRAPPER_SEGMENTS:
        key = key.replace(segment, "")
    return key


def _short(ranks: list[int]) -> str:
    shown = ", ".join(map(str, ranks[:8]))
    return shown + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")

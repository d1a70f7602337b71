"""DeepSpeed ZeRO checkpoints (engine.save_checkpoint: HF Trainer, TRL, LLaMA-Factory, OpenRLHF), stages 0-3.

The weights are the fp32 masters by default (what zero_to_fp32.py gives): each optimizer file holds its
rank's partition of the flat fp32 buffers (zero.py: where each parameter's elements sit), so its
fragments are flat element ranges that may start mid-row. Only those master partitions are read, at their
byte offsets: the Adam moments beside them never are. Frozen parameters and buffers come from the model
states in their training dtype. `--weights module` takes the 16-bit module weights instead (stages 0-2:
whole in mp_rank_00_model_states.pt; no optimizer byte read). Stage 0 saves hold the module only.

Pickles are read by the restricted reader: DeepSpeed's classes in them (LossScaler, ZeroStageEnum,
fragment_address) become inert records. deepspeed is never imported.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from distmerge import dtypes
from distmerge.errors import InputError, LayoutError
from distmerge.formats.base import FormatDefaults, Fragment, Hints, InputFile, OpenedFile, Scan, input_file
from distmerge.formats.deepspeed import layout as ds
from distmerge.formats.deepspeed.zero import Piece, flat_pieces, stage3_pieces
from distmerge.formats.torch_private import archive_name, torch_save
from distmerge.formats.torch_private.restricted import TensorRef
from distmerge.input import tree
from distmerge.input.source import Source

INERT = (*torch_save.TRAINING_MODULES, "deepspeed")
OPTIM_KEY = "optimizer_state_dict"
Shapes = tuple[tuple[str, tuple[int, ...]], ...]


@dataclass(frozen=True, kw_only=True)
class _State:
    """What rank 0 read from the model states: the parameter order every optimizer file follows."""

    stage3: bool
    masters: bool  # fp32 masters from the optimizer files; else the module's weights
    groups: tuple[Shapes, ...]  # param_shapes: trainable parameters per group, in flat-buffer order
    frozen: Shapes  # frozen_param_shapes
    buffers: tuple[str, ...]
    shared: tuple[str, ...]  # shared_params: names that alias another parameter (tied weights)
    round_robin: bool  # round_robin_gradients: param_slice_mappings do not describe the partitions
    world: int  # data-parallel ranks (optimizer files)
    global_steps: int | None
    roles: dict[str, tuple[str, int]]  # file -> ("model" | "optim", its data-parallel rank)


class DeepSpeedFormat(FormatDefaults):
    name = "deepspeed"
    order = 15
    help = "DeepSpeed ZeRO 0-3 saves (latest + global_stepN/): HF Trainer, TRL, OpenRLHF"
    options = (ds.TAG, ds.WEIGHTS)

    def detect(self, source: Source) -> bool:
        return ds.looks_like(source, source.root)

    def explain(self, source: Source) -> str | None:
        return ds.explain(source)

    def scan(self, source: Source, options: Mapping[str, Any]) -> Scan:
        root = source.root
        save = ds.tag_dir(source, root, options)
        models, optims = _rank_files(source, save)
        ds.check_own_files(source, save, models, optims)  # before any is read: no link out, no copy of another's
        first = _model_states(source, save / models[0])
        stage3 = ds.MODEL_STATES.match(models[0])[1] is not None
        masters = _use_masters(save, options.get(ds.WEIGHTS.dest), stage3, first, optims)
        paths = models + (optims if masters else [])
        roles = {p: ("model", _rank_of(p, ds.MODEL_STATES, 1)) for p in models}
        roles |= {p: ("optim", _rank_of(p, ds.OPTIM_STATES, 1)) for p in optims if masters}
        state = _State(stage3=stage3, masters=masters, groups=_groups(first, save / models[0]),
                       frozen=_shapes(first.get("frozen_param_shapes") or {}),
                       buffers=tuple(first.get("buffer_names") or ()), shared=tuple(first.get("shared_params") or ()),
                       round_robin=_round_robin(first),
                       world=len(optims) or len(models), global_steps=first.get("global_steps"), roles=roles)
        world = first.get("dp_world_size")
        return Scan(format=self.name, root=str(save), hf_dir=ds.hf_dir_near(source, save, root),
                    files=tuple(_expected_reads(input_file(source, save, i, p, rank=roles[p][1]), state)
                                for i, p in enumerate(paths)),
                    world_size=world if isinstance(world, int) and world > 0 else state.world,
                    notes=tuple(_notes(save, state)), state=state,
                    hints=Hints(lora_meta=_lora_meta(source, root, save)),
                    not_model_files=ds.TRAINER_FILES)

    def open(self, source: Source, scan: Scan, file: InputFile) -> OpenedFile:
        state: _State = scan.state
        path = Path(scan.root) / file.path
        saved = torch_save.read(source, path, INERT)
        role, rank = state.roles[file.path]
        if not isinstance(saved.value, dict):
            raise InputError(f"{file.path} is not a DeepSpeed checkpoint file (no state dict inside)")
        opened = _open_optim(saved, file, rank, state) if role == "optim" else _open_model(saved, file, rank, state)
        archive_name.check_saved_name(source, path, state.roles)  # after the checks that name another run or partition
        return opened


def _expected_reads(file: InputFile, state: _State) -> InputFile:
    """With masters, an optimizer file is read for its fp32 partition only (beside Adam's two moments of the same
    size: a third), and a model-states file for its frozen fragments only (the module is not read): readers
    are spread by these bytes, not by file sizes."""
    if not state.masters:
        return file
    if state.roles[file.path][0] == "optim":
        return replace(file, reads=file.size // 3)
    frozen = sum(4 * math.prod(shape) for _, shape in state.frozen) // (state.world if state.stage3 else 1)
    return replace(file, reads=min(file.size, frozen))


def _use_masters(save: Path, asked: str | None, stage3: bool, first: dict, optims: list[str]) -> bool:
    """Masters unless the user asks for the module, or the save is ZeRO stage 0 (no partitioned optimizer:
    its fp32 copies are saved without parameter names, so the module is the model)."""
    if asked == "module" and stage3:
        raise InputError(f"{save}: a ZeRO-3 save keeps no whole module weights; merge the masters "
                         "(leave out --weights)")
    if first.get("param_shapes") is None:
        return False
    if asked != "module" and not optims:
        raise InputError(f"{save} has no *_optim_states.pt files, which hold the fp32 master weights: copy them, or "
                         "pass --weights module to merge the 16-bit module weights")
    return asked != "module"


def _rank_files(src: Source, save: Path) -> tuple[list[str], list[str]]:
    names = src.listdir(save)
    if any(ds.EXPERT_FILES.match(n) for n in names):
        raise InputError(f"{save} holds DeepSpeed-MoE expert-parallel files (expp_rank_*): not supported yet")
    models = [n for n in names if ds.MODEL_STATES.match(n)]
    optims = [n for n in names if ds.OPTIM_STATES.match(n)]
    if any(ds.MODEL_STATES.match(n)[2] != "00" for n in models) or any(
            ds.OPTIM_STATES.match(n)[2] != "00" for n in optims):
        raise InputError(f"{save} was saved with tensor or pipeline parallelism (mp_rank_01...): not supported yet")
    models.sort(key=lambda n: _rank_of(n, ds.MODEL_STATES, 1))
    optims.sort(key=lambda n: _rank_of(n, ds.OPTIM_STATES, 1))  # by rank number: rank_10 after rank_9
    _check_complete(save, [_rank_of(n, ds.OPTIM_STATES, 1) for n in optims], "optimizer")
    if len(models) > 1:
        _check_complete(save, [_rank_of(n, ds.MODEL_STATES, 1) for n in models], "model states")
        if optims and len(optims) != len(models):
            raise InputError(f"{save}: {len(models)} model states files but {len(optims)} optimizer files")
    return models, optims


def _rank_of(name: str, pattern, group: int) -> int:
    found = pattern.match(name)[group]
    return int(found) if found is not None else -1


def _check_complete(save: Path, ranks: list[int], what: str) -> None:
    missing = sorted(set(range(len(ranks))) - set(ranks))
    if missing or len(set(ranks)) != len(ranks):
        raise InputError(f"{save}: {what} files of data-parallel ranks {missing or sorted(ranks)} are missing or "
                         "doubled; copy the whole save")


def _model_states(src: Source, path: Path) -> dict:
    value = torch_save.read(src, path, INERT).value
    if not isinstance(value, dict) or "param_shapes" not in value:
        raise InputError(f"{path} is not a DeepSpeed model states file (no param_shapes)")
    return value


def _shapes(mapping: Any) -> Shapes:
    return tuple((str(n), tuple(int(d) for d in s)) for n, s in dict(mapping).items())


def _groups(first: dict, path: Path) -> tuple[Shapes, ...]:
    """Each group's parameters in the order of its flat buffer: param_shapes' order, which under
    round_robin_gradients is the round-robin order the buffer was flattened in."""
    shapes = first["param_shapes"]
    if shapes is None:
        return ()  # no ZeRO optimizer (stage 0): the module is the whole model
    groups = shapes if isinstance(shapes, list) else [shapes]  # older saves: one dict for all groups
    if not all(isinstance(g, dict) for g in groups):
        raise InputError(f"{path}: param_shapes is neither a dict nor a list of dicts")
    return tuple(_shapes(g) for g in groups)


def _round_robin(first: dict) -> bool:
    zero = (first.get("ds_config") or {}).get("zero_optimization") or {}
    return isinstance(zero, dict) and bool(zero.get("round_robin_gradients"))


def _notes(save: Path, state: _State) -> list[str]:
    source = "fp32 master weights from the optimizer files" if state.masters else "the module's weights"
    stage = "ZeRO-3" if state.stage3 else "ZeRO 0-2"
    notes = [f"DeepSpeed {stage} save {save.name}, {state.world} data-parallel rank(s): {source}"]
    if not state.groups:
        notes.append("ZeRO stage 0: the optimizer's fp32 copies carry no parameter names; merged the module")
    return notes


def _lora_meta(src: Source, root: Path, save: Path) -> dict | None:
    """A PEFT run under the HF Trainer saves adapter_config.json (r, lora_alpha) beside the save."""
    for folder in (root, save.parent):
        path = folder / "adapter_config.json"
        if src.is_file(path):
            meta = src.read_json(path, tree.MARKER_CAP, "adapter_config.json")  # bounded, no link out
            return meta if isinstance(meta, dict) else None
    return None


# -- model states: buffers, frozen parameters, or the whole module ----------------------------------------
def _open_model(saved: torch_save.SavedObject, file: InputFile, rank: int, state: _State) -> OpenedFile:
    value = saved.value
    if state.global_steps is not None and value.get("global_steps") not in (None, state.global_steps):
        raise LayoutError(f"{file.path} was saved at step {value.get('global_steps')}, not {state.global_steps} "
                          "like the other files: a file of another save")
    opened = OpenedFile(fragments=[], layout={})
    frozen = dict(state.frozen)
    trainable = {n for g in state.groups for n, _ in g}
    for key, ref in (value.get("module") or {}).items():
        # With masters, the module gives what the optimizer does not hold: buffers, and below ZeRO-3 the
        # frozen parameters (ZeRO-1 lists them nowhere else). Tied aliases are the parameter they name.
        if state.masters and (key in trainable or key in state.shared or (state.stage3 and key not in state.buffers)):
            continue
        if isinstance(ref, TensorRef):
            _add(opened, _whole(key, ref, saved, file), "module tensor")
    if state.stage3:  # frozen parameters are partitioned like the others: rank r holds its ceil(n/W) elements
        for key, ref in (value.get("frozen_param_fragments") or {}).items():
            if key in frozen and isinstance(ref, TensorRef):
                pieces, _ = stage3_pieces([key], [_numel(frozen[key])], rank, state.world)
                for piece in pieces:
                    _add(opened, _piece(piece, frozen[key], ref, saved, file, 0), "ZeRO-3 frozen partition")
    return opened


def _add(opened: OpenedFile, frag: Fragment, kind: str) -> None:
    opened.fragments.append(frag)
    opened.layout[kind] = opened.layout.get(kind, 0) + 1


def _whole(key: str, ref: TensorRef, saved: torch_save.SavedObject, file: InputFile) -> Fragment:
    if not ref.contiguous:
        raise LayoutError(f"{file.path}: {key} is saved non-contiguous, which distmerge cannot read in place")
    code = dtypes.code_of(ref.storage.dtype)
    start = saved.storage_offsets[ref.storage.key] + ref.storage_offset * dtypes.itemsize(code)
    return Fragment(name=key, dtype=code, global_shape=ref.size, offsets=(0,) * len(ref.size), lengths=ref.size,
                    file_index=file.index, byte_offset=start, key=key)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _piece(piece: Piece, shape: tuple[int, ...], flat: TensorRef, saved: torch_save.SavedObject, file: InputFile,
           base: int) -> Fragment:
    """A flat element range of a parameter, read from `flat` (a 1-D partition) at element `piece.local - base`."""
    code = dtypes.code_of(flat.storage.dtype)
    at = saved.storage_offsets[flat.storage.key] + (flat.storage_offset + piece.local - base) * dtypes.itemsize(code)
    return Fragment(name=piece.name, dtype=code, global_shape=shape, offsets=(piece.start,), lengths=(piece.count,),
                    file_index=file.index, byte_offset=at, key=piece.name, flat=True)


# -- optimizer files: the fp32 master partitions ----------------------------------------------------------
def _open_optim(saved: torch_save.SavedObject, file: InputFile, rank: int, state: _State) -> OpenedFile:
    optim = saved.value.get(OPTIM_KEY)
    if not isinstance(optim, dict):
        raise InputError(f"{file.path} holds no {OPTIM_KEY}: not a DeepSpeed optimizer file")
    _check_partition_count(optim, file, state)
    opened = OpenedFile(fragments=[], layout={})
    if state.stage3:
        _stage3_masters(optim, saved, file, rank, state, opened)
    else:
        _flat_masters(optim, saved, file, rank, state, opened)
    return opened


def _check_partition_count(optim: dict, file: InputFile, state: _State) -> None:
    counts = optim.get("partition_count")
    counts = counts if isinstance(counts, list) else [counts]
    if any(isinstance(c, int) and c != state.world for c in counts):
        raise LayoutError(f"{file.path} was saved by {counts[0]} data-parallel ranks, this save has {state.world} "
                          "optimizer files: a file of another run")


def _flat_masters(optim: dict, saved, file: InputFile, rank: int, state: _State, opened: OpenedFile) -> None:
    partitions = optim.get("single_partition_of_fp32_groups")
    if not isinstance(partitions, list) or len(partitions) != len(state.groups):
        raise LayoutError(f"{file.path}: {len(state.groups)} parameter groups in the model states but not as "
                          "many fp32 partitions here: a file of another run")
    alignment = optim.get("param_alignment_paddings") or [None] * len(partitions)
    mappings = list(optim.get("param_slice_mappings") or [])
    for group, flat, pads in zip(state.groups, partitions, alignment, strict=True):
        names, shapes = [n for n, _ in group], dict(group)
        numels = [_numel(s) for _, s in group]
        paddings = list(pads) if pads else [0] * len(names)
        _check_flat(flat, file)
        pieces = flat_pieces(names, numels, paddings, rank, state.world, flat.size[0])
        mapping = mappings.pop(0) if mappings else None
        if not state.round_robin:  # under round_robin_gradients DeepSpeed records the unshuffled order there
            _check_mappings(pieces, mapping, file, lambda r, a=(names, numels, paddings), n=flat.size[0]: {
                p.name: (p.local, p.count) for p in flat_pieces(*a, r, state.world, n)}, state.world)
        for piece in pieces:
            _add(opened, _piece(piece, shapes[piece.name], flat, saved, file, 0), "ZeRO-1/2 fp32 partition")


def _stage3_masters(optim: dict, saved, file: InputFile, rank: int, state: _State, opened: OpenedFile) -> None:
    subgroups = optim.get("fp32_flat_groups")
    if not isinstance(subgroups, list) or not all(isinstance(t, TensorRef) for t in subgroups):
        raise LayoutError(f"{file.path}: no fp32_flat_groups: not a ZeRO-3 optimizer file")
    params = [p for g in state.groups for p in g]
    shapes = dict(params)
    pieces, total = stage3_pieces([n for n, _ in params], [_numel(s) for _, s in params], rank, state.world)
    ends, at = [], 0
    for flat in subgroups:
        _check_flat(flat, file)
        at += flat.size[0]
        ends.append(at)
    if at < total:
        raise LayoutError(f"{file.path} holds {at} master elements where the parameters need {total}: a file of "
                          "another run")
    for piece in pieces:
        for part in _split_at(piece, ends):
            g = next(i for i, end in enumerate(ends) if part.local < end)
            _add(opened, _piece(part, shapes[part.name], subgroups[g], saved, file, ends[g] - subgroups[g].size[0]),
                 "ZeRO-3 fp32 partition")


def _split_at(piece: Piece, ends: list[int]) -> list[Piece]:
    """A piece that straddles the end of one fp32 sub-group continues at the start of the next."""
    out, piece_end = [], piece.local + piece.count
    local, start = piece.local, piece.start
    for end in ends:
        if local < end:
            count = min(piece_end, end) - local
            out.append(Piece(name=piece.name, start=start, count=count, local=local))
            local, start = local + count, start + count
            if local >= piece_end:
                break
    return out


def _check_mappings(pieces: list[Piece], mapping: Any, file: InputFile, layout_of, world: int) -> None:
    """DeepSpeed's own record of where each parameter sits in this partition, when the file has one."""
    if not isinstance(mapping, dict):
        return
    saved = {str(n): (getattr(a, "start", None), getattr(a, "numel", None)) for n, a in mapping.items()}
    found = {p.name: (p.local, p.count) for p in pieces}
    if saved != found and (owner := ds.partition_owner(saved, layout_of, world)) is not None:
        raise LayoutError(f"{file.path} holds data-parallel rank {owner}'s partition (its param_slice_mappings say "
                          f"so), not rank {file.rank}'s as its name says: a rank file replaced by another rank's; "
                          "restore the original files")
    if saved != found:
        wrong = next(n for n in sorted(set(saved) | set(found)) if saved.get(n) != found.get(n))
        raise LayoutError(f"{file.path}: {wrong} is at {found.get(wrong)} (start, numel) by param_shapes but at "
                          f"{saved.get(wrong)} by the file's param_slice_mappings: a parameter order distmerge does "
                          "not know; please report it")


def _check_flat(flat: Any, file: InputFile) -> None:
    if not isinstance(flat, TensorRef) or len(flat.size) != 1 or not flat.contiguous:
        raise LayoutError(f"{file.path}: an fp32 partition is not a flat tensor: not a DeepSpeed ZeRO file")

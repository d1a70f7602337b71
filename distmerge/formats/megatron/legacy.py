"""Megatron-LM's legacy checkpoints (`--ckpt-format torch`): one torch.save per model-parallel rank.

    iter_0001000/mp_rank_{tp:02d}[_{pp:03d}][_{ep:03d}]/model_optim_rng.pt
        {"args": Namespace, "iteration", "checkpoint_version", "rng_state", "optimizer", ...,
         "model": {name: local tensor}          or "model0", "model1", ... (virtual pipeline chunks)}

Each file holds its TP rank's slice of every parameter (split dimension in layout.py), the layers of
its pipeline stage numbered from 0 per stage (and per virtual chunk), and its EP rank's experts numbered
from 0. Rank 0's scan reads the pickles (not the tensors) of one file per stage to learn the layer
offsets; each reader then names its fragments with global layer and expert numbers and global offsets,
so the plan sees Megatron's global tensors. `mp_rank_00_001` means PP=2 or EP=2: `args` tells which.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from distmerge import dtypes
from distmerge.errors import LayoutError
from distmerge.formats import copies
from distmerge.formats.base import FormatDefaults, Fragment, Hints, InputFile, OpenedFile, Scan, input_file
from distmerge.formats.megatron import layout as mg
from distmerge.formats.megatron.grid import Grid, model_chunks, resolve_grid
from distmerge.formats.torch_private import torch_save
from distmerge.formats.torch_private.restricted import TensorRef
from distmerge.input.source import Source


@dataclass(frozen=True, kw_only=True)
class _State:
    """What scan learnt that each reader needs: the grid, where each (stage, chunk) starts, the save."""

    grid: Grid
    layer_offsets: dict[tuple[int, int], int]  # (stage, chunk) -> global number of its first layer
    layer_counts: dict[tuple[int, int], int]
    iteration: int | None


class MegatronLegacyFormat(FormatDefaults):
    name = "megatron"
    order = 20
    help = "Megatron-LM mp_rank_* files"
    options = (mg.ITERATION,)

    def detect(self, source: Source) -> bool:
        save = mg.looks_like(source)
        return save is not None and source.is_dir(save) and any(mg.RANK_DIR.match(n) for n in source.listdir(save))

    def explain(self, source: Source) -> str | None:
        return mg.explain(source)

    def scan(self, source: Source, options: Mapping[str, Any]) -> Scan:
        root = source.root
        save = mg.save_dir(source, root, options)
        grid = resolve_grid(source, save)
        if copy := copies.first_copy(source, [save / p for p in grid.paths]):  # each rank's own, not another's
            raise LayoutError(f"{save}: {copy[1].relative_to(save)} is the same file as {copy[0].relative_to(save)} "
                              "(a copy or a link): each rank folder must hold its own rank's file; restore them")
        offsets, counts, stage_bytes = _layer_offsets(source, save, grid)
        files = tuple(_expected_reads(input_file(source, save, i, path, rank=i), grid, stage_bytes)
                      for i, path in enumerate(grid.paths))
        state = _State(grid=grid, layer_offsets=offsets, layer_counts=counts,
                       iteration=int(m[1]) if (m := mg.ITERATION_DIR.match(save.name)) else None)
        notes = [f"Megatron legacy checkpoint {save.name}: {grid.describe()}"]
        return Scan(format=self.name, root=str(save), files=files, hf_dir=mg.hf_dir_near(source, save, root),
                    world_size=len(files), notes=tuple(notes), state=state,
                    hints=Hints(naming="megatron", fc1_shards=grid.tp, expert_fc1_shards=grid.etp))

    def open(self, source: Source, scan: Scan, file: InputFile) -> OpenedFile:
        path = Path(scan.root) / file.path
        saved = torch_save.read(source, path)
        state: _State = scan.state
        tp, pp, ep = state.grid.coords[file.path]
        _check_same_save(saved.value, state, file.path)
        _check_saving_rank(saved.value, state.grid, file.path)
        opened = OpenedFile(fragments=[], layout={})
        for chunk, tensors in enumerate(model_chunks(saved.value, path)):
            _check_layer_count(tensors, state.layer_counts[(pp, chunk)], file.path, pp)
            offset = state.layer_offsets[(pp, chunk)]
            experts = _local_expert_count(tensors)
            te_mla = any(k.endswith(mg.TE_MLA_MARK) for k in tensors)
            for key, value in tensors.items():
                if key.endswith("_extra_state") or not isinstance(value, TensorRef):
                    opened.skipped.append(key)
                    continue
                name = mg.renumber(key, offset, ep * experts)
                frag = _fragment(name, key, value, saved, file, tp, scan.hints, te_mla)
                opened.fragments.append(frag)
                split = mg.tp_split_dim(name, tuple(value.size), te_mla)
                kind = "replicated" if frag.global_shape == frag.lengths else f"TP split on dim {split}"
                opened.layout[kind] = opened.layout.get(kind, 0) + 1
        return opened


def _check_layer_count(state: dict[str, Any], expected: int, path: str, pp: int) -> None:
    """Every file of a pipeline stage holds the same layers (scan counted them in the stage's TP rank 0)."""
    layers = len({n for k in state if (n := mg.layer_number(k)) is not None})
    if layers != expected:
        raise LayoutError(f"{path} holds {layers} layers where the other files of pipeline stage {pp} hold "
                          f"{expected}: a file of another save")


def _check_same_save(value: Any, state: _State, path: str) -> None:
    """A rank file copied in from another run or save says so: its args (parallel sizes) or iteration."""
    args = value.get("args") if isinstance(value, dict) else None
    saved_at = value.get("iteration") if isinstance(value, dict) else None
    if isinstance(saved_at, int) and state.iteration is not None and saved_at != state.iteration:
        raise LayoutError(f"{path} was saved at iteration {saved_at}, not {state.iteration} like this "
                          "folder: a file of another save; use one save's files only")
    for what, size in state.grid.sizes.items():
        saved = getattr(args, what, None)
        if isinstance(saved, int) and saved != size:
            raise LayoutError(f"{path} was saved by another run: its args say {what}={saved}, this save has "
                              f"{size} ({state.grid.describe()}); use one save's files only")


def _check_saving_rank(value: Any, grid: Grid, path: str) -> None:
    """A rank file in its own folder: Megatron-LM's args record the global rank that saved it (`rank`, from
    RANK), and its rank order (parallel_state.RankGenerator). TP is innermost in every order Megatron-LM uses
    (tp-cp-ep-dp-pp by default; tp-pp-dp or tp-cp-ep-pp-dp with --use-tp-pp-dp-mapping), so its TP rank is
    rank % TP; PP is outermost only in the default order, where its PP rank is rank // (world_size / PP). TP
    shards of one tensor have equal shapes: without this, files exchanged between TP folders merge a wrong
    model. Args without a rank (megatron-core's own tools, other trainers), or with an encoder's ranks before
    the decoder's, are not checked, nor is rank 0: Megatron-LM's checkpoint converter (tools/checkpoint) saves
    every rank's file from one process, each recording rank 0. A swap is still found: the other file of the
    pair records a rank other than 0 (a copy is found by copies.first_copy)."""
    args = value.get("args") if isinstance(value, dict) else None
    rank, world = getattr(args, "rank", None), getattr(args, "world_size", None)
    encoder = any(getattr(args, f"encoder_{k}_model_parallel_size", 0) for k in ("tensor", "pipeline"))
    if not _count(rank) or rank == 0 or encoder:
        return
    tp, pp, ep = grid.coords[path]
    saved_pp = pp
    if getattr(args, "use_tp_pp_dp_mapping", None) is False and _count(world) and world % grid.pp == 0 and rank < world:
        saved_pp = rank // (world // grid.pp)
    if (rank % grid.tp, saved_pp) != (tp, pp):
        own = grid.path_of(rank % grid.tp, saved_pp, ep)
        raise LayoutError(f"{Path(path).parent.name}/ holds the file of {Path(own).parent.name}/: its args say rank "
                          f"{rank} saved it (TP rank {rank % grid.tp}, PP rank {saved_pp}), which writes "
                          f"{Path(own).parent.name}; rank files were exchanged or copied between folders; restore them")


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _fragment(name: str, key: str, ref: TensorRef, saved: torch_save.SavedObject, file: InputFile, tp: int,
              hints: Hints, te_mla: bool = False) -> Fragment:
    if not ref.contiguous:
        raise LayoutError(f"{file.path}: {key} is saved non-contiguous, which distmerge cannot read in place")
    code = dtypes.code_of(ref.storage.dtype)
    shape, offsets = list(ref.size), [0] * len(ref.size)
    dim = mg.tp_split_dim(name, tuple(ref.size), te_mla)
    size = hints.expert_fc1_shards if mg.is_expert(name) else hints.fc1_shards
    if dim is not None and size > 1:
        shape[dim] *= size
        offsets[dim] = (tp % size) * ref.size[dim]
    start = saved.storage_offsets[ref.storage.key] + ref.storage_offset * dtypes.itemsize(code)
    return Fragment(name=name, dtype=code, global_shape=tuple(shape), offsets=tuple(offsets), lengths=ref.size,
                    file_index=file.index, byte_offset=start, key=key)


def _local_expert_count(state: dict[str, Any]) -> int:
    numbers = {n for k in state if (n := mg.expert_number(k)) is not None}
    return max(numbers) + 1 if numbers else 0


def _layer_offsets(src: Source, save: Path, grid: Grid) -> tuple[dict[tuple[int, int], int], dict[tuple[int, int], int],
                                                     dict[int, tuple[int, int, int]]]:
    """Global number of each (stage, chunk)'s first layer, from the layer counts in one file per stage; and
    each stage's tensor bytes per file as (expert, TP-split, replicated), for _expected_reads.

    Virtual pipeline order: chunk 0 of stages 0..PP-1, then chunk 1 of stages 0..PP-1, ... A save whose
    numbers are already global (verl rewrites them before saving) keeps them.
    """
    counts: dict[tuple[int, int], list[int]] = {}
    stage_bytes: dict[int, tuple[int, int, int]] = {}
    for pp in range(grid.pp):
        path = save / grid.path_of(0, pp, 0)
        kinds = [0, 0, 0]
        for chunk, state in enumerate(model_chunks(torch_save.read(src, path).value, path)):
            counts[(chunk, pp)] = sorted({n for k in state if (n := mg.layer_number(k)) is not None})
            te_mla = any(k.endswith(mg.TE_MLA_MARK) for k in state)
            for key, ref in state.items():
                if isinstance(ref, TensorRef):
                    split = mg.tp_split_dim(key, tuple(ref.size), te_mla) is not None
                    kind = 0 if mg.is_expert(key) else 1 if split else 2
                    kinds[kind] += math.prod(ref.size) * dtypes.itemsize(dtypes.code_of(ref.storage.dtype))
        stage_bytes[pp] = (kinds[0], kinds[1], kinds[2])
    order = sorted(counts)
    sizes = {(pp, chunk): len(layers) for (chunk, pp), layers in counts.items()}
    if all(not layers or layers[0] == 0 for layers in counts.values()):
        offsets, total = {}, 0
        for chunk, pp in order:
            offsets[(pp, chunk)] = total
            total += len(counts[(chunk, pp)])
        return offsets, sizes, stage_bytes
    flat = [n for key in order for n in counts[key]]
    if flat != list(range(len(flat))):
        raise LayoutError(f"{save}: the layer numbers of the pipeline stages are neither local nor one global "
                          f"sequence ({_ranges(counts)}): files from different runs?")
    return {(pp, chunk): 0 for chunk, pp in order}, sizes, stage_bytes


def _expected_reads(file: InputFile, grid: Grid, stage_bytes: dict[int, tuple[int, int, int]]) -> InputFile:
    """What a merge reads of one rank file: its experts; the TP-split dense tensors only in expert rank 0's file
    (every expert rank saves them again, and the plan keeps the lowest file's copy); the replicated ones only in
    TP rank 0's file of expert rank 0. Readers are spread by these bytes: by file size, at DeepSeek-V3's TP8 x
    PP16 x EP64 the readers of EP rank 0 files would read 26% more than the mean (tests/bench/bench_scale.py)."""
    tp, pp, ep = grid.coords[file.path]
    expert, split, replicated = stage_bytes[pp]
    return replace(file, reads=expert + (split if ep == 0 else 0) + (replicated if ep == 0 and tp == 0 else 0))


def _ranges(counts: dict[tuple[int, int], list[int]]) -> str:
    return "; ".join(f"stage {pp} chunk {c}: {v[0]}-{v[-1]}" if v else f"stage {pp} chunk {c}: none"
                     for (c, pp), v in sorted(counts.items()))

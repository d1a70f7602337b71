"""How megatron-core's torch_dist save cuts a GPT's global tensors into chunks, and which training rank saves each:
what `distmerge import --to megatron` writes (the reading side is dist.py).

Facts from megatron-core 0.16.1's own saves of GPTModel (tests/fixtures/make_megatron.py; its `.metadata` read):

    decoder.layers.{i}.X            stacked: key decoder.layers.X, global shape (num_layers, *shape), layer i
                                    at offset i on the first axis (TransformerBlock.sharded_state_dict)
    decoder.layers.{i}.mlp.experts.local_experts.{e}.X
                                    (global expert e) stacked again: key decoder.layers.mlp.experts.experts.X,
                                    global shape (num_layers, num_experts, *shape), at offsets (i, e)
                                    (SequentialMLP.sharded_state_dict; TEGroupedMLP saves the same keys)
    TP-split tensors                layout.TP_SPLIT_DIMS: dim 0 (column-parallel, the vocabulary) or 1 (row-
                                    parallel); TP rank r holds the r-th of TP equal runs; a tensor of `parts`
                                    runs (linear_fc1's [gate; up]) splits each run so: r's chunks are gate_r and
                                    up_r (apply_swiglu_sharded_factory)
    replicated tensors (norms)      one chunk, saved by TP rank 0 (replica_id 0)
    expert parallelism              EP rank r holds experts [r E/EP, (r+1) E/EP) and saves their chunks, split
                                    over the expert TP (= TP, megatron-core's default) as the dense layers are;
                                    what is not an expert is saved by EP (= data-parallel) rank 0
    pipeline stages                 layer i on the pipeline rank pipeline.layer_ranks gives (i // (num_layers /
                                    PP) for an even split without virtual stages; interleaved with --vpp, the
                                    first and last rank's share set with uneven stages); the embedding on the
                                    first rank, the output layer and final norm on the last
    {module}._extra_state           a ShardedObject per layer of each linear module (the TP-split ones), key
                                    `decoder.layers.{module}._extra_state/shard_{i}_{num_layers}`, saved by TP
                                    rank 0 as torch.save of [None] (what the local spec's save writes); an
                                    expert's `decoder.layers.mlp.experts.experts.{fc}._extra_state/shard_{i}.{e}_
                                    {num_layers}.{num_experts}`, saved by its EP rank
    files                           `__{rank}_{k}.distcp`, rank = tp + TP x ep + TP x EP x pp (megatron-core's
                                    default order tp-cp-ep-dp-pp, data parallel size EP): what a rank saved
    layers saved alone              a decoder whose layers differ (DeepSeek-V3's first dense layers before the MoE
                                    ones: moe_layer_freq a list, TransformerBlock's non_homogeneous_layers) saves
                                    each layer under its own keys, unstacked: decoder.layers.{i}.X, an expert's
                                    decoder.layers.{i}.mlp.experts.experts.X of global shape (num_experts, *shape)
                                    at offset e, _extra_state `shard_0_1` (an expert's `shard_{e}_{num_experts}`);
                                    multi-token prediction layers (mtp.layers.{j}.*, on the last stage) always so
                                    (tests/fixtures/make_megatron_mla.py's saves)

The file names and their contents depend only on the layout (TP, PP, EP), never on how many processes write them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from distmerge.errors import ConfigError
from distmerge.formats.megatron.layout import LAYER, SEQUENTIAL_EXPERT, tp_split_dim

EXTRA_STATE_OBJECT = [None]  # the data of a linear module's _extra_state object as megatron-core saves it (local spec)
EXPERTS_KEY = "mlp.experts.experts."  # where megatron-core 0.16's save puts the stacked experts, after decoder.layers.
MTP_LAYER = re.compile(r"^mtp\.layers\.\d+\.")  # a multi-token prediction layer's tensor (megatron-core's name)


@dataclass(frozen=True, kw_only=True)
class Grid:
    tp: int
    pp: int
    layers: int
    ep: int = 1
    experts: int = 0  # routed experts per MoE layer (0: a dense model)
    layer_ranks: tuple[int, ...]  # the pipeline rank of each layer, by global number (pipeline.layer_ranks)
    per_layer: bool = False  # the decoder's layers are saved each on its own (the docstring's "layers saved alone")

    def stage(self, name: str) -> int:
        """The pipeline stage that holds the tensor `name` (global layer numbers)."""
        if (m := LAYER.match(name)) is not None:
            return self.layer_ranks[int(m[2])]
        return 0 if name.startswith("embedding.") else self.pp - 1

    def ep_rank(self, name: str) -> int:
        """The EP rank that holds the tensor `name`: its expert's (global number), else 0 (the data-parallel
        rank 0 saves what is replicated over EP)."""
        expert = expert_of(name)
        return 0 if expert is None else expert[1] // (self.experts // self.ep)

    def rank(self, tp: int, stage: int, ep: int = 0) -> int:
        return tp + self.tp * ep + self.tp * self.ep * stage


def expert_of(name: str) -> tuple[str, int, str] | None:
    """(the name up to the expert number, the global expert number, the rest) of a SequentialMLP expert's
    tensor, else None."""
    m = SEQUENTIAL_EXPERT.match(name)
    return None if m is None else (m[1], int(m[2]), m[3])


@dataclass(frozen=True, kw_only=True)
class Chunk:
    """One saved chunk: a block of a global tensor (key, offsets, lengths in the stacked tensor), made of rows
    `rows` (and columns `cols`, or all) of the tensor `tensor` (unstacked); saved by training rank `rank`."""

    key: str
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    lengths: tuple[int, ...]
    tensor: str
    rows: tuple[int, int]
    cols: tuple[int, int] | None
    rank: int


@dataclass(frozen=True, kw_only=True)
class ObjectChunk:
    key: str  # the unique key (shard suffix included)
    rank: int


def check_grid(grid: Grid) -> None:
    """The refusals of TP and EP (the pipeline split's are pipeline.check's, made with the grid's layer_ranks)."""
    if grid.tp < 1 or grid.pp < 1:
        raise ConfigError(f"--tp {grid.tp} --pp {grid.pp}: both must be at least 1")
    if grid.ep > 1 and not grid.experts:
        raise ConfigError(f"--ep {grid.ep}: the model has no experts to split (expert parallelism is for MoE "
                          "models); leave --ep out")
    if grid.experts % grid.ep:
        raise ConfigError(f"--ep {grid.ep} does not divide the model's {grid.experts} experts: megatron-core gives "
                          f"each EP rank as many; pick an EP that divides {grid.experts}")


def stacked(name: str, shape: tuple[int, ...], grid: Grid) -> tuple[str, tuple[int, ...], tuple[int, ...]]:
    """(key, global shape, offset prefix) of a tensor in the save: a layer's tensors stacked over the layers, an
    expert's over the layers and the experts."""
    m = LAYER.match(name)
    if m is not None and not grid.per_layer:
        if (expert := expert_of(m[3])) is not None:
            return f"{m[1]}{EXPERTS_KEY}{expert[2][1:]}", (grid.layers, grid.experts, *shape), (int(m[2]), expert[1])
        return f"{m[1]}{m[3][1:]}", (grid.layers, *shape), (int(m[2]),)
    if (expert := expert_of(name)) is not None:  # a layer saved alone: its experts stacked over the experts only
        return alone_experts_key(expert), (grid.experts, *shape), (expert[1],)
    return name, shape, ()


def alone_experts_key(expert: tuple[str, int, str]) -> str:
    """The key of an expert's tensor in a layer saved alone (expert_of's parts): `...mlp.experts.experts.X`."""
    return f"{expert[0].removesuffix('local_experts.')}experts{expert[2]}"


def chunks(name: str, shape: tuple[int, ...], parts: int, grid: Grid) -> list[Chunk]:
    """The chunks of the global tensor `name`, each with the training rank that saves it."""
    key, global_shape, prefix = stacked(name, shape, grid)
    dim = tp_split_dim(name, shape)
    stage, ep = grid.stage(name), grid.ep_rank(name)
    if dim is None:
        return [Chunk(key=key, global_shape=global_shape, offsets=(*prefix, *[0] * len(shape)),
                      lengths=(*[1] * len(prefix), *shape), tensor=name, rows=(0, shape[0]), cols=None,
                      rank=grid.rank(0, stage, ep))]
    runs = parts * grid.tp
    if shape[dim] % runs:
        raise ConfigError(f"--tp {grid.tp} does not divide {name}'s {shape[dim]} "
                          f"{'rows' if dim == 0 else 'columns'}{' in each half' if parts > 1 else ''}: "
                          "pick a TP that divides it")
    step = shape[dim] // runs
    out = []
    for tp in range(grid.tp):
        for part in range(parts):
            start = part * grid.tp * step + tp * step
            offsets, lengths = [0] * len(shape), list(shape)
            offsets[dim], lengths[dim] = start, step
            rows, cols = ((start, start + step), None) if dim == 0 else ((0, shape[0]), (start, start + step))
            out.append(Chunk(key=key, global_shape=global_shape, offsets=(*prefix, *offsets),
                             lengths=(*[1] * len(prefix), *lengths), tensor=name, rows=rows, cols=cols,
                             rank=grid.rank(tp, stage, ep)))
    return out


def extra_state_objects(names: list[str], grid: Grid) -> list[ObjectChunk]:
    """The _extra_state objects of the layers' linear modules (those whose weight TP splits), one per layer, and
    per layer and expert for the experts' (stacked as their weights are)."""
    out = []
    for name in names:
        m = LAYER.match(name)
        if not name.endswith(".weight") or tp_split_dim(name) is None or not (m or MTP_LAYER.match(name)):
            continue
        if m is None or grid.per_layer:
            out.append(ObjectChunk(key=alone_extra_state_key(name, grid), rank=grid.rank(0, grid.stage(name),
                                                                                         grid.ep_rank(name))))
            continue
        layer, module = int(m[2]), m[3][1:].removesuffix(".weight")
        if (expert := expert_of(m[3])) is None:
            key = f"{m[1]}{module}._extra_state/shard_{layer}_{grid.layers}"
        else:
            fc = expert[2][1:].removesuffix(".weight")
            key = f"{m[1]}{EXPERTS_KEY}{fc}._extra_state/shard_{layer}.{expert[1]}_{grid.layers}.{grid.experts}"
        out.append(ObjectChunk(key=key, rank=grid.rank(0, grid.stage(name), grid.ep_rank(name))))
    return out


def alone_extra_state_key(name: str, grid: Grid) -> str:
    """The _extra_state key of a linear module in a layer saved alone: its one shard, an expert's of the experts."""
    if (expert := expert_of(name)) is None:
        return f"{name.removesuffix('.weight')}._extra_state/shard_0_1"
    module = alone_experts_key(expert).removesuffix(".weight")
    return f"{module}._extra_state/shard_{expert[1]}_{grid.experts}"


def file_name(rank: int) -> str:
    return f"__{rank}_0.distcp"


FILE = re.compile(r"^__(\d+)_0\.distcp$")

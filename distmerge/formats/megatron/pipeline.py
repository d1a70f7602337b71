"""Which pipeline rank holds each decoder layer: megatron-core 0.16.1's split of the layers over PP ranks, with
virtual stages (the interleaved schedule, Megatron-LM's --num-virtual-stages-per-pipeline-rank V) and uneven first
and last stages (--decoder-first-pipeline-num-layers, --decoder-last-pipeline-num-layers).

A rank of PP holds V model chunks (model0 .. model{V-1} in Megatron-LM's state dict); chunk v of rank r holds the
layers [offset, offset + count). The formulas are megatron-core's own (transformer/transformer_block.py
get_num_layers_to_build, transformer/transformer_layer.py get_transformer_layer_offset), e.g. 4 layers, PP=2, V=2:

    pp rank 0:  model0 = layer 0    model1 = layer 2
    pp rank 1:  model0 = layer 1    model1 = layer 3

and with uneven stages the first (last) rank holds the given number of layers, V-th of them per chunk, the middle
ranks share the rest equally. In a torch_dist save the layers keep their global numbers whatever chunk holds them
(the keys do not name model{v}): what the split decides is which rank saves a layer, so which file holds it.
The refusals are megatron-core's TransformerConfig checks, and Megatron-LM's (V needs PP > 1), each one line.
"""

from __future__ import annotations

from dataclasses import dataclass

from distmerge.errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class Split:
    """The pipeline split asked for: PP ranks, V virtual stages per rank (None: not interleaved), and the layers
    of the first and last ranks where uneven (None: an even share)."""

    layers: int
    pp: int = 1
    vpp: int | None = None
    first: int | None = None
    last: int | None = None


def layer_ranks(split: Split) -> tuple[int, ...]:
    """The pipeline rank of each layer, by global layer number; ConfigError in one line for a split megatron-core
    refuses."""
    check(split)
    ranks = [-1] * split.layers
    for rank in range(split.pp):
        for stage in range(split.vpp or 1):
            start = offset(split, rank, stage)
            for layer in range(start, start + count(split, rank)):
                ranks[layer] = rank
    assert -1 not in ranks, (split, ranks)  # check() admits only splits whose chunks tile the layers
    return tuple(ranks)


def count(split: Split, rank: int) -> int:
    """Layers per model chunk on `rank` (get_num_layers_to_build)."""
    if split.first is not None and rank == 0:
        per_rank = split.first
    elif split.last is not None and rank == split.pp - 1:
        per_rank = split.last
    else:
        middle, stages = _middle(split)
        per_rank = middle // stages if stages else 0
    return per_rank // (split.vpp or 1)


def offset(split: Split, rank: int, stage: int) -> int:
    """The global number of the first layer of chunk `stage` on `rank` (get_transformer_layer_offset)."""
    vpp = split.vpp or 1
    if split.first is None and split.last is None:
        per_chunk = split.layers // split.pp // vpp
        return stage * (split.layers // vpp) + rank * per_chunk
    middle, stages = _middle(split)
    first = split.first or 0
    middle_rank = rank if split.first is None else rank - 1
    if rank == 0:
        return stage * (split.layers // vpp)
    middle_per_rank_chunk = middle // vpp // stages if stages else 0
    return stage * (split.layers // vpp) + first // vpp + middle_rank * middle_per_rank_chunk


def _middle(split: Split) -> tuple[int, int]:
    """(layers, ranks) between the uneven first and last ranks."""
    given = [n for n in (split.first, split.last) if n is not None]
    return split.layers - sum(given), split.pp - len(given)


def check(split: Split) -> None:
    """The refusals: megatron-core's TransformerConfig.__post_init__ for uneven stages, its get_num_layers_to_build
    asserts for an even split, and what it cannot place."""
    pp, vpp, layers = split.pp, split.vpp, split.layers
    uneven = split.first is not None or split.last is not None
    if vpp is not None and pp == 1:
        raise ConfigError(f"--vpp {vpp} needs --pp above 1: virtual stages interleave the pipeline ranks' layers "
                          "(Megatron-LM refuses an interleaved schedule without pipeline parallelism)")
    if uneven and pp == 1:
        raise ConfigError("--decoder-first-pipeline-num-layers and --decoder-last-pipeline-num-layers need --pp "
                          "above 1: with one pipeline rank every layer is on it")
    if not uneven:
        if layers % pp:
            raise ConfigError(f"--pp {pp} does not divide the model's {layers} layers: megatron-core gives each "
                              "pipeline stage as many (or give --decoder-first-pipeline-num-layers or "
                              "--decoder-last-pipeline-num-layers)")
        if vpp is not None and (layers // pp) % vpp:
            raise ConfigError(f"--vpp {vpp} does not divide the {layers // pp} layers of each pipeline rank "
                              f"({layers} layers over --pp {pp}): each virtual stage holds as many")
        return
    _check_uneven(split)


def _check_uneven(split: Split) -> None:
    vpp = split.vpp
    for flag, n in (("--decoder-first-pipeline-num-layers", split.first),
                    ("--decoder-last-pipeline-num-layers", split.last)):
        if n is not None and vpp is not None and n % vpp:
            raise ConfigError(f"--vpp {vpp} does not divide {flag} {n}: each virtual stage of that rank holds "
                              "as many layers")
    middle, stages = _middle(split)
    if middle < 0 or bool(middle) != bool(stages):
        raise ConfigError(f"the uneven first and last stages leave {middle} of the model's {split.layers} layers "
                          f"for {stages} middle pipeline rank(s) of --pp {split.pp}: each rank needs layers")
    if stages and middle % stages:
        raise ConfigError(f"the {middle} layers between the uneven first and last stages do not divide over the "
                          f"{stages} middle pipeline rank(s) of --pp {split.pp}")
    if stages and vpp is not None and (middle // stages) % vpp:
        raise ConfigError(f"--vpp {vpp} does not divide the {middle // stages} layers of each middle pipeline rank")
    if vpp is not None and not stages and split.first is not None and split.last is not None:
        raise ConfigError(f"--vpp with both uneven stages set and no middle rank (--pp {split.pp}): megatron-core "
                          "0.16.1 cannot place the last rank's layers (it divides by the middle ranks); set only "
                          "--decoder-first-pipeline-num-layers or --decoder-last-pipeline-num-layers")

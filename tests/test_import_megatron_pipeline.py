"""`distmerge import --to megatron` with a pipeline split other than even: virtual stages (--vpp, Megatron-LM's
interleaved schedule) and uneven first or last stages (--decoder-first/last-pipeline-num-layers). Judged by
megatron-core: its GPTModel chunks built at that split load the folder strictly, every parameter equal to the
source, and its own save of them puts every chunk in the same rank's file as the import did
(tests/fixtures/load_megatron_import.py); the split's layer placement equals megatron-core's own functions; the
folder merges back to the source; a split megatron-core refuses is refused in one line with nothing written."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from distmerge.errors import ConfigError
from distmerge.formats.megatron import pipeline
from tests.conftest import input_untouched, load_merged, merge_inproc
from tests.helpers.importing import import_inproc, load_with, save_hf_model

FAMILY = "llama4"  # the tests' tiny Llama with 4 layers
# name: (import options, the loader's split, the layers megatron-core builds on each pipeline rank, chunk by chunk,
# as its docs draw them: transformer_block.py's "Stage 0: [0] [2] ..." and the uneven stages' flags' help)
SPLITS = {
    "vpp": (("--tp", 2, "--pp", 2, "--vpp", 2), "vpp=2", {"0": [[0], [2]], "1": [[1], [3]]}),
    "first": (("--tp", 2, "--pp", 2, "--decoder-first-pipeline-num-layers", 1), "first=1",
              {"0": [[0]], "1": [[1, 2, 3]]}),
    "last": (("--tp", 2, "--pp", 2, "--decoder-last-pipeline-num-layers", 1), "last=1",
             {"0": [[0, 1, 2]], "1": [[3]]}),
}
ARGS = {"vpp": {"virtual_pipeline_model_parallel_size": 2, "decoder_first_pipeline_num_layers": None,
                "decoder_last_pipeline_num_layers": None},
        "first": {"virtual_pipeline_model_parallel_size": None, "decoder_first_pipeline_num_layers": 1,
                  "decoder_last_pipeline_num_layers": None},
        "last": {"virtual_pipeline_model_parallel_size": None, "decoder_first_pipeline_num_layers": None,
                 "decoder_last_pipeline_num_layers": 1}}
LOAD_WORLD = 4  # TP=2 x PP=2: the smallest job of each split, so the owner of every chunk is compared too


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory) -> Path:
    return save_hf_model(FAMILY, tmp_path_factory.mktemp("hf") / FAMILY)


@pytest.fixture(scope="module")
def imported(hf_model, tmp_path_factory) -> dict[str, Path]:
    """The model imported by one process at each split; the input left as it was."""
    root = tmp_path_factory.mktemp("imported")
    for name, (flags, _, _) in SPLITS.items():
        with input_untouched(hf_model):
            assert import_inproc("--input", hf_model, "--output", root / name, *flags) == 0
    return {name: root / name for name in SPLITS}


def at_split(name: str, imported: dict[str, Path], hf_model: Path) -> str:
    return f"{FAMILY}:2:2:1:{imported[name]}:{hf_model}:save:{SPLITS[name][1]}"


def at_tp1(name: str, imported: dict[str, Path], hf_model: Path) -> str:
    return f"{FAMILY}:1:1:1:{imported[name]}:{hf_model}"


@pytest.fixture(scope="module")
def loads(imported, hf_model, tmp_path_factory) -> dict:
    """Every folder loaded by megatron-core at its split, and the interleaved one at TP=1 x PP=1: one job."""
    cases = [at_split(name, imported, hf_model) for name in SPLITS] + [at_tp1("vpp", imported, hf_model)]
    return load_with("load_megatron_import.py", LOAD_WORLD, cases, tmp_path_factory.mktemp("loads") / "result.json")


@pytest.mark.parametrize("name", SPLITS)
def test_megatron_core_loads_it_at_its_split(loads, imported, hf_model, name):
    """Strict load into the chunks megatron-core builds at the split (the layers each rank holds as its docs
    draw them), every parameter equal to the source, the split in common.pt's args, and each chunk in the file
    of the rank whose own save holds it."""
    got = loads[at_split(name, imported, hf_model)]
    assert got["mismatched"] == [] and got["checked"] > 0
    assert got["pipeline"] == {"args": ARGS[name], "layers": SPLITS[name][2]}
    assert got["args"]["num_layers"] == 4 and got["args"]["pipeline_model_parallel_size"] == 2
    assert got["layout_differs"] == []


def test_the_interleaved_folder_loads_at_tp1(loads, imported, hf_model):
    got = loads[at_tp1("vpp", imported, hf_model)]
    assert got["mismatched"] == [] and got["checked"] > 0


@pytest.mark.parametrize("name", ["vpp", "first"])
def test_merged_back_it_is_the_source(imported, hf_model, tmp_path, name):
    out = tmp_path / "merged"
    assert merge_inproc("--input", imported[name], "--output", out, "--hf-config", hf_model) == 0
    merged, source = load_merged(out), load_file(str(hf_model / "model.safetensors"))
    assert sorted(merged) == sorted(source)
    for tensor_name, tensor in source.items():
        assert torch.equal(merged[tensor_name], tensor), tensor_name


def megatron_core_ranks(layers: int, pp: int, vpp: int | None, first: int | None, last: int | None):
    """The pipeline rank of each layer by megatron-core's own get_num_layers_to_build and
    get_transformer_layer_offset, or None where its TransformerConfig or those functions refuse the split or
    its chunks do not cover each layer once."""
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    try:
        config = TransformerConfig(num_layers=layers, hidden_size=8, num_attention_heads=2,
                                   pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp,
                                   num_layers_in_first_pipeline_stage=first, num_layers_in_last_pipeline_stage=last,
                                   pipeline_dtype=torch.float32, use_cpu_initialization=True)
        held = [(rank, get_transformer_layer_offset(config, vp_stage=v, pp_rank=rank),
                 get_num_layers_to_build(config, vp_stage=v, pp_rank=rank))
                for rank in range(pp) for v in ([None] if vpp is None else range(vpp))]
    except (ValueError, AssertionError, ZeroDivisionError):
        return None
    ranks: list[int | None] = [None] * layers
    for rank, offset, count in held:
        for layer in range(offset, offset + count):
            if not 0 <= layer < layers or ranks[layer] is not None:
                return None
            ranks[layer] = rank
    return None if None in ranks else tuple(ranks)


def test_the_split_places_each_layer_where_megatron_core_does():
    """Every split of 4, 6 or 8 layers over 2 to 4 ranks, with and without virtual stages and uneven stages: the
    import's placement is megatron-core's, and a split it cannot place is refused (ConfigError). Splits of one
    pipeline rank with virtual or uneven stages are refused apart (Megatron-LM's own refusal)."""
    differ = []
    sizes = (None, 1, 2, 3)
    for layers, pp, vpp, first, last in itertools.product((4, 6, 8), range(2, 5), (None, 2, 3), sizes, sizes):
        split = pipeline.Split(layers=layers, pp=pp, vpp=vpp, first=first, last=last)
        want = megatron_core_ranks(layers, pp, vpp, first, last)
        try:
            got = pipeline.layer_ranks(split)
        except ConfigError:
            got = None
        if got != want:
            differ.append((split, got, want))
    assert differ == []


@pytest.mark.parametrize(("flags", "words"), [
    (("--pp", 2, "--vpp", 3), "--vpp 3 does not divide the 2 layers of each pipeline rank"),
    (("--vpp", 2), "--vpp 2 needs --pp above 1"),
    (("--pp", 2, "--vpp", 2, "--decoder-first-pipeline-num-layers", 1),
     "--vpp 2 does not divide --decoder-first-pipeline-num-layers 1"),
    (("--pp", 2, "--decoder-last-pipeline-num-layers", 4), "leave 0 of the model's 4 layers for 1 middle"),
    (("--pp", 3, "--decoder-first-pipeline-num-layers", 2, "--vpp", 2), "--vpp 2 does not divide the 1 layers of"),
    (("--to", "torchtitan", "--vpp", 2), "--to torchtitan writes one folder"),
])
def test_a_split_megatron_core_refuses_is_refused(hf_model, tmp_path, capsys, flags, words):
    out = tmp_path / "out"
    assert import_inproc("--input", hf_model, "--output", out, *flags) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0], err
    assert not out.exists()

"""A megatron-core 0.19 torch_dist save (tests/data/megatron_core_0_19/, made by tests/fixtures/make_megatron_new.py
in a venv of its own: this one pins 0.16.1): no common.pt, the common state a bytes entry of rank 0's .distcp."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.conftest import assert_exact, load_merged, merge_inproc

DATA = Path(__file__).parent / "data" / "megatron_core_0_19"


def test_the_saved_layout_is_megatron_core_0_19s():
    """What the data must show for the merge test to mean anything: torch_dist, one .distcp per rank, no
    common.pt, and the common state (args, iteration) a bytes entry `common_state/shard_0_1` in __0_0.distcp."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    save = DATA / "iter_0000001"
    assert json.loads((save / "metadata.json").read_text())["sharded_backend"] == "torch_dist"
    assert sorted(p.name for p in save.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert not (save / "common.pt").exists()
    meta = FileSystemReader(str(save)).read_metadata()
    assert isinstance(meta.state_dict_metadata["common_state/shard_0_1"], BytesStorageMetadata)
    where = {index.fqn: info.relative_path for index, info in meta.storage_data.items()}
    assert where["common_state/shard_0_1"] == "__0_0.distcp"


def test_megatron_core_0_19_save_merges_to_the_reference(tmp_path):
    """Every tensor torch.equal to the Hugging Face-named state the save was made from (q/k/v split per query
    group, gate/up, vocabulary slices gathered); from_pretrained finds no missing or unexpected key. Shown to
    fail by unstacking no torch_dist layers in megatron_dist (6 stacked decoder.layers.* tensors had no mapping:
    refused)."""
    from transformers import AutoModelForCausalLM

    out = tmp_path / "out"
    assert merge_inproc("--input", DATA, "--output", out) == 0
    reference = torch.load(DATA / "reference.pt", weights_only=True)
    assert_exact(load_merged(out), reference)
    _, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info

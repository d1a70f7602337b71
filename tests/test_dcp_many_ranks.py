"""Every DCP-based format on a many-rank save (issue #27): dcp and torchtitan saves of 16 FSDP2 ranks (torch's own
planner and writer, 9,000+ chunks) and a megatron-core torch_dist save of 32 ranks (TP=2 x PP=4 x DP=4, megatron's
own save code with the fully-parallel split verl and Megatron-LM use), made by the bench's makers
(tests/fixtures/many_ranks.py). Each merges with torchrun N=2 to the known weights bit for bit, byte-identical to
a one-process merge, and that merge reads `.metadata` with the fast decoder only (the general reader refuses).
The expected weights are the makers' (`{case}_reference/`): make_dcp_scale's `value` of every tensor (torchtitan's
wq / wk rows in Hugging Face's RoPE layout), megatron's the Hugging Face model its ranks' shards were cut from.
"""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file

from distmerge.formats.torch_private import dcp
from distmerge.input import source
from tests.conftest import assert_exact, load_merged, merge_inproc, reference_dir, torchrun, tree_bytes

# case: (format distmerge reports, the DCP folder inside the save, fewest chunks its .metadata lists)
CASES = {"dcp_hf_w16": ("dcp", ".", 4656), "torchtitan_w16": ("torchtitan", ".", 4656),
         "megatron_w32": ("megatron-dist", "iter_0000001", 101)}


@pytest.mark.parametrize("case", list(CASES))
def test_a_many_rank_save_merges_exactly_with_the_fast_metadata_reader(case, many_rank_ckpts, tmp_path, monkeypatch):
    fmt, folder, fewest = CASES[case]
    ckpt = many_rank_ckpts[case]
    metadata = ckpt / folder / ".metadata"
    assert len(dcp.read_metadata(source.of(metadata), metadata)) >= fewest
    ran = torchrun(2, "merge", "--input", ckpt, "--output", tmp_path / "n2", "--quiet",
                   "--json-summary", tmp_path / "n2.json")
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert json.loads((tmp_path / "n2.json").read_text())["format"] == fmt

    def refuse(*args, **kwargs):
        raise AssertionError("the general .metadata reader was used")

    monkeypatch.setattr(dcp, "loads", refuse)
    assert merge_inproc("--input", ckpt, "--output", tmp_path / "n1") == 0
    assert tree_bytes(tmp_path / "n2") == tree_bytes(tmp_path / "n1")
    assert_exact(load_merged(tmp_path / "n2"), load_file(reference_dir(ckpt) / "model.safetensors"))

"""`distmerge import` of a training checkpoint in one pass (#45 item 3), and each input byte read once.

A checkpoint (an FSDP2 save at W=4, written as Megatron-LM's torch_dist and as torchtitan's DCP; torchtitan's
Qwen3-MoE save at W=4 and DeepSeek-V3 save at W=3, written as torchtitan's DCP; a Megatron legacy save at TP=2,
written at TP=1 x PP=2: resharding) is read by the merge engine and its Hugging Face tensors are cut into the
target's chunks in memory: the folder written is, byte for byte, the import of the checkpoint's merge
(whose loads by megatron-core and torchtitan test_import_megatron.py and test_import_torchtitan.py judge), no
folder is made outside the output on the way, and two processes write what one writes.

The bytes each import reads are counted by the kernel (/proc/self/io `rchar`, tests/io_probe.py): the one-pass
import of a checkpoint reads what the merge of it reads (a staged import read it again from the merged folder), and
an import at TP=2 reads what the import at TP=1 reads (a column split's TP chunks were each read at full width).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, input_untouched, merge_inproc, reference_dir, torchrun
from tests.helpers.importing import folder_bytes, import_inproc
from tests.helpers.two_nodes import can_simulate, last_error, run_two_nodes

# case: (fixture family, checkpoint, the import's target and layout options, --hf-config from the reference folder)
CASES = {
    "fsdp2": ("fsdp_ckpts", "fsdp2_llama_w4", ("--tp", "2", "--pp", "2"), False),
    "fsdp2_torchtitan": ("fsdp_ckpts", "fsdp2_llama_w4", ("--to", "torchtitan"), False),
    # torchtitan's own Qwen3-MoE save (stacked experts, FSDP-sharded on dim 1) back into torchtitan's names: its
    # experts restacked from the merge's per-expert tensors, expert_bias_E written at torchtitan's init
    "torchtitan_moe": ("tt_ckpts", "tt_qwen3_moe_w4", ("--to", "torchtitan"), False),
    # torchtitan's own DeepSeek-V3 save (MLA, a dense first layer, expert_bias_E trained, an MTP layer) back into
    # torchtitan's names: the MTP layer through Hugging Face's layer num_hidden_layers + j and its copies
    "torchtitan_dsv3": ("tt_ckpts", "tt_deepseek_v3_w3", ("--to", "torchtitan"), False),
    "megatron_legacy": ("megatron_ckpts", "megatron_tp2", ("--tp", "1", "--pp", "2"), True),
}


def checkpoint_of(request, case: str) -> tuple[Path, list[str]]:
    """The case's checkpoint, and the options it is merged and imported with (its config.json folder)."""
    family, name, _, beside = CASES[case]
    ckpt = request.getfixturevalue(family)[name]
    return ckpt, (["--hf-config", str(reference_dir(ckpt) / "huggingface")] if beside else [])


@pytest.fixture(scope="module")
def merged(request, tmp_path_factory) -> dict[str, Path]:
    """Each case's checkpoint merged into a Hugging Face folder by `distmerge merge`, once per checkpoint."""
    root = tmp_path_factory.mktemp("merged")
    out: dict[str, Path] = {}
    by_checkpoint: dict[str, Path] = {}
    for case in CASES:
        ckpt, config = checkpoint_of(request, case)
        if CASES[case][1] not in by_checkpoint:
            by_checkpoint[CASES[case][1]] = root / case
            assert merge_inproc("--input", ckpt, "--output", root / case, *config) == 0
        out[case] = by_checkpoint[CASES[case][1]]
    return out


def record_folders_made(monkeypatch) -> list[Path]:
    """Every folder made by this process from here on (os.mkdir: Path.mkdir and os.makedirs call it)."""
    made: list[Path] = []
    real = os.mkdir

    def mkdir(path, *args, **kwargs):
        made.append(Path(path).resolve())
        return real(path, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", mkdir)
    return made


@pytest.mark.parametrize("case", CASES)
def test_a_checkpoint_is_written_as_the_import_of_its_merge(case, request, merged, tmp_path, monkeypatch):
    """One pass: the same bytes as importing the checkpoint's merge; no folder beside the output (the staged
    version merged into `.OUT.distmerge-import-source/` first), the checkpoint untouched."""
    ckpt, config = checkpoint_of(request, case)
    layout = CASES[case][2]
    expected = tmp_path / "from_merged"
    assert import_inproc("--input", merged[case], "--output", expected, *layout) == 0
    out = tmp_path / "work" / "imported"
    made = record_folders_made(monkeypatch)
    with input_untouched(ckpt):
        assert import_inproc("--input", ckpt, "--output", out, *layout, *config) == 0
    monkeypatch.undo()
    assert folder_bytes(out) == folder_bytes(expected)
    assert made and all(p == out or out in p.parents or p == out.parent for p in made), made
    assert [p.name for p in out.parent.iterdir()] == ["imported"]


@pytest.mark.parametrize("case", ["fsdp2", "fsdp2_torchtitan", "torchtitan_moe"])
def test_two_processes_write_what_one_writes(case, request, tmp_path):
    """The FSDP2 save under torchrun: the merge engine gives the units to both processes (q, k and v of a layer to
    one, for Megatron's linear_qkv), and each writes its chunks into files the other may own: the bytes of one
    process."""
    ckpt, _ = checkpoint_of(request, case)
    layout = CASES[case][2]
    one, two = tmp_path / "n1", tmp_path / "n2"
    assert import_inproc("--input", ckpt, "--output", one, *layout) == 0
    done = torchrun(2, "import", "--quiet", "--input", str(ckpt), "--output", str(two), *layout)
    assert done.returncode == 0, done.stderr[-3000:]
    assert folder_bytes(two) == folder_bytes(one)


def bytes_read(tmp_path: Path, name: str, *args: object) -> int:
    """The bytes one `python -m distmerge ARGS` process read, as the kernel counts them (tests/io_probe.py)."""
    record = tmp_path / f"probe_{name}"
    record.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, str(REPO / "tests" / "io_probe.py"), str(record), *map(str, args)],
                          capture_output=True, text=True, timeout=240, env=env, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((record / "rank0.json").read_text())["rchar"]


# What may differ between two runs that read the same tensor bytes: the output's own small reads (none today);
# far below what either fault costs (the tiny Llama's column-split weights read once more: 106,496 bytes; its
# checkpoint read once more: 826,216)
SLACK = 4096


def test_a_checkpoint_is_read_once(request, tmp_path):
    """The one-pass import of the FSDP2 save reads what `distmerge merge` of it reads: no second reading of a
    staged copy. Seen failing with the staged import: 1,403,863 bytes against the merge's 1,402,066 + 826,216."""
    ckpt, _ = checkpoint_of(request, "fsdp2")
    merge = bytes_read(tmp_path, "merge", "merge", "--quiet", "--input", ckpt, "--output", tmp_path / "merged")
    imported = bytes_read(tmp_path, "import", "import", "--quiet", "--input", ckpt, "--output", tmp_path / "out",
                          *CASES["fsdp2"][2])
    assert merge - SLACK <= imported <= merge + SLACK, (imported, merge)


def test_column_split_tensors_are_read_once(merged, tmp_path):
    """At TP=2 o_proj and down_proj are split on their columns: the import reads what it reads at TP=1, where no
    tensor is split, and at least the model's tensor bytes. Seen failing when each TP chunk of a column split
    read its rows at full width: 106,496 bytes more (those weights twice)."""
    folder = merged["fsdp2"]
    tensors = (folder / "model.safetensors").stat().st_size
    at_tp1 = bytes_read(tmp_path, "tp1", "import", "--quiet", "--input", folder, "--output", tmp_path / "tp1")
    at_tp2 = bytes_read(tmp_path, "tp2", "import", "--quiet", "--input", folder, "--output", tmp_path / "tp2",
                        "--tp", "2")
    assert tensors <= at_tp1 and at_tp2 <= at_tp1 + SLACK, (at_tp1, at_tp2, tensors)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_a_blob_is_placed_at_the_length_torch_save_writes(dtype):
    """Blobs are placed before they are made (several processes write one file): the length planned for a shape
    is torch.save's of any values of that shape (random ones here, saved by torch itself)."""
    import io

    import torch

    from distmerge.formats.torch_private.dcp.write import tensor_blob_length

    kind = getattr(torch, dtype)
    for shape in [(1,), (3,), (1001, 64), (1, 2, 69, 64), (16, 1), (4097,)]:
        saved = io.BytesIO()
        torch.save(torch.randn(shape).to(kind), saved)
        assert tensor_blob_length(shape, kind) == len(saved.getvalue()), shape


@pytest.mark.skipif(not can_simulate(), reason="simulating two nodes needs root and unshare")
def test_an_output_each_node_sees_apart_is_refused_before_writing(merged, tmp_path):
    """Several processes write each file of an import, so they must see one output on one machine. Two simulated
    nodes, each with a disk of its own at the output's path: the one line on each node, before any file is made.
    Seen failing without the check: node 1 found no file to join (the one its owner made is on node 0's disk)."""
    at = tmp_path / "disk"
    runs = run_two_nodes([None, None], at, ["import", "--input", merged["fsdp2"], "--output", at / "out"],
                         nproc=(1, 1), before=(f"mkdir -p {at / 'out'}", f"mkdir -p {at / 'out'}"))
    for run in runs:
        assert run.returncode != 0, run.log[-2000:]
        assert "needs them on one machine" in last_error(run.log), run.log[-2000:]

"""Checkpoints where the nodes left them: two simulated nodes (tests/helpers/two_nodes.py), each seeing only its own
files at the input's path, merge them where they lie. The output must be what one node merges from all the files, byte
for byte, and every refusal the same one line on every node."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import socket
import subprocess
from collections.abc import Callable, Iterable
from pathlib import Path

import pytest
from safetensors import safe_open

from tests.conftest import REPO, assert_exact, expected_tensors, load_merged, merge_inproc, reference_dir
from tests.helpers.two_nodes import can_simulate, error_lines, last_error, run_two_nodes, split_files

pytestmark = pytest.mark.skipif(not can_simulate(), reason="needs root and unshare (mount namespaces)")

WEIGHTS = ("model.safetensors.index.json", "config.json")
SMALL_FILES = ("--max-shard-size", "100KB")  # several output files: each given an owner near its reads


def by_rank(pattern: str, node_of_rank: Callable[[int], Iterable[int]], rest: Iterable[int] = (0,)):
    """A file whose name carries a training rank goes to node_of_rank(rank), any other file to `rest`."""
    def node_of(rel: str) -> Iterable[int]:
        m = re.search(pattern, rel)
        return node_of_rank(int(m.group(1))) if m else rest
    return node_of


def merge_where_they_lie(ckpt: Path, node_of, tmp: Path, nproc=(2, 2), extra: tuple[str, ...] = ()):
    disks = [tmp / "node0", tmp / "node1"]
    split_files(ckpt, disks, node_of)
    out = tmp / "out"
    runs = run_two_nodes(disks, tmp / "ckpt", ["merge", "--input", tmp / "ckpt", "--output", out, *extra],
                         nproc=nproc)
    return runs, out


def one_node_bytes(ckpt: Path, tmp: Path, *extra: str) -> dict[str, bytes]:
    """The files one node's merge of every file writes: model files, index, config."""
    out = tmp / "one-node"
    assert merge_inproc("--input", ckpt, "--output", out, *extra) == 0
    return {p.name: p.read_bytes() for p in out.iterdir() if p.name.startswith("model") or p.name in WEIGHTS}


def assert_same_output(out: Path, expected: dict[str, bytes]) -> None:
    assert sorted(p.name for p in out.glob("model*")) == sorted(n for n in expected if n.startswith("model"))
    for name, data in expected.items():
        assert (out / name).read_bytes() == data, name


def crossed(log: str) -> float:
    """The bytes the summary line says crossed nodes."""
    found = re.search(r"across 2 nodes \(([\d.]+) ([KMG]?)B crossed nodes\)", log)
    assert found, log[-2000:]
    return float(found.group(1)) * 1000 ** " KMG".index(found.group(2) or " ")


def test_fsdp2_rank_files_on_two_nodes_markers_on_the_other(fsdp_ckpts, tmp_path):
    """verl's FSDP2 save, W=4: ranks 0-1 (with fsdp_config.json and huggingface/, as training rank 0 leaves them)
    on node 1, ranks 2-3 on node 0, where merge rank 0 runs, so its discovery and finalize read node 1's files
    through node 1; rank 1's model file on both nodes, read once. N=3 (1 + 2) against W=4."""
    ckpt = fsdp_ckpts["fsdp2_llama_w4"]
    node_of = by_rank(r"rank_(\d+)\.pt$", lambda r: (1,) if r == 0 else (0, 1) if r == 1 else (0,), rest=(1,))
    big = os.urandom(3 << 20)  # a tokenizer model of several MiB: finalize copies it from node 1 piece by piece
    (tmp_path / "node1" / "huggingface").mkdir(parents=True)
    (tmp_path / "node1" / "huggingface" / "tokenizer.model").write_bytes(big)
    runs, out = merge_where_they_lie(ckpt, node_of, tmp_path, nproc=(1, 2))
    assert [r.returncode for r in runs] == [0, 0], runs[0].log[-3000:] + runs[1].log[-3000:]
    assert_exact(load_merged(out), expected_tensors(ckpt))
    assert_same_output(out, one_node_bytes(ckpt, tmp_path))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):  # finalize, from node 1
        assert (out / name).read_bytes() == (ckpt / "huggingface" / name).read_bytes(), name
    assert (out / "tokenizer.model").read_bytes() == big
    # Shard(0) splits every tensor's rows over the four ranks: some of every tensor crosses, never all of it
    assert 0 < crossed(runs[0].log) < sum(p.stat().st_size for p in out.glob("*.safetensors"))
    assert "│ node │" in runs[0].log.replace("┃", "│")


def test_a_copy_of_the_checkpoint_on_each_node(fsdp_ckpts, tmp_path):
    """Each node holds its own copy of every file (listed alike, so read as one folder): each rank reads its node's
    copy, though the copies are other files (device, inode) than the ones rank 0 listed. N=2 (1 + 1), W=4."""
    ckpt = fsdp_ckpts["fsdp2_llama_w4"]
    runs, out = merge_where_they_lie(ckpt, lambda rel: (0, 1), tmp_path, nproc=(1, 1))
    assert [r.returncode for r in runs] == [0, 0], runs[0].log[-3000:] + runs[1].log[-3000:]
    assert_same_output(out, one_node_bytes(ckpt, tmp_path))


def test_dcp_save_on_two_nodes(dcp_ckpts, tmp_path):
    """dcp.save of FSDP2, W=4: each rank's __R_0.distcp on its node (ranks 0-1 node 0, 2-3 node 1), .metadata and
    huggingface/ on node 0. Node 1 alone lists files .metadata names, node 0 a .metadata missing half its files:
    joined, they are one checkpoint."""
    ckpt = dcp_ckpts["dcp_llama_wrapped_w4"]
    runs, out = merge_where_they_lie(ckpt, by_rank(r"__(\d+)_\d+\.distcp$", lambda r: (r // 2,)), tmp_path,
                                     nproc=(2, 1))
    assert [r.returncode for r in runs] == [0, 0], runs[0].log[-3000:] + runs[1].log[-3000:]
    assert_exact(load_merged(out), expected_tensors(ckpt))
    assert_same_output(out, one_node_bytes(ckpt, tmp_path))


def test_a_file_no_node_holds_is_one_line_on_every_node(fsdp_ckpts, tmp_path):
    """Rank 3's files on neither node: every node's log ends in the same line naming only rank 3, nothing is
    written, both exit non-zero."""
    ckpt = fsdp_ckpts["fsdp2_llama_w4"]
    runs, out = merge_where_they_lie(ckpt, by_rank(r"rank_(\d+)\.pt$", lambda r: () if r == 3 else (r // 2,)),
                                     tmp_path, nproc=(1, 1))
    assert [r.returncode != 0 for r in runs] == [True, True]
    lines = [last_error(r.log) for r in runs]
    assert lines[0] == lines[1], lines
    assert re.search(r"missing for ranks? 3 of world size 4", lines[0]), lines[0]  # only the rank no node holds
    assert lines[0] == as_run(page_line("distmerge: error: /tmp/multinode/ckpt: rank files"), tmp_path)
    assert not re.search(r'distmerge/[\w/]+\.py", line', runs[0].log + runs[1].log)  # torchrun's own summary only
    assert not (out / "model.safetensors.index.json").exists()
    assert not list(out.glob("*.safetensors")) if out.exists() else True


def test_an_output_some_nodes_cannot_see_is_refused(fsdp_ckpts, tmp_path):
    """The output on each node's own disk (a tmpfs of its own at the output's path): node 1 cannot see rank 0's
    probe; refused on both nodes in one line naming node 1, before any tensor is written."""
    ckpt = fsdp_ckpts["fsdp2_llama_w4"]
    disks = [tmp_path / "node0", tmp_path / "node1"]
    split_files(ckpt, disks, by_rank(r"rank_(\d+)\.pt$", lambda r: (r // 2,)))
    out = tmp_path / "merged"
    out.mkdir()
    own = f"mount -t tmpfs none {out}"  # each node's own: what it writes there stays there
    runs = run_two_nodes(disks, tmp_path / "ckpt", ["merge", "--input", tmp_path / "ckpt", "--output", out],
                         nproc=(2, 2), before=(own, own))
    assert [r.returncode != 0 for r in runs] == [True, True]
    lines = [last_error(r.log) for r in runs]
    assert lines[0] == lines[1], lines
    assert "is not shared" in lines[0] and "node 1 (" in lines[0] and "node 0 (" not in lines[0], lines[0]
    assert lines[0] == as_run(page_line("distmerge: error: output /tmp/multinode/merged"), tmp_path,
                              socket.gethostname())
    assert [len(error_lines(r.log)) for r in runs] == [1, 1], runs[0].log + runs[1].log
    assert json.loads((ckpt / "fsdp_config.json").read_text())  # the input untouched
    assert reference_dir(ckpt).exists()


def test_megatron_torch_dist_on_two_nodes_config_on_the_other(megatron_ckpts, tmp_path):
    """megatron-core's torch_dist save, TP=2 x PP=2: each rank's __R_*.distcp on its node (ranks 0-1, pipeline
    stage 0, on node 0; 2-3, stage 1, on node 1), the tracker, metadata.json and common.pt on node 0; --hf-config
    names a folder only node 1 holds. Each output file is written on the node holding its layers' stage, so next to
    nothing crosses nodes."""
    ckpt = megatron_ckpts["megatron_dist_tp2pp2"]
    hf = tmp_path / "hf"
    hf.mkdir()
    node1_hf = tmp_path / "hf-node1"
    split_files(reference_dir(ckpt) / "huggingface", [node1_hf, node1_hf], lambda rel: (0,))
    disks = [tmp_path / "node0", tmp_path / "node1"]
    split_files(ckpt, disks, by_rank(r"__(\d+)_\d+\.distcp$", lambda r: (r // 2,)))
    out = tmp_path / "out"
    runs = run_two_nodes(disks, tmp_path / "ckpt", ["merge", "--input", tmp_path / "ckpt", "--output", out,
                                                    "--hf-config", hf, *SMALL_FILES], nproc=(1, 2),
                         before=("", f"mount --bind {node1_hf} {hf}"))
    assert [r.returncode for r in runs] == [0, 0], runs[0].log[-3000:] + runs[1].log[-3000:]
    one = one_node_bytes(ckpt, tmp_path, "--hf-config", reference_dir(ckpt) / "huggingface", *SMALL_FILES)
    assert_same_output(out, one)
    assert len(json.loads(one["model.safetensors.index.json"])["weight_map"]) == 21
    assert crossed(runs[0].log) == pytest.approx(stages_apart(out), rel=0.05, abs=512)


def stages_apart(out: Path) -> int:
    """What must cross when pipeline stage 0 (the embedding, the first half of the layers) lies on node 0 and stage 1
    (the rest, the final norm, the head) on node 1: in each output file, the bytes of the stage it holds less of."""
    weight_map = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    layers = 1 + max(int(m[1]) for name in weight_map if (m := re.search(r"layers\.(\d+)\.", name)))
    per_file: dict[str, list[int]] = {}
    for name, file in weight_map.items():
        with safe_open(out / file, framework="pt") as f:
            nbytes = f.get_tensor(name).nbytes
        m = re.search(r"layers\.(\d+)\.", name)
        stage = int(int(m[1]) >= layers // 2) if m else int("embed" not in name)
        per_file.setdefault(file, [0, 0])[stage] += nbytes
    return sum(min(both) for both in per_file.values())


def test_deepspeed_zero3_on_two_nodes(ds_ckpts, tmp_path):
    """DeepSpeed ZeRO-3 saved with node-local storage, W=2: each rank's model and optimizer states on its own
    node; `latest`, huggingface/ and the scripts on node 0. N=3 (1 + 2)."""
    ckpt = ds_ckpts["ds_z3_fp32_w2"]
    runs, out = merge_where_they_lie(ckpt, by_rank(r"zero_pp_rank_(\d+)_", lambda r: (r,)), tmp_path, nproc=(1, 2))
    assert [r.returncode for r in runs] == [0, 0], runs[0].log[-3000:] + runs[1].log[-3000:]
    assert_same_output(out, one_node_bytes(ckpt, tmp_path))


def test_a_node_killed_mid_merge_is_named_and_resume_finishes(fsdp_ckpts, tmp_path):
    """Node 1 killed once the first output file is finished: node 0's line names the ranks it lost, no index is
    written, and --resume over both nodes keeps the finished files and ends byte-identical to one node's merge."""
    ckpt = fsdp_ckpts["fsdp2_llama_w4"]
    disks = [tmp_path / "node0", tmp_path / "node1"]
    split_files(ckpt, disks, by_rank(r"rank_(\d+)\.pt$", lambda r: (r // 2,)))
    out = tmp_path / "out"
    args = ["merge", "--input", tmp_path / "ckpt", "--output", out, "--max-shard-size", "100KB", "--budget", "16KB",
            "--timeout", "8"]
    runs = run_two_nodes(disks, tmp_path / "ckpt", args, nproc=(1, 1), env={"DISTMERGE_TEST_ROUND_DELAY": "0.3"},
                         kill=(1, lambda: bool(list((out / ".distmerge").glob("model-*.json")))))
    assert runs[0].returncode != 0
    line = last_error(runs[0].log)
    assert re.search(r"rank 1 \(.*\) is gone during round", line), runs[0].log[-3000:]
    assert not (out / "model.safetensors.index.json").exists()
    kept = sorted(p.name for p in (out / ".distmerge").glob("model-*.json"))
    runs = run_two_nodes(disks, tmp_path / "ckpt", [*args, "--resume"], nproc=(1, 1))
    assert [r.returncode for r in runs] == [0, 0], runs[0].log[-3000:] + runs[1].log[-3000:]
    assert kept and f"resume: kept {len(kept)} of 6 file(s)" in runs[0].log, runs[0].log[-2000:]
    one = tmp_path / "one-node"
    assert merge_inproc("--input", ckpt, "--output", one, "--max-shard-size", "100KB") == 0
    for f in sorted(one.glob("model*")):
        assert (out / f.name).read_bytes() == f.read_bytes(), f.name


def test_the_slurm_example_submits_on_the_training_nodes(tmp_path):
    """slurm/multinode_example.sh asks sacct for the training job's nodes and submits merge.sbatch on exactly
    those, one task each (a stand-in sacct, scontrol and sbatch record what it runs: no cluster has two nodes in
    CI); with no such job it says so in one line."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    record = tmp_path / "calls"
    stubs = {"sacct": 'echo "$*" >> {rec}; [ "$2" = 42 ] && echo "gpu[3-4]" || true',
             "scontrol": 'echo gpu3; echo gpu4',
             "sbatch": 'echo "sbatch $*" >> {rec}; echo 77'}
    for name, body in stubs.items():
        (bin_dir / name).write_text(f"#!/bin/sh\n{body.format(rec=record)}\n")
        (bin_dir / name).chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    script = str(REPO / "slurm" / "multinode_example.sh")
    run = subprocess.run([script, "42", "/local/ckpt", str(tmp_path / "out"), "--dtype", "bf16"], env=env,
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    submitted = record.read_text().splitlines()[-1]
    assert submitted == (f"sbatch --nodes=2 --nodelist=gpu[3-4] --exclusive {REPO}/slurm/merge.sbatch --input "
                         f"/local/ckpt --output {tmp_path / 'out'} --dtype bf16"), submitted
    run = subprocess.run([script, "41", "/local/ckpt", "out"], env=env, capture_output=True, text=True)
    assert run.returncode == 2 and run.stderr.strip().splitlines() == [
        "multinode_example.sh: error: sacct knows no nodes of job 41: is it the training job's id?"], run.stderr


PAGE = REPO / "docs" / "multinode.md"
TIMING = re.compile(r" in [\d.]+ s \([\d.]+ [KMG]?B/s\)|\s+[\d.]+ [KMG]?B/s$|│\s+[\d.]+ [KMG]?B │$")


def page_block(starts: str) -> list[str]:
    """The lines of the page's fenced block whose first line starts with `starts`."""
    blocks = re.findall(r"```[a-z]*\n(.*?)```", PAGE.read_text(), re.S)
    return next(b.splitlines() for b in blocks if b.startswith(starts))


def page_line(starts: str) -> str:
    return next(line for line in PAGE.read_text().splitlines() if line.startswith(starts))


def as_run(line: str, tmp: Path, host: str = "") -> str:
    """A line of the page as this run prints it: its folder, host and timings aside."""
    line = line.replace("/tmp/multinode", str(tmp)).replace("host vm,", f"host {host},")
    return TIMING.sub("", line.rstrip())


def test_the_transcript_in_the_docs(fsdp_ckpts, tmp_path):
    """docs/multinode.md's two-node merge is what the page says: its command (node 0's; node 1's with
    --node-rank 1), its table but the peak RSS and its summary line but the timing."""
    block = page_block("$ torchrun --nnodes 2")
    command = shlex.split(block[0].removeprefix("$ "))
    args = command[command.index("distmerge") + 1:]
    assert command[:3] == ["torchrun", "--nnodes", "2"] and "--nproc-per-node" in command
    ckpt = fsdp_ckpts["fsdp2_qwen2_tied_w4"]
    disks = [tmp_path / "node0-disk", tmp_path / "node1-disk"]
    split_files(ckpt, disks, by_rank(r"rank_(\d+)\.pt$", lambda r: (r // 2,)))
    runs = run_two_nodes(disks, tmp_path / "ckpt", [a.replace("/tmp/multinode", str(tmp_path)) for a in args],
                         nproc=(2, 2))
    assert [r.returncode for r in runs] == [0, 0], runs[0].log[-3000:]
    shown = [as_run(line, tmp_path) for line in block[1:] if not line.startswith("  100.0%")]
    printed = [as_run(line, tmp_path) for line in runs[0].log.splitlines() if not line.startswith("  ")]
    assert printed[:len(shown)] == shown


def test_verify_of_a_checkpoint_on_two_nodes(dcp_ckpts, tmp_path):
    """verify --merged CHECKPOINT, the checkpoint split over two nodes, merged in memory where it lies and compared
    with its reference (on a folder both nodes see): bit-exact, each file read on its own node."""
    ckpt = dcp_ckpts["dcp_llama_wrapped_w4"]
    disks = [tmp_path / "node0", tmp_path / "node1"]
    split_files(ckpt, disks, by_rank(r"__(\d+)_\d+\.distcp$", lambda r: (1 - r // 2,), rest=(1,)))
    runs = run_two_nodes(disks, tmp_path / "ckpt", ["verify", "--merged", tmp_path / "ckpt", "--reference",
                                                    reference_dir(ckpt)], nproc=(1, 1))
    assert [r.returncode for r in runs] == [0, 0], runs[0].log[-3000:] + runs[1].log[-3000:]
    assert re.search(r"^verify: PASS \d+ tensors bit-exact", runs[0].log, re.M), runs[0].log[-2000:]


def test_watch_a_run_on_two_nodes(fsdp_ckpts, tmp_path):
    """watch --once over a verl run whose steps' rank files lie on both nodes (ranks 0-1 on node 0, where merge rank
    0 runs; 2-3 and verl's tracker on node 1, training rank 0's): each step is finished by the tracker only node 1
    sees, and merged where it lies, byte-identical to one node's merge of it."""
    disks = [tmp_path / "node0", tmp_path / "node1"]
    for step in (2, 4):
        split_files(fsdp_ckpts["fsdp2_llama_w4"], [d / f"global_step_{step}" / "actor" for d in disks],
                    by_rank(r"rank_(\d+)\.pt$", lambda r: (r // 2,)))
    (disks[1] / "latest_checkpointed_iteration.txt").write_text("4")  # verl's tracker, by training rank 0
    out = tmp_path / "merged"
    runs = run_two_nodes(disks, tmp_path / "run", ["watch", "--once", "--input", tmp_path / "run", "--output", out],
                         nproc=(1, 1))
    assert [r.returncode for r in runs] == [0, 0], runs[0].log[-3000:] + runs[1].log[-3000:]
    one = one_node_bytes(fsdp_ckpts["fsdp2_llama_w4"], tmp_path)
    for step in (2, 4):
        assert_same_output(out / f"global_step_{step}" / "actor", one)


def test_megatron_legacy_torchtitan_and_an_average_on_two_nodes(megatron_ckpts, tt_ckpts, fsdp_ckpts, tmp_path):
    """The other layouts where they lie, each against one node's merge of all its files: Megatron-LM's legacy
    mp_rank_TT_PPP folders (pipeline stage 0 on node 0, 1 on node 1; N=3, W=4), a verl LoRA save (each rank on its
    own node, the adapter written too; N=3, W=2), torchtitan's checkpoint/step-N
    (rank 0's __0_0.distcp, .metadata and huggingface/ on node 0, ranks 1-2 on node 1; N=2, W=3), and the average
    of two FSDP2 saves, each split the other way round over the nodes (--average, N=2)."""
    legacy = megatron_ckpts["megatron_tp2pp2"]
    hf = ("--hf-config", reference_dir(legacy) / "huggingface")
    runs, out = merge_where_they_lie(legacy, by_rank(r"mp_rank_\d\d_(\d\d\d)/", lambda pp: (pp,)), tmp_path / "legacy",
                                     nproc=(1, 2), extra=hf)
    assert [r.returncode for r in runs] == [0, 0], runs[0].log[-3000:]
    assert_same_output(out, one_node_bytes(legacy, tmp_path / "legacy", *hf))

    lora = fsdp_ckpts["fsdp2_llama_lora_w2"]  # verl's LoRA run: the adapter extracted beside the model
    runs, out = merge_where_they_lie(lora, by_rank(r"rank_(\d+)\.pt$", lambda r: (r,)), tmp_path / "lora",
                                     nproc=(1, 2))
    assert [r.returncode for r in runs] == [0, 0], runs[0].log[-3000:]
    assert_same_output(out, one_node_bytes(lora, tmp_path / "lora"))
    adapter = "lora_adapter/adapter_model.safetensors"
    assert (out / adapter).read_bytes() == (tmp_path / "lora" / "one-node" / adapter).read_bytes()

    titan = tt_ckpts["tt_llama3_gqa_tied_w3"]
    runs, out = merge_where_they_lie(titan, by_rank(r"__(\d+)_\d+\.distcp$", lambda r: (min(r, 1),)),
                                     tmp_path / "titan", nproc=(1, 1))
    assert [r.returncode for r in runs] == [0, 0], runs[0].log[-3000:]
    assert_same_output(out, one_node_bytes(titan, tmp_path / "titan"))

    ckpt = fsdp_ckpts["fsdp2_llama_w4"]
    disks = [tmp_path / "avg" / "node0", tmp_path / "avg" / "node1"]
    split_files(ckpt, [d / "a" for d in disks], by_rank(r"rank_(\d+)\.pt$", lambda r: (r // 2,)))
    split_files(ckpt, [d / "b" for d in disks], by_rank(r"rank_(\d+)\.pt$", lambda r: (1 - r // 2,), rest=(1,)))
    at = tmp_path / "avg" / "run"
    out = tmp_path / "avg" / "out"
    runs = run_two_nodes(disks, at, ["merge", "--input", at / "a", "--input", at / "b", "--average", "--output", out],
                         nproc=(1, 1))
    assert [r.returncode for r in runs] == [0, 0], runs[0].log[-3000:]
    whole = tmp_path / "avg" / "whole"
    for name in ("a", "b"):
        shutil.copytree(ckpt, whole / name)
    assert_same_output(out, one_node_bytes(whole / "a", tmp_path / "avg", "--input", whole / "b", "--average"))


def test_a_remote_read_of_several_pieces_is_the_file(monkeypatch):
    """RemoteFile.pread asks for at most FETCH_PIECE bytes a request and puts the answers in place: the bytes of
    the file, whatever the offset, and no more than it holds (with 1 KiB pieces here, as with 16 MiB ones)."""
    from distmerge.input import nodes as input_nodes

    monkeypatch.setattr(input_nodes, "FETCH_PIECE", 1024)
    data = os.urandom(5000)
    asked = []

    def fetch(offset: int, nbytes: int) -> bytes:
        asked.append(nbytes)
        return data[offset:offset + nbytes]

    f = input_nodes.RemoteFile(fetch, len(data), "remote")
    assert bytes(f.pread(5001, 0)) == data and max(asked) == 1024
    assert bytes(f.pread(3000, 1500)) == data[1500:4500]
    assert bytes(f.pread(100, 4990)) == data[4990:]
    buf = bytearray(2048)
    assert f.read_full(memoryview(buf), 4000) == 1000 and bytes(buf[:1000]) == data[4000:]
    copied = bytearray()
    assert f.copy_range(100, 3000, lambda piece, at: copied.extend(piece), memoryview(bytearray(700)), "r") == 3000
    assert bytes(copied) == data[100:3100]


def test_a_lora_only_save_and_its_base_model_on_two_nodes(lora_only_ckpts, tmp_path):
    """verl's save_lora_only (the adapter's A/B only) with rank 1's file on node 1, and --base-model naming a folder
    only node 1 holds: rank 0, on node 0, finds the base model's config and headers there, node 1 reads its weights,
    and the whole model (--lora merge) is one node's merge of the same files, byte for byte."""
    ckpt = lora_only_ckpts["fsdp2_llama_lora_only_w2"]
    base = reference_dir(ckpt) / "base_model"
    node1_base = tmp_path / "base-node1"
    split_files(base, [node1_base, node1_base], lambda rel: (0,))
    seen = tmp_path / "base"
    seen.mkdir()
    disks = [tmp_path / "node0", tmp_path / "node1"]
    split_files(ckpt, disks, by_rank(r"rank_(\d+)\.pt$", lambda r: (r,)))
    out = tmp_path / "out"
    args = ["merge", "--input", tmp_path / "ckpt", "--output", out, "--base-model", seen, "--lora", "merge"]
    runs = run_two_nodes(disks, tmp_path / "ckpt", args, nproc=(1, 1), before=("", f"mount --bind {node1_base} {seen}"))
    assert [r.returncode for r in runs] == [0, 0], runs[0].log[-3000:] + runs[1].log[-3000:]
    assert_same_output(out, one_node_bytes(ckpt, tmp_path, "--base-model", base, "--lora", "merge"))


def test_verify_of_finished_models_on_node_local_disks(dcp_ckpts, tmp_path):
    """verify --merged MODEL --reference MODEL, both finished models on node-local disks: the merged model's files
    split over the two nodes (its index on node 1), the reference on node 1 only. Each file is read on the node that
    holds it; every tensor is compared, bit-exact."""
    ckpt = dcp_ckpts["dcp_llama_wrapped_w4"]
    merged = tmp_path / "merged-here"
    assert merge_inproc("--input", ckpt, "--output", merged, *SMALL_FILES) == 0
    shards = sorted(p.name for p in merged.glob("model-*.safetensors"))
    assert len(shards) >= 3
    disks = [tmp_path / "node0", tmp_path / "node1"]
    split_files(merged, [d / "merged" for d in disks],
                lambda rel: (0,) if rel in shards[: len(shards) // 2] else (1,))
    split_files(reference_dir(ckpt), [d / "reference" for d in disks], lambda rel: (1,))
    at = tmp_path / "disk"
    runs = run_two_nodes(disks, at, ["verify", "--merged", at / "merged", "--reference", at / "reference",
                                     "--json", tmp_path / "report.json"], nproc=(1, 2))
    assert [r.returncode for r in runs] == [0, 0], runs[0].log[-3000:] + runs[1].log[-3000:]
    total = len(json.loads((merged / WEIGHTS[0]).read_text())["weight_map"])
    assert re.search(rf"^verify: PASS {total} tensors bit-exact", runs[0].log, re.M), runs[0].log[-2000:]
    # node 1's ranks compare the files node 1 holds; rank 0 those of node 0, whose reference tensors only node 1 has
    per_rank = json.loads((tmp_path / "report.json").read_text())["run"]["compared_per_rank"]
    on_node_1 = sum(len(safe_open(disks[1] / "merged" / f, "pt").keys()) for f in shards[len(shards) // 2:])
    assert per_rank[1] + per_rank[2] == on_node_1 and per_rank[0] == total - on_node_1, per_rank


def test_verify_of_a_checkpoint_against_a_reference_on_one_node(dcp_ckpts, tmp_path):
    """verify --merged CHECKPOINT --reference MODEL, the checkpoint split over the nodes and the reference on node 1's
    disk only: the checkpoint's tensors are assembled where the reference lies and compared there, bit-exact."""
    ckpt = dcp_ckpts["dcp_llama_wrapped_w4"]
    disks = [tmp_path / "node0", tmp_path / "node1"]
    split_files(ckpt, [d / "ckpt" for d in disks], by_rank(r"__(\d+)_\d+\.distcp$", lambda r: (r // 2,)))
    split_files(reference_dir(ckpt), [d / "reference" for d in disks], lambda rel: (1,))
    at = tmp_path / "disk"
    runs = run_two_nodes(disks, at, ["verify", "--merged", at / "ckpt", "--reference", at / "reference"],
                         nproc=(2, 1))
    assert [r.returncode for r in runs] == [0, 0], runs[0].log[-3000:] + runs[1].log[-3000:]
    total = len(safe_open(reference_dir(ckpt) / "model.safetensors", "pt").keys())
    assert re.search(rf"^verify: PASS {total} tensors bit-exact", runs[0].log, re.M), runs[0].log[-2000:]


def test_verify_refuses_what_no_node_holds_whole(dcp_ckpts, tmp_path):
    """A reference split over the nodes' disks cannot be compared with a checkpoint (each target is compared where
    the reference lies), nor can --logits load models rank 0's node lacks: one line on every node, non-zero exits."""
    ckpt = dcp_ckpts["dcp_llama_wrapped_w4"]
    model = tmp_path / "model"
    assert merge_inproc("--input", ckpt, "--output", model, *SMALL_FILES) == 0
    disks = [tmp_path / "node0", tmp_path / "node1"]
    split_files(ckpt, [d / "ckpt" for d in disks], lambda rel: (0, 1))  # a copy on each node: read as on one
    split_files(model, [d / "reference" for d in disks], lambda rel: (0,) if "-00001-of-" in rel else (1,))
    at = tmp_path / "disk"
    runs = run_two_nodes(disks, at, ["verify", "--merged", at / "ckpt", "--reference", at / "reference"],
                         nproc=(1, 1))
    lines = [last_error(r.log) for r in runs]
    assert [r.returncode != 0 for r in runs] == [True, True] and lines[0] == lines[1], lines
    assert "no node holds all its files" in lines[0], lines[0]
    runs = run_two_nodes(disks, at, ["verify", "--merged", at / "reference", "--reference", at / "reference",
                                     "--logits"], nproc=(1, 1))
    lines = [last_error(r.log) for r in runs]
    assert [r.returncode != 0 for r in runs] == [True, True] and lines[0] == lines[1], lines
    assert "--logits loads both models on rank 0's node" in lines[0], lines[0]

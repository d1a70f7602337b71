"""Hostile checkpoints (issue 17), what test_hostile_files.py left: whose rank file is it, and is it still the
file that was listed when it is opened.

- Megatron-LM's args record the global rank that saved each `model_optim_rng.pt`: files exchanged between
  rank folders are refused (TP shards of one tensor have equal shapes, so before this a swap merged a wrong
  model with exit 0). The megatron_tp2pp2 fixture records `rank` as Megatron-LM does; the others do not.
- Every open after the walk goes through input_tree.open_input: a rank file, or a folder on its way,
  replaced by a link or a FIFO between discovery and the read is refused in one line, on rank 0 (by the
  tree) and on the other ranks (by the record that travels with the scan: simulated in process, and in one
  real 2-process torchrun); a rank file is read through the one descriptor that was checked.
- DeepSpeed ZeRO optimizer files are compared by their tensor bytes: a copy of another rank's file, renamed
  and relabelled inside so that every label fits its new name, is refused; legitimate saves never are.

How each was seen to fail is in its docstring.
"""

from __future__ import annotations

import os
import re
import shutil
import struct
import subprocess
import sys
import zipfile
import zlib
from pathlib import Path

import pytest
import torch

from distmerge.engine import discover as disc
from distmerge.engine.reader import Reader
from distmerge.errors import InputError
from distmerge.formats import copies, registry
from distmerge.formats.torch_private import state_dicts, zip_records
from distmerge.front.cli import main as distmerge_main
from distmerge.input import local as input_local
from distmerge.input import source as input_source
from distmerge.input import tree as input_tree
from tests.conftest import REPO, assert_exact, free_port, load_merged, load_reference
from tests.helpers.hostile_files import SAVE, bounded, megatron_copy, optim, rank, refused, run, swap


@pytest.fixture
def elsewhere(tmp_path: Path) -> Path:
    """A folder beside the input (test_hostile_files' `outside`): links may point there, nothing may change."""
    folder = tmp_path / "outside"
    folder.mkdir()
    (folder / "secret_token.txt").write_text("hf_secret\n")
    return folder


# -- Megatron legacy: the saving rank in args ----------------------------------------------------------------
def mp_file(ckpt: Path, folder: str) -> Path:
    return ckpt / SAVE / folder / "model_optim_rng.pt"


@pytest.mark.parametrize("a, b", [("mp_rank_00_001", "mp_rank_01_001"),  # TP ranks of one stage
                                  ("mp_rank_00_000", "mp_rank_00_001")])  # pipeline stages
def test_megatron_files_exchanged_between_rank_folders_are_refused(a, b, megatron_ckpts, tmp_path, elsewhere,
                                                                   capsys):
    """Shown to fail with megatron_legacy._check_saving_rank returning at once: both swaps merged with exit 0
    (a wrong model)."""
    ckpt = megatron_copy(megatron_ckpts, tmp_path)
    swap(mp_file(ckpt, a), mp_file(ckpt, b))
    code, lines = run("merge", ckpt, tmp_path / "out", elsewhere, capsys)
    refused(code, lines, f"{a}/ holds the file of {b}/: its args say rank", tmp_path / "out")


def test_megatron_files_in_their_own_folders_merge(megatron_ckpts, tmp_path, elsewhere, capsys):
    """The same save untouched (its args record every rank) merges exactly: the check refuses no real save.
    Shown to fail with the PP rank computed as rank % PP (rank 1 would then belong to stage 1)."""
    ckpt = megatron_copy(megatron_ckpts, tmp_path)
    code, lines = run("merge", ckpt, tmp_path / "out", elsewhere, capsys)
    assert code == 0, lines
    assert_exact(load_merged(tmp_path / "out"), load_reference(megatron_ckpts["megatron_tp2pp2"]))


def test_megatron_converter_saves_recording_rank_0_everywhere_merge(megatron_ckpts, tmp_path, elsewhere, capsys):
    """Megatron-LM's checkpoint converter (tools/checkpoint) saves every rank's file from one process: each
    records rank 0. Such a save merges; rank 0 says nothing about the folder. Shown to fail with rank 0
    checked like any other: "mp_rank_01_000/ holds the file of mp_rank_00_000/"."""
    ckpt = megatron_copy(megatron_ckpts, tmp_path)
    for path in (ckpt / SAVE).glob("mp_rank_*/model_optim_rng.pt"):
        set_saved_rank(path, 0)
    code, lines = run("merge", ckpt, tmp_path / "out", elsewhere, capsys)
    assert code == 0, lines
    assert_exact(load_merged(tmp_path / "out"), load_reference(megatron_ckpts["megatron_tp2pp2"]))


def set_saved_rank(path: Path, rank: int) -> None:
    """Rewrite `args.rank` in a Megatron file's pickle in place (a BININT1 after the key `rank` and its memo
    put; same length) and the record's CRC in both zip headers: as if that process had saved it."""
    data = bytearray(path.read_bytes())
    with zipfile.ZipFile(path) as archive:
        info = next(i for i in archive.infolist() if i.filename.endswith("/data.pkl"))
    name_len, extra_len = struct.unpack_from("<HH", data, info.header_offset + 26)
    start = info.header_offset + 30 + name_len + extra_len
    pkl = data[start : start + info.file_size]
    [at] = [m.end() for m in re.finditer(rb"X\x04\x00\x00\x00rank(?:q.|r....)K", pkl, re.DOTALL)]
    pkl[at] = rank
    data[start : start + len(pkl)] = pkl
    crc = zlib.crc32(pkl)
    struct.pack_into("<I", data, info.header_offset + 14, crc)
    entry = data.find(b"PK\x01\x02" + data[info.header_offset + 4 : info.header_offset + 14])
    while data[entry + 46 : entry + 46 + name_len] != info.filename.encode():
        entry = data.find(b"PK\x01\x02", entry + 4)
    struct.pack_into("<I", data, entry + 16, crc)
    path.write_bytes(data)
    with zipfile.ZipFile(path) as archive:
        assert archive.testzip() is None


# -- opened again after the walk: only the file that was listed ----------------------------------------------
def link_out(path: Path, outside: Path) -> None:
    """The file becomes a link to an outside copy of itself: same bytes, same size; only its kind tells."""
    shutil.copy(path, outside / path.name)
    path.unlink()
    path.symlink_to(outside / path.name)


def fifo(path: Path, outside: Path) -> None:
    path.unlink()
    os.mkfifo(path)


def replaced(path: Path, outside: Path) -> None:
    """Another rank's file (same size) renamed over it: a new inode."""
    shutil.copy(path.with_name(path.name.replace("rank_1", "rank_2")), path.with_suffix(".tmp"))
    path.with_suffix(".tmp").rename(path)


def folder_links_out(path: Path, outside: Path) -> None:
    """The save folder on the file's way moved out and linked back: the file itself is untouched."""
    folder = path.parent.parent
    shutil.move(folder, outside / folder.name)
    folder.symlink_to(outside / folder.name)


@pytest.mark.parametrize("damage, words", [
    (link_out, "cannot be opened (Too many levels of symbolic links)"),
    (fifo, "is not the regular file distmerge listed (now a FIFO"),
    (replaced, "is not the regular file distmerge listed (now a regular file"),
])
def test_rank_file_swapped_after_discovery_is_refused(damage, words, fsdp_ckpts, tmp_path, elsewhere, capsys,
                                                      monkeypatch):
    """The file is damaged right after discovery (a hook on discover), before any rank file is read. Shown to
    fail with open_input opening the path (os.open, no O_NOFOLLOW, no fstat check): the link was followed
    (exit 0), the FIFO blocked until the alarm, the replacement was read and refused only later, by its
    device mesh; with the fstat check but no inode comparison, the replacement likewise."""
    ckpt = Path(shutil.copytree(fsdp_ckpts["fsdp2_llama_w4"], tmp_path / "ckpt", symlinks=True))
    after_walk(monkeypatch, lambda: damage(rank(ckpt, 1), elsewhere))
    code, lines = merge_bounded(ckpt, tmp_path / "out", elsewhere, capsys)
    refused(code, lines, words, tmp_path / "out")
    assert "model_world_size_4_rank_1.pt" in lines[0]


def test_save_folder_swapped_for_a_link_after_discovery_is_refused(megatron_ckpts, tmp_path, elsewhere, capsys,
                                                                   monkeypatch):
    """No link is followed on the way to a file either (each folder opened with O_NOFOLLOW). Shown to fail with
    the folders opened by path (O_NOFOLLOW on the last component only): the link was followed, exit 0."""
    ckpt = megatron_copy(megatron_ckpts, tmp_path)
    after_walk(monkeypatch, lambda: folder_links_out(mp_file(ckpt, "mp_rank_00_000"), elsewhere))
    code, lines = merge_bounded(ckpt, tmp_path / "out", elsewhere, capsys)
    refused(code, lines, "cannot be opened (", tmp_path / "out")


def after_walk(monkeypatch, damage) -> None:
    real = disc.discover

    def discover_then_damage(*args, **kwargs):
        found = real(*args, **kwargs)
        damage()
        return found

    monkeypatch.setattr(disc, "discover", discover_then_damage)


def merge_bounded(ckpt: Path, out: Path, outside: Path, capsys) -> tuple[int, list[str]]:
    with bounded():
        code = distmerge_main(["merge", "--quiet", "--input", str(ckpt), "--output", str(out)])
    err = capsys.readouterr().err
    assert "Traceback" not in err and (outside / "secret_token.txt").read_text() == "hf_secret\n"
    assert not out.exists() or not list(out.rglob("secret_token.txt"))
    return code, [line for line in err.splitlines() if line.strip()]


def test_another_rank_opens_by_the_record_sent_with_the_scan(fsdp_ckpts, tmp_path, elsewhere, monkeypatch):
    """A rank other than 0 has no walk of its own: it opens by the record in the scan (Walked). Shown to fail
    with Reader not adopting it: open_input followed the link (DID NOT RAISE)."""
    ckpt = Path(shutil.copytree(fsdp_ckpts["fsdp2_llama_w4"], tmp_path / "ckpt", symlinks=True))
    with input_source.fresh_session():
        found = disc.discover(disc.check_input(ckpt), "auto", None, {})
    with input_source.fresh_session():  # now as in another process: only the scan came over
        reader = Reader(found.scan, registry.get(found.scan.format))
        try:
            frags = reader.open([0, 2])
            link_out(rank(ckpt, 1), elsewhere)
            with bounded(), pytest.raises(InputError, match="rank_1.pt cannot be opened"):
                reader.open([1])
            frag = next(f for f in frags if f.file_index == 2 and f.byte_offset >= 0)
            shutil.copy(rank(ckpt, 3), rank(ckpt, 2).with_suffix(".tmp"))  # rank 2's bytes are read later, by fd:
            rank(ckpt, 2).with_suffix(".tmp").rename(rank(ckpt, 2))  # that open is checked too (same host: inode)
            with pytest.raises(InputError, match="rank_2.pt is not the regular file distmerge listed"):
                reader.read_into(frag, torch.empty(frag.nbytes, dtype=torch.uint8))
            monkeypatch.setattr(input_tree, "host_id", lambda: "another-node/boot")  # inodes are not compared there,
            with open(rank(ckpt, 3), "ab") as f:  # sizes are
                f.write(b"\0")
            with pytest.raises(InputError, match="listed with 220,761"):
                reader.open([3])
        finally:
            reader.close()


AFTER_WALK = """
import shutil, sys
from pathlib import Path
from distmerge.engine import plan
from distmerge.engine import discover
from distmerge.front.cli import main

walk = discover.discover


def walk_then_damage(*args, **kwargs):  # rank 0 only: after its walk, before rank 1 opens its files
    found = walk(*args, **kwargs)
    readers = plan.assign_readers(found.scan.files, 2)
    victim = Path(found.scan.root) / next(f.path for f, r in zip(found.scan.files, readers) if r == 1)
    shutil.copy(victim, Path(sys.argv[1]) / victim.name)
    victim.unlink()
    victim.symlink_to(Path(sys.argv[1]) / victim.name)
    print("damaged", victim.name, file=sys.stderr)
    return found


discover.discover = walk_then_damage
sys.exit(main(sys.argv[2:]))
"""


def test_rank_1_refuses_a_file_swapped_after_rank_0_walked(fsdp_ckpts, tmp_path, elsewhere):
    """A real 2-process torchrun: rank 0 walks, then one of rank 1's files becomes a link (to an identical copy
    outside). Rank 1 opens by the record that came with the scan and refuses it; every rank stops with that
    line. Shown to fail with Reader not adopting the record: rank 1 followed the link, exit 0."""
    ckpt = Path(shutil.copytree(fsdp_ckpts["fsdp2_llama_w4"], tmp_path / "ckpt", symlinks=True))
    script = tmp_path / "after_walk.py"
    script.write_text(AFTER_WALK)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--nnodes", "1", "--master-addr",
           "127.0.0.1", "--master-port", str(free_port()), str(script), str(elsewhere), "merge", "--quiet",
           "--input", str(ckpt), "--output", str(tmp_path / "out")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "PYTHONPATH": str(REPO)}
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env, cwd=REPO)
    victim = run.stderr.split("damaged ", 1)[1].split()[0]
    errors = [line for line in run.stderr.splitlines() if line.startswith("distmerge: error:")]
    assert run.returncode != 0, run.stderr[-2000:]
    assert len(errors) == 1 and f"{victim} cannot be opened (Too many levels of symbolic links)" in errors[0], errors
    assert not (tmp_path / "out" / "model.safetensors.index.json").exists()


def test_rank_file_is_read_through_the_descriptor_that_was_checked(fsdp_ckpts, tmp_path, monkeypatch):
    """The zip directory, the pickle and the storage offsets of a rank file all come from one descriptor, opened
    through input_tree.open_input: a swap between the zip checks and the pickle read changes nothing. (With
    torch.load by name, which distmerge used before, the link was followed and rank 2's tensors came back.)"""
    ckpt = Path(shutil.copytree(fsdp_ckpts["fsdp2_llama_w4"], tmp_path / "ckpt", symlinks=True))
    input_local.load(ckpt)
    checked = zip_records.records

    def check_then_swap(fd, where, *args):
        found = checked(fd, where, *args)
        if where == str(rank(ckpt, 1)) and not rank(ckpt, 1).is_symlink():
            rank(ckpt, 1).unlink()
            rank(ckpt, 1).symlink_to(rank(ckpt, 2))
        return found

    monkeypatch.setattr(zip_records, "records", check_then_swap)
    def read(path: Path) -> state_dicts.RankFile:
        return state_dicts.read_rank_file(input_source.of(path), path)  # the walked input's source, for ckpt

    got = read(rank(ckpt, 1))
    want = read(fsdp_ckpts["fsdp2_llama_w4"] / rank(ckpt, 1).name)
    other = read(fsdp_ckpts["fsdp2_llama_w4"] / rank(ckpt, 2).name)
    def saver(saved: state_dicts.RankFile) -> int:
        return vars(state_dicts.dtensor_parts("lm_head.weight", saved.state["lm_head.weight"])[1].mesh)["_rank"]

    assert rank(ckpt, 1).is_symlink()
    assert (saver(got), saver(want), saver(other)) == (1, 1, 2)
    assert got.storage_offsets == want.storage_offsets


# -- DeepSpeed ZeRO: a copy of another rank's partition, whatever its labels ----------------------------------
def relabelled_copy(ckpt: Path, source: int, target: int) -> None:
    """Rank `source`'s optimizer file under rank `target`'s name, the folder name inside its archive rewritten
    to match (same length: offsets and CRCs stay valid), so no name or label says which rank it was."""
    data = optim(ckpt, source).read_bytes()
    old, new = (f"{optim(ckpt, r).stem}/".encode() for r in (source, target))
    assert old in data
    optim(ckpt, target).write_bytes(data.replace(old, new))


@pytest.mark.parametrize("fixture", ["ds_z3_fp32_w2", "ds_z2_fp32_w2"])
def test_relabelled_copy_of_another_ranks_optimizer_file_is_refused(fixture, ds_ckpts, tmp_path, elsewhere,
                                                                     capsys):
    """ZeRO-3 files record no rank. Shown to fail with check_own_files not calling copies.payload_twin: ZeRO-3
    merged a wrong model with exit 0; ZeRO-2 was refused later by its param_slice_mappings (a label too, which
    a forger may rewrite; the bytes check does not depend on it)."""
    ckpt = Path(shutil.copytree(ds_ckpts[fixture], tmp_path / "ckpt", symlinks=True))
    relabelled_copy(ckpt, 0, 1)
    code, lines = run("merge", ckpt, tmp_path / "out", elsewhere, capsys)
    refused(code, lines, "zero_pp_rank_1_mp_rank_00_optim_states.pt holds the same tensor bytes as", tmp_path / "out")


def test_payload_check_refuses_only_equal_payloads(ds_ckpts, tmp_path):
    """Sampled blocks only pick candidates; the full comparison decides, so partitions that agree in every
    sampled block (constant tensors: norm weights, padding, Adam moments before a step) are never refused.
    A relabelled copy with one byte changed between two sampled blocks has the same fingerprint and is not
    refused. Shown to fail with payload_twin trusting the fingerprints alone (it returned the pair). Every
    real ZeRO save's optimizer files pass (all DeepSpeed fixtures; tests/test_merge_deepspeed.py merges them)."""
    for name, source in ds_ckpts.items():
        save = next((p for p in source.rglob("global_step*") if p.is_dir()), None)
        optims = sorted(save.glob("*optim_states.pt")) if save else []
        assert copies.payload_twin(input_source.looking_at(source), optims) is None, name
    ckpt = Path(shutil.copytree(ds_ckpts["ds_z3_fp32_w2"], tmp_path / "ckpt", symlinks=True))
    relabelled_copy(ckpt, 0, 1)
    src = input_source.looking_at(ckpt)
    assert copies.payload_twin(src, [optim(ckpt, 0), optim(ckpt, 1)]) == (optim(ckpt, 0), optim(ckpt, 1))
    fd = os.open(optim(ckpt, 1), os.O_RDONLY)
    spans = copies._spans(fd, "test")
    os.close(fd)
    total = sum(size for _, size in spans)
    step = (total - copies.BLOCK) // (copies.SAMPLES - 1)
    assert step > 2 * copies.BLOCK, "the payload is too small to fall between sampled blocks"
    [(at, _)] = copies._pieces(spans, step + copies.BLOCK + 8, 1)  # between the 2nd and 3rd sampled blocks
    before = copies._fingerprint(src, optim(ckpt, 1))
    with open(optim(ckpt, 1), "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0xFF]))
    assert copies._fingerprint(src, optim(ckpt, 1)) == before
    assert copies.payload_twin(src, [optim(ckpt, 0), optim(ckpt, 1)]) is None

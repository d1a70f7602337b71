"""Hostile checkpoints (issue 17): files, links, counts and identity.

Each case turns a private copy of a real save (FSDP2 W=4, Megatron TP2 x PP2, DeepSpeed ZeRO-2 W=2) into what
an attacker or an accident leaves: links out of the input, FIFOs and devices, huge or deeply nested small
files, counts in names that would be enumerated, a DeviceMesh that would allocate gigabytes, a rank file
replaced by another rank's. Every merge runs in process under `bounded` (10 s, 1.5 GiB more address space)
and must either refuse with one `distmerge: error:` line (no traceback, no index) or succeed with the exact
model. The input tree is unchanged (merge_inproc hashes every entry), and so is a sentinel folder outside
it, none of whose files may land in the output.

How each test was seen to fail: run against the code before these checks (the commit they were written on,
distmerge/ only, these tests unchanged), every case but the two "left behind" ones failed: the secret copied
into the output (huggingface/ linked out); exit 0, a wrong or foreign model, from an outside config.json, a
linked-out iter_N/, and a copied, linked or swapped rank file (FSDP, Megatron, ZeRO-3); the FIFO hung until
`bounded` stopped it; /dev/zero and `model_world_size_99999999999` ran out of address space (MemoryError);
deep JSON gave "internal error ... RecursionError"; a non-UTF-8 tracker an uncaught UnicodeDecodeError
(inspect: tracebacks); 64 MB markers were read whole, then refused with another message; ZeRO-2 copies and
swaps were refused as "a parameter order distmerge does not know; please report it"; the stride-0 mesh as an
internal error; the grid and overlap checks overran their bounds. The two "left behind" tests failed with
copy_hf_files made to copy every non-folder entry by name; the walk test with small files opened by name,
without O_NOFOLLOW and the inode check. Each case's comment names its guard.
"""

from __future__ import annotations

import math
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from distmerge.errors import InputError
from distmerge.formats.base import Fragment
from tests.conftest import assert_exact, expected_tensors, load_merged
from tests.helpers.hostile_files import SAVE, bounded, megatron_copy, optim, rank, refused, run, swap

# -- FSDP2, W=4 ----------------------------------------------------------------------------------------------


def hf_folder_links_out(ckpt: Path, outside: Path) -> None:  # discover._check_hf_dir
    shutil.rmtree(ckpt / "huggingface")
    (ckpt / "huggingface").symlink_to(outside)


def hf_config_links_out(ckpt: Path, outside: Path) -> None:  # read_config through the tree
    (ckpt / "huggingface" / "config.json").unlink()
    (ckpt / "huggingface" / "config.json").symlink_to(outside / "config.json")


def fsdp_config_fifo(ckpt: Path, outside: Path) -> None:  # input_tree records FIFOs as refused
    (ckpt / "fsdp_config.json").unlink()
    os.mkfifo(ckpt / "fsdp_config.json")


def fsdp_config_dev_zero(ckpt: Path, outside: Path) -> None:
    (ckpt / "fsdp_config.json").unlink()
    (ckpt / "fsdp_config.json").symlink_to("/dev/zero")


def fsdp_config_huge(ckpt: Path, outside: Path) -> None:  # read_small's cap (sparse: 0 bytes on disk)
    with open(ckpt / "fsdp_config.json", "r+b") as f:
        f.truncate(64 << 20)


def config_nested(ckpt: Path, outside: Path) -> None:  # read_json's depth bound (else RecursionError)
    (ckpt / "huggingface" / "config.json").write_text("[" * 200_000 + "]" * 200_000)


def config_not_utf8(ckpt: Path, outside: Path) -> None:
    (ckpt / "huggingface" / "config.json").write_bytes(b'{"a": "\xff\xfe"}')


def world_size_in_name(ckpt: Path, outside: Path) -> None:  # fsdp._check_ranks (else set(range(10**11)))
    rank(ckpt, 0).rename(ckpt / "model_world_size_99999999999_rank_0.pt")
    for r in (1, 2, 3):
        rank(ckpt, r).unlink()
    (ckpt / "fsdp_config.json").unlink()


def rank_copied(ckpt: Path, outside: Path) -> None:  # copies.first_copy in fsdp.scan
    shutil.copy(rank(ckpt, 0), rank(ckpt, 1))


def rank_linked(ckpt: Path, outside: Path) -> None:
    rank(ckpt, 1).unlink()
    rank(ckpt, 1).symlink_to(rank(ckpt, 0).name)


def ranks_swapped(ckpt: Path, outside: Path) -> None:  # archive_name.check_saved_names (else 21/21 wrong)
    swap(rank(ckpt, 0), rank(ckpt, 1))


def ranks_swapped_relabelled(ckpt: Path, outside: Path) -> None:  # mesh_record.check_mesh's `_rank`
    swap(rank(ckpt, 0), rank(ckpt, 1), relabelled=True)


def mesh_stride_zero(ckpt: Path, outside: Path) -> None:  # mesh_record.check_mesh (else mesh.mesh allocates)
    import torch.distributed.tensor  # noqa: F401 - torch.load rebuilds DTensors only once it is imported
    from torch.distributed._mesh_layout import _MeshLayout

    state = torch.load(rank(ckpt, 2), weights_only=True)
    for value in state.values():
        value._spec.mesh.__dict__["_layout"] = _MeshLayout.from_sizes_strides((30000, 30000), (0, 0))
    torch.save(state, rank(ckpt, 2))


FSDP_CASES: dict[str, tuple[Callable, str]] = {
    "huggingface/ links outside": (hf_folder_links_out, "leads outside the input folder"),
    "config.json links outside": (hf_config_links_out, "leads outside the input folder"),
    "fsdp_config.json is a FIFO": (fsdp_config_fifo, "a FIFO"),
    "fsdp_config.json links to /dev/zero": (fsdp_config_dev_zero, "leads outside the input folder"),
    "fsdp_config.json is 64 MB": (fsdp_config_huge, "is larger than a fsdp_config.json can be"),
    "config.json nested 200k deep": (config_nested, "nests 200000 levels deep"),
    "config.json not UTF-8": (config_not_utf8, "is not UTF-8 text"),
    "world size 99999999999 in a name": (world_size_in_name, "and 99,999,999,990 more of world size"),
    "rank 1 a copy of rank 0": (rank_copied, "model_world_size_4_rank_1.pt is the same file as"),
    "rank 1 a link to rank 0": (rank_linked, "model_world_size_4_rank_1.pt is the same file as"),
    "ranks 0 and 1 swapped": (ranks_swapped, "model_world_size_4_rank_0.pt was saved as model_world_size_4_rank_1"),
    "ranks swapped, archives relabelled": (ranks_swapped_relabelled,
                                           "saved by rank 1 (its device mesh says so), not by rank 0"),
    "DeviceMesh with stride-0 dims": (mesh_stride_zero, "its device mesh spans 900000000 ranks"),
}


@pytest.mark.parametrize("case", list(FSDP_CASES))
def test_hostile_fsdp(case, fsdp_ckpts, tmp_path, outside, capsys):
    damage, words = FSDP_CASES[case]
    ckpt = Path(shutil.copytree(fsdp_ckpts["fsdp2_llama_w4"], tmp_path / "ckpt", symlinks=True))
    damage(ckpt, outside)
    code, lines = run("merge", ckpt, tmp_path / "out", outside, capsys)
    refused(code, lines, words, tmp_path / "out")


def tokenizer_links_out(ckpt: Path, outside: Path) -> None:  # finalize.copy_hf_files: regular files only
    (ckpt / "huggingface" / "tokenizer.json").unlink()
    (ckpt / "huggingface" / "tokenizer.json").symlink_to(outside / "secret_token.txt")


def generation_config_fifo(ckpt: Path, outside: Path) -> None:  # never opened: the copy would block forever
    (ckpt / "huggingface" / "generation_config.json").unlink()
    os.mkfifo(ckpt / "huggingface" / "generation_config.json")


@pytest.mark.parametrize("damage, left", [(tokenizer_links_out, "tokenizer.json"),
                                          (generation_config_fifo, "generation_config.json")])
def test_stray_entries_in_the_config_folder_are_left_behind(damage, left, fsdp_ckpts, tmp_path, outside, capsys):
    """A link out or a FIFO among the tokenizer files: the model is merged exactly, the entry is not copied."""
    source = fsdp_ckpts["fsdp2_llama_w4"]
    ckpt = Path(shutil.copytree(source, tmp_path / "ckpt", symlinks=True))
    damage(ckpt, outside)
    code, lines = run("merge", ckpt, tmp_path / "out", outside, capsys)
    assert code == 0, lines
    assert_exact(load_merged(tmp_path / "out"), expected_tensors(source))
    copied = {p.name for p in (tmp_path / "out").iterdir()}
    assert "tokenizer_config.json" in copied and left not in copied


# -- Megatron legacy, TP2 x PP2 ------------------------------------------------------------------------------


def iteration_links_out(ckpt: Path, outside: Path) -> None:  # the tree, not iter_N's own resolution, anchors
    shutil.move(ckpt / SAVE, outside / SAVE)
    (ckpt / SAVE).symlink_to(outside / SAVE)


def tracker_not_utf8(ckpt: Path, outside: Path) -> None:
    (ckpt / "latest_checkpointed_iteration.txt").write_bytes(b"\xff\xfe1")


def tracker_huge(ckpt: Path, outside: Path) -> None:
    with open(ckpt / "latest_checkpointed_iteration.txt", "r+b") as f:
        f.truncate(64 << 20)


def megatron_rank_copied(ckpt: Path, outside: Path) -> None:  # copies.first_copy in megatron_legacy.scan
    shutil.copy(ckpt / SAVE / "mp_rank_00_001" / "model_optim_rng.pt", ckpt / SAVE / "mp_rank_01_001" /
                "model_optim_rng.pt")


MEGATRON_CASES: dict[str, tuple[Callable, str]] = {
    "iter_N links outside": (iteration_links_out, "leads outside the input folder"),
    "tracker not UTF-8": (tracker_not_utf8, "is not UTF-8 text"),
    "tracker of 64 MB": (tracker_huge, "is larger than a Megatron iteration tracker can be"),
    "TP rank 1 a copy of TP rank 0": (megatron_rank_copied, "mp_rank_01_001/model_optim_rng.pt is the same file as"),
}


@pytest.mark.parametrize("case", list(MEGATRON_CASES))
def test_hostile_megatron(case, megatron_ckpts, tmp_path, outside, capsys):
    damage, words = MEGATRON_CASES[case]
    ckpt = megatron_copy(megatron_ckpts, tmp_path)
    damage(ckpt, outside)
    code, lines = run("merge", ckpt, tmp_path / "out", outside, capsys)
    refused(code, lines, words, tmp_path / "out")


@pytest.mark.parametrize("damage, words", [(tracker_not_utf8, "is not UTF-8 text"),
                                           (config_nested, "nests 200000 levels deep")])
def test_inspect_refuses_in_one_line(damage, words, megatron_ckpts, tmp_path, outside, capsys):
    """`inspect` shares merge's error handling: one line, no traceback (it printed Python's before)."""
    ckpt = megatron_copy(megatron_ckpts, tmp_path)
    damage(ckpt, outside)
    code, lines = run("inspect", ckpt, tmp_path / "out", outside, capsys)
    refused(code, lines, words, tmp_path / "out")


def test_rank_grid_from_a_folder_name_is_not_enumerated(tmp_path):
    """`mp_rank_99_999_999` makes a 100 x 1000 x 1000 grid: the missing folders are named without walking it
    (megatron_grid._check_complete; enumerating it took minutes)."""
    from distmerge.formats.megatron.grid import _check_complete

    coords = {"mp_rank_00_000_000/model.pt": (0, 0, 0), "mp_rank_99_999_999/model.pt": (99, 999, 999)}
    with bounded(seconds=2), pytest.raises(InputError, match="missing for TP 0 PP 0 EP 1, TP 0 PP 0 EP 2"):
        _check_complete(tmp_path, coords, 100, 1000, 1000)


# -- DeepSpeed ZeRO-2, W=2 ----------------------------------------------------------------------------------


def optim_copied(ckpt: Path, outside: Path) -> None:  # deepspeed_layout.check_own_files
    shutil.copy(optim(ckpt, 0), optim(ckpt, 1))


def optims_swapped(ckpt: Path, outside: Path) -> None:
    """ZeRO-1/2: deepspeed_layout.partition_owner (the file's param_slice_mappings); ZeRO-3, whose files record
    no rank: archive_name.check_saved_name (else a wrong model, exit 0)."""
    swap(optim(ckpt, 0), optim(ckpt, 1))


def latest_huge(ckpt: Path, outside: Path) -> None:
    with open(ckpt / "latest", "r+b") as f:
        f.truncate(64 << 20)


DEEPSPEED_CASES: dict[str, tuple[str, Callable, str]] = {
    "rank 1's optimizer file a copy of rank 0's": ("ds_z2_fp32_w2", optim_copied, "is the same file as"),
    "ZeRO-2 optimizer files swapped": ("ds_z2_fp32_w2", optims_swapped, "holds data-parallel rank 1's partition"),
    "ZeRO-3 optimizer files swapped": ("ds_z3_fp32_w2", optims_swapped,
                                       "zero_pp_rank_0_mp_rank_00_optim_states.pt was saved as zero_pp_rank_1"),
    "`latest` of 64 MB": ("ds_z2_fp32_w2", latest_huge, "is larger than a DeepSpeed `latest` tag file can be"),
}


@pytest.mark.parametrize("case", list(DEEPSPEED_CASES))
def test_hostile_deepspeed(case, ds_ckpts, tmp_path, outside, capsys):
    fixture, damage, words = DEEPSPEED_CASES[case]
    ckpt = Path(shutil.copytree(ds_ckpts[fixture], tmp_path / "ckpt", symlinks=True))
    damage(ckpt, outside)
    code, lines = run("merge", ckpt, tmp_path / "out", outside, capsys)
    refused(code, lines, words, tmp_path / "out")


# -- the plan's overlap check ---------------------------------------------------------------------------------
def grid_blocks(n: int, skew: int = 0) -> list[Fragment]:
    """A 3-D tensor cut n x n x n (DCP chunks of a 3-D-sharded tensor); `skew` moves the last block back."""
    blocks = []
    for i in range(n):
        for j in range(n):
            for k in range(n):
                back = skew if (i, j, k) == (n - 1,) * 3 else 0
                blocks.append(Fragment(name="w", dtype="F32", global_shape=(2 * n, 2 * n, 2 * n),
                                       offsets=(2 * i, 2 * j, 2 * k - back), lengths=(2, 2, 2), file_index=0,
                                       byte_offset=0, key="w"))
    return blocks


def test_overlap_check_of_85k_chunks_takes_seconds():
    """44^3 = 85,184 chunks: the grid check is O(n log n) (the pairwise sweep it replaces took over 60 s)."""
    from distmerge.engine.coverage import check_coverage
    from distmerge.errors import LayoutError

    blocks = grid_blocks(44)
    with bounded(seconds=8):
        check_coverage("w", blocks[0].global_shape, tuple(blocks))
    skewed = grid_blocks(44, skew=1)
    with bounded(seconds=8), pytest.raises(LayoutError, match="overlap"):
        check_coverage("w", skewed[0].global_shape, tuple(skewed))
    assert math.prod(blocks[0].global_shape) == 8 * len(blocks)


# -- the walk and the re-check when opening -----------------------------------------------------------------
def test_files_swapped_after_the_walk_are_refused(tmp_path):
    """The walk records each file's inode; opening re-checks it with O_NOFOLLOW and fstat. Shown to fail by
    opening without O_NOFOLLOW and without the inode comparison (both swaps were then read)."""
    from distmerge.input import local as input_local
    from distmerge.input import tree as input_tree

    root = tmp_path / "in"
    root.mkdir()
    for name in ("a.json", "b.json", "..c.json"):  # `..c.json` is a name inside, not a way out
        (root / name).write_text('{"n": 1}')
    (root / "alias.json").symlink_to("a.json")  # a link that stays inside reads as its target
    (tmp_path / "outside.json").write_text('{"n": 2}')
    input_local.load(root)
    assert input_tree.read_json(root / "alias.json", 100, "test file") == {"n": 1}
    assert input_tree.read_json(root / "..c.json", 100, "test file") == {"n": 1}
    (root / "a.json").unlink()
    (root / "a.json").symlink_to(tmp_path / "outside.json")
    with pytest.raises(InputError, match="cannot be opened"):
        input_tree.read_json(root / "a.json", 100, "test file")
    (root / "b.json").rename(root / "old.json")
    (root / "b.json").write_text('{"n": 3}')
    with pytest.raises(InputError, match="not the regular file distmerge listed"):
        input_tree.read_json(root / "b.json", 100, "test file")
    with pytest.raises(InputError, match="not a regular file of the input"):  # appeared after the walk
        input_tree.read_json(root / "old.json", 100, "test file")
    with pytest.raises(InputError, match="larger than a test file can be"):
        input_tree.read_json(root / "..c.json", 4, "test file")

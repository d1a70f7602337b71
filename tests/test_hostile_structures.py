"""Hostile checkpoints (issue 29): the five crafted cases the earlier guards missed, each ending in one
`distmerge: error:` line that names the file and what is wrong, within time and memory bounds.

How each was seen to fail before its guard (same cases, distmerge at the commit before it):
- a torchtitan step whose `.metadata` links out of the input: refused, but as "does not use torchtitan's names"
  (detection swallowed the link refusal), which sends the user to the wrong fix; plain DCP and torch_dist
  folders already named the link (kept here so it stays so);
- a `.metadata` declaring 10^7 chunks through one shared chunk object (20 MB): killed at 60 s and 3.9 GB, or
  refused after a minute for its byte count (a Chunk record was built per declared chunk);
- a DTensor placed `Shard(7)` on a 2-D tensor: "internal error ... IndexError" (torch.load rebuilt it, the offset
  code indexed the shape);
- rank files that link to each other in a loop: "internal error ... OSError: [Errno 40] Too many levels of
  symbolic links" (the walk recorded the loop as a link inside the input, the scan's stat followed it);
- a Megatron rank file whose zip end record puts the central directory past the end of the file: merged, exit 0
  (zipfile took the gap for data prepended to the archive) or, for other offsets, "internal error ... OSError:
  [Errno 22] Invalid argument" (a negative read offset).
"""

from __future__ import annotations

import copy
import pickle
import shutil
import struct
from pathlib import Path

import pytest
import torch

from distmerge.errors import LayoutError
from distmerge.formats.torch_private.state_dicts import placement_of
from tests.conftest import assert_exact, expected_tensors, load_merged, merge_inproc
from tests.helpers.hostile_files import SAVE, make_outside, megatron_copy, rank, refused, run

FIXTURES = {"dcp": "dcp_ckpts", "megatron": "megatron_ckpts", "torchtitan": "tt_ckpts"}


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    return make_outside(tmp_path)


def link_out(path: Path, outside: Path) -> None:
    shutil.move(path, outside / path.name)
    path.symlink_to(outside / path.name)


@pytest.mark.parametrize("family, case, metadata", [
    ("dcp", "dcp_llama_w2", ".metadata"),
    ("megatron", "megatron_dist_tp2", f"{SAVE}/.metadata"),
    ("torchtitan", "tt_llama3_gqa_tied_w3", "checkpoint/step-*/.metadata"),
])
def test_metadata_linked_out_of_the_input_is_refused(family, case, metadata, request, tmp_path, outside, capsys):
    saves = request.getfixturevalue(FIXTURES[family])
    ckpt = Path(shutil.copytree(saves[case], tmp_path / "ckpt", symlinks=True))
    target = max(ckpt.glob(metadata))
    link_out(target, outside)
    code, lines = run("merge", ckpt, tmp_path / "out", outside, capsys)
    refused(code, lines, f"{target} leads outside the input folder", tmp_path / "out")


def test_a_ten_million_chunk_declaration_is_refused_in_seconds(dcp_ckpts, tmp_path, outside, capsys):
    """One chunk object listed 10^7 times (pickle memoises it: 2 bytes a reference) is refused by counting the
    declared chunks against their storage entries, before a record is built per chunk."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    ckpt = Path(shutil.copytree(dcp_ckpts["dcp_llama_w2"], tmp_path / "ckpt"))
    chunk = ChunkStorageMetadata(offsets=torch.Size([0, 0]), sizes=torch.Size([1, 1]))
    meta = TensorStorageMetadata(properties=TensorProperties(dtype=torch.float32), size=torch.Size([10**7, 1]),
                                 chunks=[chunk] * 10**7)
    where = {MetadataIndex("model.norm.weight", torch.Size([0, 0])): _StorageInfo("__0_0.distcp", 0, 4)}
    (ckpt / ".metadata").write_bytes(pickle.dumps(Metadata(state_dict_metadata={"model.norm.weight": meta},
                                                           storage_data=where), protocol=4))
    code, lines = run("merge", ckpt, tmp_path / "out", outside, capsys, bounds=(40, 2 << 30))
    refused(code, lines, "declares 10,000,000 chunks but says where 1 of them are", tmp_path / "out")


Q_PROJ, NORM = "model.layers.0.self_attn.q_proj.weight", "model.norm.weight"  # 2-D and 1-D


def placed(ckpt: Path, key: str, dim: int, ranks: range) -> None:
    """Rewrite `key`'s placement as Shard(dim) in the given rank files; its local tensors stay as saved. Its spec
    is copied first: torch.save shares one spec among the tensors of a shape (the norms), and only `key` changes."""
    import torch.distributed.tensor  # noqa: F401 - torch.load rebuilds DTensors only once it is imported
    from torch.distributed.tensor import Shard

    for r in ranks:
        state = torch.load(rank(ckpt, r), weights_only=True)
        state[key]._spec = spec = copy.copy(state[key]._spec)
        object.__setattr__(spec, "placements", (Shard(dim),))  # DTensorSpec's __setattr__ checks its shard order
        torch.save(state, rank(ckpt, r))


# Shard(ndim) and Shard(-ndim - 1) are the first dims past each end; only Shard(7) was tried before, so a check
# loosened to `dim <= ndim` passed every test (Shard(2) on a 2-D tensor was then read as Shard(0) and merged).
@pytest.mark.parametrize("key, dim, ndim", [(Q_PROJ, 7, 2), (Q_PROJ, 2, 2), (Q_PROJ, -3, 2), (NORM, 1, 1),
                                            (NORM, -2, 1)])
def test_a_placement_on_a_dimension_the_tensor_lacks_is_refused(key, dim, ndim, fsdp_ckpts, tmp_path, outside,
                                                                capsys):
    ckpt = Path(shutil.copytree(fsdp_ckpts["fsdp2_llama_w4"], tmp_path / "ckpt"))
    placed(ckpt, key, dim, range(1, 2))
    code, lines = run("merge", ckpt, tmp_path / "out", outside, capsys)
    refused(code, lines, f"{key}: placement Shard({dim}) names a dimension its {ndim}-dimensional tensor does not "
                         "have", tmp_path / "out")


# The last dims inside each end, on every rank: Shard(-ndim) is Shard(0) counted from the end, Shard(ndim - 1) the
# fixture's own FSDP2 Shard(1) (shard_placement_fn), relabelled to itself so the case says what it holds.
@pytest.mark.parametrize("case, key, dim", [("fsdp2_llama_w4", Q_PROJ, -2), ("fsdp2_llama_w4", NORM, -1),
                                            ("fsdp2_llama_w4", NORM, 0), ("fsdp2_llama_shard1_w4", Q_PROJ, 1)])
def test_a_placement_on_the_first_or_last_dimension_is_merged(case, key, dim, fsdp_ckpts, tmp_path):
    ckpt = Path(shutil.copytree(fsdp_ckpts[case], tmp_path / "ckpt"))
    placed(ckpt, key, dim, range(4))
    assert merge_inproc("--input", ckpt, "--output", tmp_path / "out") == 0
    assert_exact(load_merged(tmp_path / "out"), expected_tensors(fsdp_ckpts[case]))  # save_pretrained's, beside it


def pickled_shard(dim: int):
    """torch's own pickle of Shard(dim), read by the restricted reader as a rank file's placements are."""
    from torch.distributed.tensor import Shard

    from distmerge.formats.torch_private import restricted
    from distmerge.formats.torch_private.state_dicts import RANK_FILE_GLOBALS

    return restricted.loads(pickle.dumps(Shard(dim)), RANK_FILE_GLOBALS)


@pytest.mark.parametrize("dim, ndim, expected", [(0, 1, 0), (-1, 1, 0), (1, 2, 1), (-2, 2, 0), (-1, 2, 1),
                                                 (2, 3, 2), (-3, 3, 0)])
def test_placement_of_reads_the_dims_a_tensor_has(dim, ndim, expected):
    assert placement_of("w", pickled_shard(dim), ndim) == expected


@pytest.mark.parametrize("dim, ndim", [(1, 1), (-2, 1), (2, 2), (-3, 2), (3, 3), (-4, 3), (7, 2)])
def test_placement_of_refuses_the_dims_a_tensor_lacks(dim, ndim):
    with pytest.raises(LayoutError, match=rf"^w: placement Shard\({dim}\) names a dimension its {ndim}-dimensional "):
        placement_of("w", pickled_shard(dim), ndim)


def test_rank_files_linked_in_a_loop_are_refused(fsdp_ckpts, tmp_path, outside, capsys):
    ckpt = Path(shutil.copytree(fsdp_ckpts["fsdp2_llama_w4"], tmp_path / "ckpt"))
    rank(ckpt, 1).unlink()
    rank(ckpt, 2).unlink()
    rank(ckpt, 1).symlink_to(rank(ckpt, 2).name)
    rank(ckpt, 2).symlink_to(rank(ckpt, 1).name)
    code, lines = run("merge", ckpt, tmp_path / "out", outside, capsys)
    refused(code, lines, "model_world_size_4_rank_1.pt leads outside the input folder or is not a plain file (a "
                         "link loop", tmp_path / "out")


@pytest.mark.parametrize("offset", [lambda size: size + 1000, lambda size: 0x7FFFFFFF, lambda size: 0xFFFFFFF0])
def test_a_zip_directory_past_the_end_is_refused(offset, megatron_ckpts, tmp_path, outside, capsys):
    ckpt = megatron_copy(megatron_ckpts, tmp_path)
    target = ckpt / SAVE / "mp_rank_00_000" / "model_optim_rng.pt"
    data = bytearray(target.read_bytes())
    end = data.rfind(b"PK\x05\x06")
    struct.pack_into("<I", data, end + 16, offset(len(data)))
    target.write_bytes(bytes(data))
    code, lines = run("merge", ckpt, tmp_path / "out", outside, capsys)
    refused(code, lines, f"{target}: its zip directory is said to lie at bytes", tmp_path / "out")
    assert "past the end of its" in lines[0]

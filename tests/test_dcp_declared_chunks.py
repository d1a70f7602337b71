"""What a DCP `.metadata` declares is checked against the files before anything is built from it (issue #17):
chunks outside their tensor (negative sizes), chunk bytes past the end of their file, and more chunk bytes in a
file than it holds (a few bytes of metadata cannot make the planner build millions of fragments). The metadata
is the real one of a `dcp.save` fixture, edited through torch's own classes and pickled back. Shown failing with
formats/dcp.py's _check_chunks removed: these small cases are then refused later, by the rank that opens the
file, once every fragment is built, with messages that blame the file instead of the metadata."""

from __future__ import annotations

import dataclasses
import pickle
import shutil
from pathlib import Path

import pytest

from distmerge.formats.torch_private.dcp import read_metadata
from distmerge.input import source
from tests.conftest import assert_refused

CASE = "dcp_llama_w2"


def edited(src: Path, dest: Path, edit) -> Path:
    ckpt = Path(shutil.copytree(src, dest))
    with open(ckpt / ".metadata", "rb") as f:
        md = pickle.load(f)  # a fixture torch wrote in this test run: trusted
    edit(md)
    with open(ckpt / ".metadata", "wb") as f:
        pickle.dump(md, f)
    return ckpt


def a_weight(md):
    return next(k for k in md.state_dict_metadata if k.endswith("q_proj.weight"))


def negative_chunk(md) -> None:
    name = a_weight(md)
    meta = md.state_dict_metadata[name]
    chunk = meta.chunks[0]
    meta.chunks[0] = dataclasses.replace(chunk, sizes=type(chunk.sizes)((-4, *chunk.sizes[1:])))


def past_the_end(md) -> None:
    index, info = next((i, s) for i, s in md.storage_data.items() if i.fqn == a_weight(md))
    md.storage_data[index] = dataclasses.replace(info, offset=info.offset + 10**9)


def many_chunks_over_the_same_bytes(md) -> None:
    name = a_weight(md)
    meta = md.state_dict_metadata[name]
    index, info = next((i, s) for i, s in md.storage_data.items() if i.fqn == name)
    rows, cols = meta.size
    chunk_type, size_type = type(meta.chunks[0]), type(meta.chunks[0].sizes)
    meta.chunks[:] = [chunk_type(offsets=size_type((r, 0)), sizes=size_type((1, cols))) for r in range(rows)]
    for r in range(rows):
        md.storage_data[dataclasses.replace(index, offset=size_type((r, 0)))] = info  # all the same bytes


def past_int64(md) -> None:
    """A tensor 2**62 + 8 rows long with a chunk of 2**62 rows at row 2**62: offset + length is 2**63, which wraps
    to a negative int64 (the columnar check once added them and let the chunk through)."""
    name = a_weight(md)
    meta = md.state_dict_metadata[name]
    size_type = type(meta.size)
    meta.size = size_type((2**62 + 8, *meta.size[1:]))
    meta.chunks[0] = dataclasses.replace(meta.chunks[0], offsets=size_type((2**62, *meta.chunks[0].offsets[1:])),
                                         sizes=size_type((2**62, *meta.chunks[0].sizes[1:])))
    index, info = next((i, s) for i, s in md.storage_data.items() if i.fqn == name and not any(i.offset))
    del md.storage_data[index]
    md.storage_data[dataclasses.replace(index, offset=meta.chunks[0].offsets)] = info


@pytest.mark.parametrize("edit, message", [
    (negative_chunk, "outside its shape"),
    (past_int64, "outside its shape"),
    (past_the_end, "truncated file or corrupt metadata"),
    (many_chunks_over_the_same_bytes, "corrupt metadata"),
], ids=["negative size", "offset + length past int64", "bytes past the end", "chunks over the same bytes"])
def test_declared_chunks_are_checked_against_the_files(edit, message, dcp_ckpts, tmp_path, capsys):
    ckpt = edited(dcp_ckpts[CASE], tmp_path / "ckpt", edit)
    assert_refused(ckpt, tmp_path / "out", message, capsys)



def test_a_huge_sparse_file_beside_the_metadata_costs_no_memory(dcp_ckpts, tmp_path):
    """The .metadata size cap grows with the .distcp bytes beside it; a 900 GB sparse file not named by the
    metadata once made the reader reserve a buffer of the whole cap ("internal error on rank 0: MemoryError").
    Now the metadata is read at its own size. (The reader is called directly: the test harness's input digest
    would read the 900 GB of zeros.) Shown to fail with `f.read(budget.max_bytes + 1)` back: MemoryError."""
    ckpt = Path(shutil.copytree(dcp_ckpts[CASE], tmp_path / "ckpt"))
    with open(ckpt / "__99_0.distcp", "wb") as f:
        f.truncate(900 * 10**9)
    md = read_metadata(source.of(ckpt / ".metadata"), ckpt / ".metadata")
    assert {c.file for c in md.chunks} == {"__0_0.distcp", "__1_0.distcp"}

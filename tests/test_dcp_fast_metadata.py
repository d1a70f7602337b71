"""DCP `.metadata` read by the fast reader (dcp_decode: runs of records decoded by regular expressions, issue #27)
gives the general reader's table, on every real save the fixtures make; whatever it does not decode goes to
the general reader, which keeps its own refusals (a hostile pickle framed as protocol 4, as torch writes, is
refused with the same words as in tests/test_hostile_pickles.py); and the chunk blobs' layouts (dcp_blobs) are
trusted only when a blob's head and zip directory are a checked blob's.
"""

from __future__ import annotations

import gc
import math
import os
import pickle
import shutil
import struct
from pathlib import Path

import pytest
import torch

from distmerge.errors import CorruptInputError
from distmerge.formats.dcp import folder as dcp_format
from distmerge.formats.torch_private import dcp, restricted
from distmerge.formats.torch_private.dcp import blobs as dcp_blobs
from distmerge.formats.torch_private.dcp import decode as dcp_decode
from distmerge.formats.torch_private.dcp import runs as dcp_runs
from distmerge.formats.torch_private.dcp import table as dcp_table
from distmerge.input import source
from tests import hostile_pickles as hp
from tests.helpers.child import CPU_LIMIT_S, EXPECTED, RSS_LIMIT, in_child

TORCH_VERSIONS = sorted((Path(__file__).parent / "data" / "torch_versions").glob("torch-*/dcp_w4"))
FIXTURES = [("dcp_ckpts", "dcp_llama_w2", "."), ("dcp_ckpts", "dcp_llama_wrapped_w4", "."),
            ("dcp_ckpts", "dcp_qwen2_tied_hsdp_2x2", "."), ("megatron_ckpts", "megatron_dist_moe_ep2", "iter_*"),
            ("megatron_ckpts", "megatron_dist_vpp", "iter_*"), ("tt_ckpts", "tt_qwen3_moe_w4", "checkpoint/step-1")]


def general(path: Path) -> dcp_table.DcpMetadata:
    md = restricted.loads(path.read_bytes(), dcp._METADATA_GLOBALS, where=str(path), storages={},
                          budget=dcp.metadata_budget(source.of(path), path))
    return dcp_table.table(md, path, [])


def fast(path: Path) -> dcp_table.DcpMetadata:
    skeleton, names = dcp_decode.decode(path.read_bytes(), dcp._METADATA_GLOBALS)
    return dcp_table.table(skeleton, path, names)


def same(a: dcp_table.DcpMetadata, b: dcp_table.DcpMetadata) -> bool:
    return all(torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
               for x, y in ((getattr(a, k), getattr(b, k)) for k in a.__dataclass_fields__))


def metadata_files(request) -> list[Path]:
    found = [p / ".metadata" for p in TORCH_VERSIONS]
    for fixture, case, folder in FIXTURES:
        found.append(max((request.getfixturevalue(fixture)[case]).glob(f"{folder}/.metadata")))
    return found


def test_the_fast_reader_gives_the_general_readers_table(request):
    """Every real save (torch 2.6 to 2.14 dcp.save, accelerate's wrapped FSDP, HSDP, Megatron torch_dist with its
    4-D stacked experts and plans that refer back to chunks, torchtitan's full checkpoint with the optimizer):
    the same tensors, dtypes, shapes, files, chunk offsets and lengths, blob offsets and lengths.
    Shown to fail: counting one MEMOIZE less per storage entry (dcp_runs.match) makes the references land on
    the wrong strings."""
    for path in metadata_files(request):
        assert same(fast(path), general(path)), path


def test_read_metadata_takes_the_fast_path_on_real_saves(request, monkeypatch):
    """The general reader is not called for what torch writes (it would cost minutes at 1024 ranks)."""
    def refuse(*args, **kwargs):
        raise AssertionError("the general reader was used")

    monkeypatch.setattr(dcp, "loads", refuse)
    for path in metadata_files(request):
        assert len(dcp.read_metadata(source.of(path), path)) > 0


def test_what_the_decoder_built_goes_without_the_cyclic_collector(request):
    """The merge runs with the cyclic GC off from discovery on (engine/run.py): the decoded skeleton, whose runs'
    columns are most of `.metadata`'s memory, must go by reference counting once the table is made. Shown to
    fail: the machine keeping its opcode handlers as bound methods (a cycle through it that kept ~0.3 GB of a
    1024-rank save's skeleton on rank 0 for the whole merge, issue #42)."""
    gc.collect()
    was = gc.isenabled()
    gc.disable()
    try:
        for path in metadata_files(request):
            table = dcp.read_metadata(source.of(path), path)
            assert len(table) > 0
            del table
            assert gc.collect() == 0, f"{path}: the decoding left objects only the cyclic collector frees"
    finally:
        if was:
            gc.enable()


def test_what_the_fast_reader_does_not_decode_goes_to_the_general_reader(dcp_ckpts, tmp_path):
    """The same Metadata pickled with protocol 2 (no frames, BINPUT): not in the fast reader's grammar, read by the
    general one, the same table."""
    src = dcp_ckpts["dcp_llama_w2"] / ".metadata"
    with open(src, "rb") as f:
        md = pickle.load(f)  # a fixture torch wrote in this test run: trusted
    folder = Path(shutil.copytree(dcp_ckpts["dcp_llama_w2"], tmp_path / "ckpt"))
    (folder / ".metadata").write_bytes(pickle.dumps(md, protocol=2))
    with pytest.raises(dcp_runs.NotDecoded):
        fast(folder / ".metadata")
    assert same(dcp.read_metadata(source.of(folder / ".metadata"), folder / ".metadata"), fast(src))


def framed(payload: bytes) -> bytes:
    """A protocol-2 hostile pickle as protocol 4 writes its opcodes: PROTO 4, one frame."""
    body = payload[2:]
    return b"\x80\x04\x95" + struct.pack("<Q", len(body)) + body


@pytest.mark.parametrize("payload", sorted(hp.PICKLES))
def test_hostile_pickles_framed_as_torch_writes_are_refused_alike(payload, dcp_ckpts, tmp_path):
    """Each payload of tests/hostile_pickles.py in protocol 4's framing (what the fast reader accepts at the door)
    as a `.metadata`: refused with the words of the general reader's refusal, nothing run, in a child under the
    CPU and memory limits of the hostile tests. Shown to fail: the fast reader's `_key` accepting tuples (the
    shared tuple key then hangs the child)."""
    marker = tmp_path / "distmerge-was-here"
    folder = Path(shutil.copytree(dcp_ckpts["dcp_llama_w2"], tmp_path / "ckpt"))
    target = folder / ".metadata"
    target.write_bytes(framed(hp.PICKLES[payload](marker)))
    result = in_child(lambda: dcp.read_metadata(source.of(target), target))
    assert result["signal"] == 0 and result["raised"] == CorruptInputError.__name__, result
    assert str(target) in result["message"] and "\n" not in result["message"]
    assert any(words in result["message"] for words in EXPECTED[payload]), result["message"]
    assert result["cpu_s"] < CPU_LIMIT_S and result["rss_above"] < RSS_LIMIT, result
    assert not marker.exists()


def test_a_storage_string_whose_length_byte_lies_is_not_decoded(dcp_ckpts, tmp_path):
    """A run's new string must be exactly as long as its length byte says (the regular expression takes the
    printable bytes up to the next MEMOIZE): one that says less is sent to the general reader, never decoded
    with the opcodes shifted. Shown to fail: without the length check in decode_storage the run decodes."""
    data = bytearray((dcp_ckpts["dcp_llama_w2"] / ".metadata").read_bytes())
    at = data.index(b"__1_0.distcp")
    assert data[at - 1] == len(b"__1_0.distcp") and data[at - 2] == 0x8C
    data[at - 1] -= 1  # SHORT_BINUNICODE of 11 bytes, then "p" read as an opcode by a real unpickler
    path = tmp_path / ".metadata"
    path.write_bytes(bytes(data))
    with pytest.raises(dcp_runs.NotDecoded, match="length byte"):
        fast(path)


def _second_blob_of_a_layout(ckpt: Path) -> tuple[dcp_blobs.Chunk, list[dcp_blobs.Chunk]]:
    metadata = ckpt / ".metadata"
    chunks = [c for c in dcp.read_metadata(source.of(metadata), metadata).chunks if c.file == "__0_0.distcp"]
    seen: dict[tuple, dcp_blobs.Chunk] = {}
    for c in sorted(chunks, key=lambda c: c.offset):
        key = (c.length, c.lengths, c.dtype)
        if key in seen:
            return c, chunks
        seen[key] = c
    raise AssertionError("no two chunks alike")


def test_a_blob_whose_directory_differs_from_its_layouts_is_checked_in_full(dcp_ckpts, tmp_path):
    """A chunk blob with the head of a checked blob but a zip directory that makes its storage record smaller
    than the tensor: not taken for the checked layout, refused as any such blob is. Shown to fail: matching
    layouts by their heads alone reads the chunk past its record."""
    ckpt = Path(shutil.copytree(dcp_ckpts["dcp_llama_w2"], tmp_path / "ckpt"))
    chunk, chunks = _second_blob_of_a_layout(ckpt)
    path = ckpt / chunk.file
    data = bytearray(path.read_bytes())
    blob = data[chunk.offset : chunk.offset + chunk.length]
    directory = blob.index(b"PK\x01\x02")  # the central directory's first entry (local headers say PK\x03\x04)
    entry = blob.rindex(b"PK\x01\x02", 0, blob.index(b"/data/0", directory))
    for field in (20, 24):  # compressed and uncompressed sizes: 4 bytes less than the tensor
        (size,) = struct.unpack_from("<I", blob, entry + field)
        struct.pack_into("<I", data, chunk.offset + entry + field, size - 4)
    path.write_bytes(bytes(data))
    dcp_blobs._LAYOUTS.clear()
    with pytest.raises(CorruptInputError, match="reaches past its storage record"):
        locate(path, chunks)


def locate(path: Path, chunks: list[dcp_blobs.Chunk]) -> list[int]:
    fd = os.open(path, os.O_RDONLY)
    try:
        return dcp_blobs.locate(fd, path.stat().st_size, [(c.offset, c.length, math.prod(c.lengths)) for c in chunks],
                                chunks.__getitem__, [c.dtype.itemsize for c in chunks])
    finally:
        os.close(fd)


def test_blobs_of_one_layout_are_checked_once(dcp_ckpts, monkeypatch):
    """The point of the layouts: a file's blobs of one shape cost one full zip check, not one each."""
    ckpt = dcp_ckpts["dcp_llama_w2"]
    metadata = ckpt / ".metadata"
    chunks = [c for c in dcp.read_metadata(source.of(metadata), metadata).chunks if c.file == "__0_0.distcp"]
    calls = []
    real = dcp_blobs.chunk_data_offset
    monkeypatch.setattr(dcp_blobs, "chunk_data_offset", lambda *a: calls.append(a) or real(*a))
    dcp_blobs._LAYOUTS.clear()
    path = ckpt / "__0_0.distcp"
    at = locate(path, chunks)
    assert len(calls) == len({(c.length, c.lengths, c.dtype) for c in chunks}) < len(chunks)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert at == [real(fd, c, c.dtype.itemsize) for c in chunks]
    finally:
        os.close(fd)


def test_the_scan_hands_ranks_columns_not_chunks(dcp_ckpts):
    """What the scan broadcasts for the chunks is a bytes object per column of rows, each as narrow as its values:
    no object per chunk crosses the process group."""
    scan = dcp_format.DcpFormat().scan(source.looking_at(dcp_ckpts["dcp_llama_wrapped_w4"]), {})
    chunks: dcp_format.ModelChunks = scan.state
    rows = chunks.rows()
    assert all(isinstance(data, bytes) for _, data in chunks.columns)
    assert rows.shape[0] == sum(len(chunks.of_file(f.index)) for f in scan.files)
    assert sum(len(data) for _, data in chunks.columns) < 8 * rows.numel() // 2  # narrower than int64


def memoised_shared_tuple_key() -> bytes:
    """The shared-tuple dict key as protocol 4 builds it (MEMOIZE and LONG_BINGET, which the fast reader takes):
    t0 = (); t(k+1) = (tk, tk), 60 levels, hashed 2^60 times if it ever became a dict key."""
    body = hp.EMPTY_TUPLE + b"\x94"
    for k in range(60):  # t(k) is on the stack: a second reference to it, TUPLE2, MEMOIZE as k + 1
        body += hp.get(k) + hp.TUPLE2 + b"\x94"
    body = hp.EMPTY_DICT + body + b"K\x01" + hp.SETITEM + hp.STOP
    return b"\x80\x04\x95" + struct.pack("<Q", len(body)) + body


def test_a_memoised_shared_tuple_key_is_refused_by_both_readers(dcp_ckpts, tmp_path):
    """The fast reader hashes only names, integers and records as dict keys: this key goes to the general reader,
    which refuses it by its tree size. Shown to fail: `_key` in dcp_decode accepting tuples (the child is killed
    at its CPU limit, hashing)."""
    folder = Path(shutil.copytree(dcp_ckpts["dcp_llama_w2"], tmp_path / "ckpt"))
    (folder / ".metadata").write_bytes(memoised_shared_tuple_key())
    result = in_child(lambda: dcp.read_metadata(source.of(folder / ".metadata"), folder / ".metadata"))
    assert result["signal"] == 0 and "nodes_per_byte" in result["message"], result
    assert result["cpu_s"] < CPU_LIMIT_S, result

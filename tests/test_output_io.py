"""How bytes reach an output file: a fragment copied from its input file through the reader's 1 MiB buffer
(reader.copy_to into writer.pwrite), with each failure named on the right side, and early writeback
(distmerge/writeback.py): which ranges the kernel is asked to start writing, that the request really reaches
the kernel on Linux, and that a refusal changes nothing but the timing.

Why both exist and what they gain is measured in tests/bench (docs/benchmarks.md); here only their contract."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from distmerge.engine.reader import BOUNCE, Reader
from distmerge.errors import CorruptInputError, OutputError
from distmerge.families.base import Target
from distmerge.formats.base import Fragment, InputFile, Scan
from distmerge.output import writeback
from distmerge.output.writer import ShardWriter

MiB = 1 << 20


class Recorder:
    def __init__(self, answer: int = 0) -> None:
        self.calls: list[tuple[int, int, int]] = []
        self.answer = answer

    def __call__(self, fd: int, offset: int, nbytes: int, flags: int) -> int:
        self.calls.append((offset, nbytes, flags))
        return self.answer


@pytest.fixture
def recorder(monkeypatch: pytest.MonkeyPatch) -> Recorder:
    rec = Recorder()
    monkeypatch.setattr(writeback, "_CALL", rec)
    return rec


def test_requests_the_span_once_enough_bytes_gathered(recorder: Recorder) -> None:
    wb = writeback.Writeback(fd=7)
    wb.wrote(100, writeback.KICK_BYTES // 2)
    assert recorder.calls == []  # not yet worth a request
    wb.wrote(40, 50)  # below the span: it grows downwards
    wb.wrote(100 + writeback.KICK_BYTES // 2, writeback.KICK_BYTES // 2)
    assert recorder.calls == [(40, 100 + writeback.KICK_BYTES - 40, writeback.SYNC_FILE_RANGE_WRITE)]
    wb.flush()  # nothing gathered since: no request
    wb.wrote(5 * MiB, 10)
    wb.flush()
    assert recorder.calls[1:] == [(5 * MiB, 10, writeback.SYNC_FILE_RANGE_WRITE)]


def test_a_refusal_stops_the_requests(monkeypatch: pytest.MonkeyPatch) -> None:
    refusing = Recorder(answer=-1)
    monkeypatch.setattr(writeback, "_CALL", refusing)
    wb = writeback.Writeback(fd=7)
    for _ in range(3):
        wb.wrote(0, writeback.KICK_BYTES)
    assert len(refusing.calls) == 1


def targets(*sizes: int) -> tuple[Target, ...]:
    return tuple(Target(name=f"t{i}", dtype="F32", shape=(n // 4,)) for i, n in enumerate(sizes))


@pytest.mark.parametrize("kernel", ["recorded", "none"])
def test_writer_output_is_the_same_with_or_without_requests(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           kernel: str) -> None:
    rec = Recorder()
    monkeypatch.setattr(writeback, "_CALL", rec if kernel == "recorded" else None)
    sizes = (12 * MiB, 12 * MiB + 8, 4 * MiB)
    data = [torch.randn(n // 4) for n in sizes]
    writer = ShardWriter(tmp_path, "model.safetensors", targets(*sizes))
    for i, t in enumerate(data):
        writer.write(f"t{i}", t)
    writer.finish()
    with safe_open(tmp_path / "model.safetensors", framework="pt") as f:
        for i, t in enumerate(data):
            assert torch.equal(f.get_tensor(f"t{i}"), t)
    if kernel == "recorded":  # header + 12 MiB, then + 12 MiB: one request covering both, from the header on
        assert rec.calls == [(0, writer.data_start + 24 * MiB + 8, writeback.SYNC_FILE_RANGE_WRITE)]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sync_file_range is Linux's")
def test_the_kernel_call_is_live_on_linux(tmp_path: Path) -> None:
    """The path the tests above fake must exist for real: a missing symbol would silently leave the disk idle."""
    assert writeback._CALL is not None
    path = tmp_path / "f"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        os.pwrite(fd, b"x" * MiB, 0)
        assert writeback._CALL(fd, 0, MiB, writeback.SYNC_FILE_RANGE_WRITE) == 0
        assert writeback._CALL(-1, 0, MiB, writeback.SYNC_FILE_RANGE_WRITE) == -1  # EBADF: errors come back
    finally:
        os.close(fd)


# --- the copy through the reader's buffer ---------------------------------------------------------------------

def one_fragment_file(tmp_path: Path, elements: int, skip: int = 24) -> tuple[torch.Tensor, Reader, Fragment]:
    """An input file of `skip` bytes of something else, then the tensor's bytes; a Reader for it."""
    tensor = torch.arange(elements, dtype=torch.float32) * 0.25
    (tmp_path / "in.bin").write_bytes(b"\x7f" * skip + tensor.numpy().tobytes())
    files = (InputFile(index=0, path="in.bin", size=(tmp_path / "in.bin").stat().st_size),)
    scan = Scan(format="test", root=str(tmp_path), files=files, hf_dir=None, world_size=1)
    frag = Fragment(name="w", dtype="F32", global_shape=(elements,), offsets=(0,), lengths=(elements,),
                    file_index=0, byte_offset=skip, key="w")
    return tensor, Reader(scan, fmt=None), frag


def test_a_fragment_of_several_buffers_is_copied_exactly(tmp_path: Path) -> None:
    elements = (2 * BOUNCE + 3 * 4096 + 12) // 4  # two full buffers and an odd tail
    tensor, reader, frag = one_fragment_file(tmp_path, elements)
    writer = ShardWriter(tmp_path / "out", "model.safetensors", targets(elements * 4))
    copy_whole_named(reader, frag, writer)
    writer.finish()
    reader.close()
    assert reader.bytes_read == elements * 4
    with safe_open(tmp_path / "out" / "model.safetensors", framework="pt") as f:
        assert torch.equal(f.get_tensor("t0"), tensor)


def test_a_read_failure_names_the_input_and_a_write_failure_the_output(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The two sides of one copy fail with their own file's name (with copy_file_range, which did both, a failed
    read was reported as the output's: "is the disk full?")."""
    _, reader, frag = one_fragment_file(tmp_path, 1000)
    writer = ShardWriter(tmp_path / "out", "model.safetensors", targets(4000))

    def no_read(*_args):
        raise OSError(5, "Input/output error")

    with monkeypatch.context() as m:
        m.setattr("distmerge.input.tree.os.preadv", no_read)  # the input file's reads (tree.Opened)
        with pytest.raises(CorruptInputError, match="cannot read in.bin: Input/output error"):
            copy_whole_named(reader, frag, writer)

    def no_space(*_args):
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr("distmerge.output.local.os.pwrite", no_space)
        with pytest.raises(OutputError, match="cannot write .*model.safetensors: No space left on device"):
            copy_whole_named(reader, frag, writer)
    writer.abort()
    reader.close()
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == []  # nothing half-written is left


def copy_whole_named(reader: Reader, frag: Fragment, writer: ShardWriter) -> None:
    writer.copy_in(lambda put: reader.copy_to(frag, put, writer.offset("t0"), frag.nbytes), frag.nbytes)

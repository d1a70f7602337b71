"""Where a DCP chunk's elements start inside its `.distcp` file, for one chunk or for all the chunks of a file.

    __R_I.distcp   per chunk, at [offset, offset+length): a whole torch.save zip of the chunk tensor (the
                   default TORCH_SAVE format), or its raw bytes (SAFETENSORS format: length == numel * itemsize)

A chunk blob is checked as any torch.save file is (zip_records): records stored, disjoint, inside the blob;
data.pkl read by the restricted reader; the tensor's view inside its storage record, the record inside the
blob. torch 2.6 to 2.14 write every record with the data-descriptor flag (0x808): the local headers carry no
sizes, only the blob's own zip directory (at its end) does, so each blob costs a directory read (~100 us;
2 minutes for the 1.16M chunks of a 1024-rank save).

`locate` does the files' chunks in one pass instead. The chunks of one tensor shape are written alike: the same
bytes up to the first element (local headers, data.pkl, alignment padding) and the same zip directory and end
records but for the CRC fields, at the same distance from the blob's end. So the first blob of each *layout*
is checked in full (chunk_data_offset), and a later blob of the same length whose head (the bytes before its
first element) is byte-equal to that checked blob's, and whose tail (directory and end records) is byte-equal
but for the CRCs, has the same records at the same places, the same data.pkl and so the same view: its
elements start at the same distance from its start, and every check made on the first holds for it. Only the
bytes of its other records (`version`, the serialization id: never read) are not compared. Heads and tails are
read through one 4 MiB window when the blobs are small, by two preads each when they are large.
"""

from __future__ import annotations

import math
import pickle
import struct
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from distmerge.errors import CorruptInputError
from distmerge.formats.torch_private import pickle_scan, zip_records
from distmerge.formats.torch_private.restricted import TENSOR_GLOBALS, TensorRef, loads
from distmerge.input import tree

BLOB_PICKLE = pickle_scan.Budget(max_bytes=pickle_scan.MiB)  # a chunk blob's data.pkl describes one tensor
LOCAL_HEADER = b"PK\x03\x04"
CENTRAL = b"PK\x01\x02"
PREFIX = 1 << 12  # data.pkl (~160 bytes) and the small records before the storage fit here in practice
HEAD = 4096  # the bytes read at a blob's start to match it to a layout (torch 2.13: the first element at 704)
WINDOW = 4 << 20
MAX_LAYOUTS = 4096  # a 405B model has ~20 chunk shapes; a file of all-different ones is checked blob by blob


@dataclass(frozen=True, kw_only=True)
class Chunk:
    fqn: str
    dtype: torch.dtype
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    lengths: tuple[int, ...]
    file: str
    offset: int  # of the blob in the file
    length: int


def chunk_data_offset(fd: Any, chunk: Chunk, itemsize: int) -> int:
    """Absolute file offset of the chunk's first element. Raw chunks start at the blob. torch.save blobs
    write data.pkl first, then a few tiny records, then the storage: walking the zip's local headers in
    one read of the blob's start finds it; anything unusual goes through zipfile's central directory. `fd`: the
    file as its source opened it (source.InFile: a file, or an object of an object-store input)."""
    numel = math.prod(chunk.lengths)
    if chunk.length == numel * itemsize:
        return chunk.offset
    fd = tree.readable(fd)
    head = fd.pread(min(chunk.length, PREFIX), chunk.offset)
    ref, at = None, 0
    while head[at : at + 4] == LOCAL_HEADER and at + 30 <= len(head):
        flags, method = struct.unpack_from("<HH", head, at + 6)
        (size,) = struct.unpack_from("<I", head, at + 18)
        name_len, extra_len = struct.unpack_from("<HH", head, at + 26)
        name = head[at + 30 : at + 30 + name_len].decode(errors="replace")
        data = at + 30 + name_len + extra_len
        if flags & 0x08 or method != zipfile.ZIP_STORED or size == 0xFFFFFFFF:
            break
        if name.endswith("data.pkl") and data + size <= len(head):
            ref = _tensor_ref(head[data : data + size], chunk)
        elif ref is not None and name.endswith(f"/data/{ref.storage.key}"):
            _check_inside(ref, chunk, itemsize, size, data + size <= chunk.length)
            return chunk.offset + data + ref.storage_offset * itemsize
        at = data + size
    return _offset_via_directory(fd, chunk, itemsize)


@dataclass(frozen=True)
class _Layout:
    """A checked blob's bytes that decide where its elements are: `head` (up to the first element) and `tail`
    (the zip directory and end records, CRC fields at `crcs` ignored)."""

    head: bytes
    tail: bytes
    crcs: tuple[int, ...]

    def matches(self, head: bytes, tail: bytes) -> bool:
        if not head.startswith(self.head) or len(tail) != len(self.tail):
            return False
        start = 0
        for crc in self.crcs:
            if tail[start:crc] != self.tail[start:crc]:
                return False
            start = crc + 4
        return tail[start:] == self.tail[start:]


_LAYOUTS: dict[tuple[int, bytes], list[_Layout]] = {}  # (blob length, its first KEY bytes) -> checked layouts
KEY = 256


def locate(fd: Any, file_size: int, rows: Sequence[tuple[int, int, int]], chunk: Callable[[int], Chunk],
           itemsizes: Sequence[int]) -> list[int]:
    """The first element's file offset of every chunk of one file. `rows[k]`: (blob offset, blob length, numel)
    of chunk k; `chunk(k)` builds its full record, only for blobs checked in full and for messages. `fd`: as for
    chunk_data_offset."""
    fd = tree.readable(fd)
    out = [0] * len(rows)
    window = _Window(fd, file_size)
    for k in sorted(range(len(rows)), key=lambda k: rows[k][0]):
        offset, length, numel = rows[k]
        if length == numel * itemsizes[k]:
            out[k] = offset  # raw bytes (SAFETENSORS serialization)
            continue
        head = window.read(offset, min(length, HEAD))
        key = (length, head[:KEY])
        tail = b""
        for layout in _LAYOUTS.get(key, ()):
            tail = tail or window.read(offset + length - len(layout.tail), len(layout.tail))
            if layout.matches(head, tail):
                out[k] = offset + len(layout.head)
                break
        else:
            out[k] = _check_in_full(fd, chunk(k), itemsizes[k], head, key)
    return out


def _check_in_full(fd: Any, chunk: Chunk, itemsize: int, head: bytes, key: tuple[int, bytes]) -> int:
    """chunk_data_offset, and the blob's layout remembered when its head and tail are all that decided it."""
    at = chunk_data_offset(fd, chunk, itemsize)
    rel = at - chunk.offset
    if rel > len(head) or len(_LAYOUTS) >= MAX_LAYOUTS:
        return at
    where = f"{chunk.file} (chunk of {chunk.fqn})"
    directory = zip_records.directory_offset(fd, where, chunk.offset, chunk.length)
    if directory < rel:
        return at
    tail = fd.pread(chunk.length - directory, chunk.offset + directory)
    crcs, pos = [], 0
    while tail[pos : pos + 4] == CENTRAL and pos + 46 <= len(tail):
        crcs.append(pos + 16)
        name_len, extra_len, comment_len = struct.unpack_from("<HHH", tail, pos + 28)
        pos += 46 + name_len + extra_len + comment_len
    _LAYOUTS.setdefault(key, []).append(_Layout(head=bytes(head[:rel]), tail=tail, crcs=tuple(crcs)))
    return at


class _Window:
    """Reads of a file in offset order through one buffer of WINDOW bytes; large reads go straight to pread."""

    def __init__(self, fd: Any, size: int) -> None:
        self.fd, self.size, self.start, self.buf = fd, size, 0, b""

    def read(self, at: int, n: int) -> bytes:
        begin = at - self.start
        if begin >= 0 and begin + n <= len(self.buf):
            return self.buf[begin : begin + n]
        if n > WINDOW // 4:
            return self.fd.pread(n, at)
        self.start, self.buf = at, self.fd.pread(max(n, min(WINDOW, self.size - at)), at)
        return self.buf[:n]


_ACCEPTED: dict[bytes, TensorRef] = {}  # blob pickles already checked: a tensor's chunks of one shape pickle alike
_ACCEPTED_MAX, _ACCEPTED_BYTES = 4096, 4096


def _tensor_ref(pickled: bytes, chunk: Chunk) -> TensorRef:
    ref = _ACCEPTED.get(pickled)
    if ref is None:
        try:
            ref = loads(pickled, TENSOR_GLOBALS, where=f"{chunk.file} (chunk of {chunk.fqn})", budget=BLOB_PICKLE)
        except (pickle.UnpicklingError, TypeError, ValueError, AttributeError, EOFError, IndexError) as err:
            raise CorruptInputError(f"{chunk.file}: the chunk of {chunk.fqn} cannot be read safely ({err})") from None
        if isinstance(ref, TensorRef) and len(pickled) <= _ACCEPTED_BYTES and len(_ACCEPTED) < _ACCEPTED_MAX:
            _ACCEPTED[pickled] = ref
    if not isinstance(ref, TensorRef) or ref.size != chunk.lengths:
        raise CorruptInputError(f"{chunk.file}: the chunk of {chunk.fqn} does not hold a tensor of its shape")
    if not ref.contiguous:
        raise CorruptInputError(f"{chunk.file}: the chunk of {chunk.fqn} is saved non-contiguous")
    return ref


def _check_inside(ref: TensorRef, chunk: Chunk, itemsize: int, record_size: int, record_inside: bool) -> None:
    """The chunk's elements lie inside their storage record, and the record inside the chunk's blob."""
    if not ref.check_shape() or ref.bytes_needed(itemsize) > record_size or not record_inside:
        raise CorruptInputError(f"{chunk.file}: the chunk of {chunk.fqn} reaches past its storage record "
                                "(limit: views stay inside their record, records inside the blob)")


def _offset_via_directory(fd: Any, chunk: Chunk, itemsize: int) -> int:
    where = f"{chunk.file} (chunk of {chunk.fqn})"
    found = zip_records.records(fd, where, chunk.offset, chunk.length)
    pkl, prefix = zip_records.pickle_record(found, where)
    if pkl.size > BLOB_PICKLE.max_bytes:
        raise CorruptInputError(f"{where}: its data.pkl is {pkl.size} bytes, over the limit of "
                                f"{BLOB_PICKLE.max_bytes} (max_bytes)")
    ref = _tensor_ref(zip_records.read(fd, pkl, chunk.offset), chunk)
    record = found.get(prefix + ref.storage.key)
    if record is None:
        raise CorruptInputError(f"{where}: no storage record {ref.storage.key}")
    _check_inside(ref, chunk, itemsize, record.size, True)
    return chunk.offset + record.start + ref.storage_offset * itemsize

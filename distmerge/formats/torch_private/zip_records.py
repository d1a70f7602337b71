"""torch.save's zip archives checked before any record is read.

torch.save writes every record stored (never compressed), each once, one after the other, then the central
directory. A hostile archive can instead deflate a record (a small file that inflates without end), let
two records share bytes (the bytes of `data.pkl` read as a tensor), point past its own end, or list
millions of records. Here the archive is accepted only when:

- the end record declares at most MAX_RECORDS records and a central directory of at most MAX_DIRECTORY bytes;
- every record is stored uncompressed and unencrypted, named once, with a local header that agrees;
- records do not overlap and all lie before the central directory, inside the archive.

The archive may sit inside a larger file (a DCP chunk blob in a `.distcp`): `start`, `length` say where.
"""

from __future__ import annotations

import functools
import io
import struct
import zipfile
from dataclasses import dataclass
from typing import Any

from distmerge.errors import CorruptInputError
from distmerge.input import tree
from distmerge.input.source import Expected

# A 671B model's FSDP rank file holds ~92k tensors, so ~92k storage records (+5 small ones): 5x headroom.
MAX_RECORDS = 2**19
MAX_DIRECTORY = 160 * MAX_RECORDS  # torch.save's central entries are ~100 bytes (name + zip64 extra)
LOCAL_HEADER = b"PK\x03\x04"
END = b"PK\x05\x06"
ZIP64_LOCATOR = b"PK\x06\x07"
ZIP64_END = b"PK\x06\x06"
OBJECT_TAIL = 1 << 16  # an object's tail read first (input/s3.py remembers reads of this size at its ends)
HEAD = 1 << 16  # an object's first GET: its first records' headers, up to the first record that ends past this


@dataclass(frozen=True, kw_only=True)
class ZipRecord:
    name: str
    start: int  # first data byte, from the archive's start
    size: int


class Window(io.RawIOBase):
    """A read-only view of bytes [start, start+length) of an open input file (source.InFile), for zipfile."""

    def __init__(self, f: Any, start: int, length: int) -> None:
        self.f, self.start, self.length, self.pos = f, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, pos: int, whence: int = 0) -> int:
        self.pos = {0: pos, 1: self.pos + pos, 2: self.length + pos}[whence]
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readinto(self, buf) -> int:
        n = max(0, min(len(buf), self.length - self.pos))
        data = self.f.pread(n, self.start + self.pos)
        buf[: len(data)] = data
        self.pos += len(data)
        return len(data)


def records(fd: Any, where: str, start: int = 0, length: int | None = None) -> dict[str, ZipRecord]:
    """Every record of the archive by name, checked as the module docstring says. `fd`: the file as its source
    opened it (source.InFile: positional reads, whatever the store; or a bare descriptor)."""
    fd = tree.readable(fd)
    length = fd.size - start if length is None else length
    directory_at = _check_end_record(fd, where, start, length)
    try:
        with zipfile.ZipFile(Window(fd, start, length)) as archive:
            infos = archive.infolist()
    except (zipfile.BadZipFile, ValueError, EOFError, OSError) as err:
        raise CorruptInputError(f"{where} is not a torch.save file ({str(err)[:100]}): truncated or corrupt") from None
    for info in infos:
        if info.flag_bits & 0x1 or info.compress_type != zipfile.ZIP_STORED or info.compress_size != info.file_size:
            raise CorruptInputError(f"{where}: record {info.filename} is compressed or encrypted; torch.save stores "
                                    "every record as is (limit: stored records only)")
        if info.header_offset < 0:  # zipfile shifts every offset by where it found the directory
            raise CorruptInputError(f"{where}: record {info.filename} is said to start before the archive: the "
                                    "file is damaged")
    starts = _predicted(fd, where, start, infos, directory_at) if fd.by_request else None
    if starts is None:
        starts = [_data_start(fd, where, start, info) for info in infos]
    found: dict[str, ZipRecord] = {}
    spans = []
    for info, data in zip(infos, starts, strict=True):
        if info.filename in found:
            raise CorruptInputError(f"{where}: record {info.filename} is listed twice in the zip directory")
        found[info.filename] = ZipRecord(name=info.filename, start=data, size=info.file_size)
        spans.append((info.header_offset, data + info.file_size, info.filename))
    spans.sort()
    for (_, end, name), (begin, _, following) in zip(spans, spans[1:], strict=False):
        if end > begin:
            raise CorruptInputError(f"{where}: zip records {name} and {following} overlap (limit: records are "
                                    "disjoint)")
    if spans and spans[-1][1] > directory_at:
        raise CorruptInputError(f"{where}: record {spans[-1][2]} runs past the zip directory: truncated or corrupt")
    return found


def directory_offset(fd: Any, where: str, start: int, length: int) -> int:
    """Where the archive's zip directory starts, from the archive's start (its end records checked)."""
    return _check_end_record(tree.readable(fd), where, start, length)


def _check_end_record(fd: Any, where: str, start: int, length: int) -> int:
    """The record count and directory size the end record declares, bounded; returns the directory's offset."""
    remote = fd.by_request  # a read is a request: read ahead, and serve zipfile's reads of the directory from it
    tail = fd.pread(OBJECT_TAIL, start + length - OBJECT_TAIL) if remote and length > OBJECT_TAIL else b""
    if END in tail:  # the end record lies in the last 22 bytes but for a comment: this tail holds it
        tail_len = OBJECT_TAIL
    elif remote:  # one GET (a request costs more than its bytes): up to a 64 KiB comment at once
        tail_len = min(length, 22 + 65535)
        tail = fd.pread(tail_len, start + length - tail_len)
    else:
        tail_len = min(length, 22 + 20)  # torch.save writes no comment: the end record ends the file (zip64's before)
        tail = fd.pread(tail_len, start + length - tail_len)
        if tail[-22:-18] != END or tail[-2:] != b"\0\0":  # else look for it before a comment of up to 64 KiB
            tail_len = min(length, 22 + 65535)
            tail = fd.pread(tail_len, start + length - tail_len)
    if remote:
        fd.keep(start + length - tail_len, tail)
    at = tail.rfind(END)
    if at < 0 or at + 22 > len(tail):
        raise CorruptInputError(f"{where} is not a torch.save file (no zip directory): truncated or corrupt")
    count, size, offset = struct.unpack_from("<HII", tail, at + 10)
    if count == 0xFFFF or size == 0xFFFFFFFF or offset == 0xFFFFFFFF:
        count, size, offset = _zip64_end(fd, where, start, length, tail, at)
    if count > MAX_RECORDS or size > MAX_DIRECTORY:
        raise CorruptInputError(f"{where}: its zip directory lists {count} records in {size} bytes, over the limits "
                                f"of {MAX_RECORDS} records (max_records) and {MAX_DIRECTORY} bytes")
    if offset + size > length - (tail_len - at):  # the directory lies before its end record, inside the archive
        raise CorruptInputError(f"{where}: its zip directory is said to lie at bytes {offset:,}-{offset + size:,}, "
                                f"past the end of its {length:,}-byte archive: truncated or corrupt")
    if remote and offset < length - tail_len:  # a directory larger than the tail: one more GET
        fd.keep(start + offset, fd.pread(length - offset, start + offset))
    return offset


def _zip64_end(fd: Any, where: str, start: int, length: int, tail: bytes, at: int) -> tuple[int, int, int]:
    locator = tail[at - 20 : at] if at >= 20 else b""
    if locator[:4] != ZIP64_LOCATOR:
        raise CorruptInputError(f"{where}: its zip end record is damaged (no zip64 locator)")
    (end_at,) = struct.unpack_from("<Q", locator, 8)
    record = fd.pread(56, start + end_at) if end_at + 56 <= length else b""
    if record[:4] != ZIP64_END:
        raise CorruptInputError(f"{where}: its zip64 end record is damaged")
    count, size, offset = struct.unpack_from("<QQQ", record, 32)
    return count, size, offset


def _predicted(fd: Any, where: str, start: int, infos: list[zipfile.ZipInfo], directory_at: int) -> list[int] | None:
    """An object's records' data starts without a GET per local header: each record's data ends where its data
    descriptor, then the next record's local header (or the directory) begins, all of which the directory says
    (`_descriptor`). Each local header is still checked, by the read that first reaches its record (the object
    file's `expect`); here only those in the archive's head (one GET, up to the first large record) and the
    first zip64 record's. None when one of them disagrees (a writer unlike torch.save): then every local header
    is read, as on disk."""
    order = sorted(range(len(infos)), key=lambda k: infos[k].header_offset)
    starts, checks = [0] * len(infos), []
    for pos, k in enumerate(order):
        info = infos[k]
        after = infos[order[pos + 1]].header_offset if pos + 1 < len(order) else directory_at
        data = after - info.compress_size - _descriptor(info)
        if data < info.header_offset + 30 + len(info.orig_filename.encode()):
            raise CorruptInputError(f"{where}: record {info.filename} does not fit between its local header and "
                                    "the next record: the file is damaged")
        starts[k] = data
        checks.append(Expected(
            at=start + info.header_offset, length=30 + len(info.orig_filename.encode()),
            until=start + data + info.compress_size, check=functools.partial(_agrees, where, info, data)))
    if not order:
        return starts
    head, end = infos[order[0]].header_offset, directory_at
    for k in order:
        if starts[k] + infos[k].compress_size > head + HEAD:
            end = starts[k]
            break
    fd.keep(start + head, fd.pread(end - head, start + head))
    wide = next((c for c, k in zip(checks, order, strict=True) if _descriptor(infos[k]) == 24), None)
    try:
        if wide is not None:
            wide.check(fd.pread(wide.length, wide.at))
        fd.expect(checks)  # those in the head are made now
    except CorruptInputError:
        fd.expect([])
        return None
    return starts


def _descriptor(info: zipfile.ZipInfo) -> int:
    """Bytes after a record's data before the next local header: torch.save (miniz) writes a data descriptor after
    every record (flag bit 3): 16 bytes, 24 when the record needs zip64 (its directory entry then carries a zip64
    extra field, tag 1)."""
    if not info.flag_bits & 0x8:
        return 0
    extra, at = info.extra, 0
    while at + 4 <= len(extra):
        tag, size = struct.unpack_from("<HH", extra, at)
        if tag == 1:
            return 24
        at += 4 + size
    return 16


def _agrees(where: str, info: zipfile.ZipInfo, data: int, header: bytes) -> None:
    if info.header_offset + _header_length(where, info, header) != data:
        raise CorruptInputError(f"{where}: record {info.filename}'s local header does not agree with the zip "
                                "directory: the file is damaged")


def _data_start(fd: Any, where: str, start: int, info: zipfile.ZipInfo) -> int:
    header = fd.pread(30 + len(info.orig_filename.encode()), start + info.header_offset)
    return info.header_offset + _header_length(where, info, header)


def _header_length(where: str, info: zipfile.ZipInfo, header: bytes) -> int:
    """The length of a record's local header (its first 30 + name bytes given), checked to name the record."""
    if len(header) < 30 or header[:4] != LOCAL_HEADER:
        raise CorruptInputError(f"{where}: record {info.filename} has no local header: the file is damaged")
    name_len, extra_len = struct.unpack_from("<HH", header, 26)
    if header[30 : 30 + name_len] != info.orig_filename.encode():
        raise CorruptInputError(f"{where}: record {info.filename}'s local header names another record")
    return 30 + name_len + extra_len


def read(fd: Any, record: ZipRecord, start: int = 0) -> bytes:
    data = tree.readable(fd).pread(record.size, start + record.start)
    if len(data) != record.size:
        raise CorruptInputError(f"record {record.name} is cut short: the file is truncated")
    return data


def pickle_record(found: dict[str, ZipRecord], where: str) -> tuple[ZipRecord, str]:
    """The archive's data.pkl and the prefix of its storage records (`<name>/data/`)."""
    pkl = next((n for n in found if n.endswith("/data.pkl") or n == "data.pkl"), None)
    if pkl is None:
        raise CorruptInputError(f"{where} is not a torch.save file (no data.pkl inside)")
    return found[pkl], pkl[: -len("data.pkl")] + "data/"

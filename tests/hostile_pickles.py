"""Hostile pickles and torch.save zips, built in well under a second, for tests/test_hostile_pickles.py.

Pickles are written opcode by opcode (pickletools names), so each one is exactly the attack and nothing
else. Code-running payloads would create the `marker` file if anything unpickled them for real. Zip cases
start from a real torch.save file and rewrite its archive (`rewrite`): the same records, one of them
replaced, deflated, overlapping another, or cut short.
"""

from __future__ import annotations

import struct
import zipfile
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

PROTO2 = b"\x80\x02"
STOP, REDUCE, TUPLE1, TUPLE2, EMPTY_TUPLE, EMPTY_DICT, SETITEM = b".", b"R", b"\x85", b"\x86", b")", b"}", b"s"


def glob(module: str, name: str) -> bytes:
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def text(value: str) -> bytes:
    raw = value.encode()
    return b"X" + struct.pack("<I", len(raw)) + raw


def put(i: int) -> bytes:
    return b"r" + struct.pack("<I", i)  # LONG_BINPUT


def get(i: int) -> bytes:
    return b"j" + struct.pack("<I", i)  # LONG_BINGET


def call(func: bytes, *args: bytes) -> bytes:
    """func(*args) for one or two arguments."""
    return func + b"".join(args) + (TUPLE1 if len(args) == 1 else TUPLE2) + REDUCE


def in_dict(value: bytes) -> bytes:
    """{"weight": value}: the payload where a state dict's entry would be."""
    return PROTO2 + EMPTY_DICT + text("weight") + value + SETITEM + STOP


# -- payloads: marker -> pickle bytes ---------------------------------------------------------------------------
def os_system(marker: Path) -> bytes:
    return in_dict(call(glob("posix", "system"), text(f"touch {marker}")))


def builtins_eval(marker: Path) -> bytes:
    return in_dict(call(glob("builtins", "eval"), text(f"open({str(marker)!r}, 'w').close()")))


def getattr_chain(marker: Path) -> bytes:
    """getattr(getattr(_rebuild_tensor_v2, '__globals__')['sys'].modules['os'], 'system')('touch marker'),
    spelled with builtins.getattr only (FSDP's loader allows that name for ShardedTensor's nested class)."""
    ga = glob("builtins", "getattr")
    globs = call(ga, glob("torch._utils", "_rebuild_tensor_v2"), text("__globals__"))
    sys_mod = call(call(ga, globs, text("get")), text("sys"))
    os_mod = call(call(ga, call(ga, sys_mod, text("modules")), text("get")), text("os"))
    return in_dict(call(call(ga, os_mod, text("system")), text(f"touch {marker}")))


def deep_nesting(marker: Path, depth: int = 10**6) -> bytes:
    """A tuple nested 10^6 deep (1 MB): hashing or freeing it recursively overflows the C stack."""
    return in_dict(EMPTY_TUPLE + TUPLE1 * depth)


def huge_memo(marker: Path) -> bytes:
    """LONG_BINPUT 2**28: the C unpickler grows its memo array to that index (4 GiB of pointers)."""
    return PROTO2 + EMPTY_DICT + put(2**28) + STOP


def shared_tuples(levels: int = 60) -> bytes:
    """t0 = (); t(k+1) = (tk, tk): 60 levels, 2^60 leaves, 600 bytes."""
    out = EMPTY_TUPLE + put(0)
    for k in range(levels):
        out += get(k) + get(k) + TUPLE2 + put(k + 1)
    return out


def shared_tuple_key(marker: Path) -> bytes:
    """A dict key that is the shared tuple: hashing it walks 2^60 leaves."""
    return PROTO2 + EMPTY_DICT + shared_tuples() + b"K\x01" + SETITEM + STOP


def shared_tuple_text(marker: Path) -> bytes:
    """torch.device(shared tuple): the inert reader's str() of it would be 2^60 long."""
    return in_dict(call(glob("torch", "device"), shared_tuples()))


def bytearray_2gib(marker: Path) -> bytes:
    """bytearray(2**31 - 1): 30 bytes that allocate 2 GiB (bytearray is on torch's weights_only list)."""
    return in_dict(call(glob("builtins", "bytearray"), b"J" + struct.pack("<i", 2**31 - 1)))


def shared_tuple_path(marker: Path) -> bytes:
    """pathlib.PosixPath(shared tuple), which DCP metadata readers turn into text."""
    return in_dict(call(glob("pathlib", "PosixPath"), shared_tuples()))


def torch_lazy_attr(marker: Path) -> bytes:
    """GLOBAL torch._inductor: getattr(torch, name) would import ~820 torch._inductor modules to refuse it."""
    return in_dict(glob("torch", "_inductor"))


PICKLES: dict[str, Callable[[Path], bytes]] = {
    "os.system": os_system, "eval": builtins_eval, "getattr chain": getattr_chain, "deep nesting": deep_nesting,
    "huge memo": huge_memo, "shared tuple key": shared_tuple_key, "shared tuple device": shared_tuple_text,
    "shared tuple path": shared_tuple_path,
    "bytearray 2 GiB": bytearray_2gib, "torch lazy attribute": torch_lazy_attr,
}


# -- torch.save zips rewritten ------------------------------------------------------------------------------------
@dataclass
class Record:
    name: str
    data: bytes
    deflated_size: int = 0  # > 0: write `data` as a deflate stream that inflates to this many zero bytes
    central_offset: int | None = None  # point the central directory entry here instead


def records_of(path: Path) -> list[Record]:
    with zipfile.ZipFile(path) as archive:
        return [Record(i.filename, archive.read(i)) for i in archive.infolist()]


def zero_bomb(size: int) -> bytes:
    """A raw deflate stream of `size` zero bytes (a multiple of 16 MiB): one 16 MiB block fully flushed,
    repeated (a full flush resets the history, so the copies decode alike), then an empty final block."""
    block = 16 * 2**20
    comp = zlib.compressobj(9, zlib.DEFLATED, -15)
    chunk = comp.compress(b"\0" * block) + comp.flush(zlib.Z_FULL_FLUSH)
    return chunk * (size // block) + b"\x03\x00"


def write_zip(path: Path, records: list[Record]) -> dict[str, int]:
    """Records one after the other, data 64-byte aligned as torch.save aligns it, then the directory.
    Returns where each record's data starts."""
    out, central, starts = bytearray(), bytearray(), {}
    for r in records:
        name = r.name.encode()
        pad = (-(len(out) + 30 + len(name) + 4)) % 64
        extra = struct.pack("<HH", 0x4246, pad) + b"Z" * pad
        method, usize = (8, r.deflated_size) if r.deflated_size else (0, len(r.data))
        crc = 0 if r.deflated_size else zlib.crc32(r.data)
        header_at = len(out)
        out += struct.pack("<4sHHHHHIIIHH", b"PK\x03\x04", 20, 0, method, 0, 0, crc, len(r.data), usize,
                           len(name), len(extra)) + name + extra
        starts[r.name] = len(out)
        out += r.data
        at = header_at if r.central_offset is None else r.central_offset
        central += struct.pack("<4sHHHHHHIIIHHHHHII", b"PK\x01\x02", 20, 20, 0, method, 0, 0, crc, len(r.data),
                               usize, len(name), 0, 0, 0, 0, 0, at) + name
    end = struct.pack("<4sHHHHIIH", b"PK\x05\x06", 0, 0, len(records), len(records), len(central), len(out), 0)
    path.write_bytes(bytes(out + central + end))
    return starts


def pickle_name(records: list[Record]) -> str:
    return next(r.name for r in records if r.name.endswith("data.pkl"))


def with_pickle(src: Path, dst: Path, payload: bytes) -> None:
    """The real file with its data.pkl replaced by `payload`."""
    records = records_of(src)
    for r in records:
        if r.name.endswith("data.pkl"):
            r.data = payload
    write_zip(dst, records)


def deflate_bomb(src: Path, dst: Path) -> None:
    """data.pkl deflated: 1 MB on disk that inflates to 1 GiB."""
    records = records_of(src)
    for r in records:
        if r.name.endswith("data.pkl"):
            r.data, r.deflated_size = zero_bomb(2**30), 2**30
    write_zip(dst, records)


def overlapping(src: Path, dst: Path) -> None:
    """The first storage record's directory entry points at a local header hidden inside data.pkl (after its
    STOP, where unpickling never looks): the record's bytes are data.pkl's."""
    records = records_of(src)
    pkl = next(r for r in records if r.name.endswith("data.pkl"))
    storage = next(r for r in records if "/data/" in r.name)
    name = storage.name.encode()
    hidden = struct.pack("<4sHHHHHIIIHH", b"PK\x03\x04", 20, 0, 0, 0, 0, zlib.crc32(storage.data),
                         len(storage.data), len(storage.data), len(name), 0) + name
    at = len(pkl.data)
    pkl.data += hidden + pkl.data[: len(storage.data)].ljust(len(storage.data), b"\0")
    storage.central_offset = write_zip(dst, records)[pkl.name] + at
    write_zip(dst, records)


def cut_record(src: Path, dst: Path) -> None:
    """A storage record cut to half its size: its tensor's view reaches past the record's end."""
    records = records_of(src)
    storage = max((r for r in records if "/data/" in r.name), key=lambda r: len(r.data))
    storage.data = storage.data[: len(storage.data) // 2]
    write_zip(dst, records)


def tensor_pickle(prefix: str, storage_offset: int, numel: int) -> bytes:
    """{"weight": _rebuild_tensor_v2(storage '0' of `numel` floats, storage_offset, (4,), (1,), False, {})}."""
    storage = (b"(" + text("storage") + glob("torch", "FloatStorage") + text("0") + text("cpu")
               + b"J" + struct.pack("<i", numel) + b"tQ")  # MARK ... TUPLE, BINPERSID
    args = (b"(" + storage + b"J" + struct.pack("<i", storage_offset) + b"K\x04" + TUPLE1 + b"K\x01" + TUPLE1
            + b"\x89" + glob("collections", "OrderedDict") + EMPTY_TUPLE + REDUCE + b"t")
    return in_dict(glob("torch._utils", "_rebuild_tensor_v2") + args + REDUCE)


def offset_past_record(src: Path, dst: Path) -> None:
    """A tensor of 4 floats at storage offset 1000 of a 4-float record: its bytes would come from whatever
    follows the record (the pickle declares the storage's size honestly; only the view is wrong)."""
    prefix = pickle_name(records_of(src))[: -len("data.pkl")]
    write_zip(dst, [Record(prefix + "data.pkl", tensor_pickle(prefix, 1000, 4)),
                    Record(prefix + "data/0", bytes(16)), Record(prefix + "version", b"3\n")])


ZIPS: dict[str, Callable[[Path, Path], None]] = {
    "deflate bomb": deflate_bomb, "overlapping records": overlapping, "storage cut short": cut_record,
    "storage offset past its record": offset_past_record,
}

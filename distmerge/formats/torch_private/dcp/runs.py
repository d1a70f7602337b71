"""The bulk of a DCP `.metadata`, matched and decoded in runs by regular expressions: no object per record.

What torch's pickler writes for each chunk (protocol 4, the class, keys and torch.Size already memoised, so
referenced by BINGET `h.` / LONG_BINGET `j....`), in a chunks list and in storage_data:

    chunk     <ChunkStorageMetadata> ) NEWOBJ MEMO } MEMO ( <'offsets'> <Size> ARGS TUPLE1 MEMO R MEMO
                                                         <'sizes'> <Size> ARGS TUPLE1 MEMO R MEMO SETITEMS BUILD
    storage   <MetadataIndex> ) NEWOBJ MEMO } MEMO ( <'fqn'> STR <'index'> INT <'offset'> (<Size> ARGS ... | N) u b
              <_StorageInfo> ) NEWOBJ MEMO } MEMO ( <'relative_path'> STR <'offset'> INT <'length'> INT u b

ARGS is the tuple of a Size's integers (`)`, 1-3 ints and TUPLE1-3, or MARK ints TUPLE; memoised unless
empty); STR a new string (SHORT_BINUNICODE of printable ASCII, memoised) or a reference to one; INT BININT1,
BININT2, BININT or LONG1 of at most 8 bytes. A run is a maximal sequence of such records whose references
(the class, the keys, Size) are the same bytes: the first record of a run is matched with named groups, its
references are checked once (they must resolve to that class, those keys and torch.Size), then the whole run
is matched by a regular expression with those references as literals (`run_end`), and decoded (`decode_*`):
one `findall` gives every record's variable tokens, and torch decodes all their integers at once.

Nothing here trusts the regular expressions alone: each decoded record is checked against its bytes (a new
string's length byte equals its length, a tuple opcode its number of integers, a reference points before its
record, at a string), and anything that does not hold is reported as `NotDecoded`, which sends the whole file
to the general reader. The caller keeps the memo count right: `memos` is how many MEMOIZE a run holds, and
the strings it creates are returned with their memo indices.
"""

from __future__ import annotations

import functools
import itertools
import re
from array import array
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from distmerge.formats.torch_private.restricted import Record, record_class

REF = rb"(?:h.|j....)"
INT = (rb"(?:K.|M..|J....|\x8a\x01.|\x8a\x02..|\x8a\x03...|\x8a\x04....|\x8a\x05.{5}|\x8a\x06.{6}|\x8a\x07.{7}"
       rb"|\x8a\x08.{8})")
NEW = rb"\)\x81\x94\}\x94\("  # EMPTY_TUPLE NEWOBJ MEMOIZE EMPTY_DICT MEMOIZE MARK: a dataclass's state follows
SIZE_END = rb"\x85\x94R\x94"  # TUPLE1 MEMOIZE REDUCE MEMOIZE: torch.Size(args)
FLAGS = re.DOTALL
PROTOCOLS = (4, 5)
FRAME = 0x95


class NotDecoded(Exception):
    """The bytes are not what this module decodes: the general reader reads the file."""


def _group(pattern: bytes, capture: bool) -> bytes:
    return (b"(" if capture else b"(?:") + pattern + b")"


def args(capture: bool) -> bytes:
    """A Size's integers; captured as (int, int, int, tuple opcode, the MARK ... TUPLE form of 0 or 4+ ints)."""
    c = functools.partial(_group, capture=capture)
    return (rb"(?:\)|" + c(INT) + c(INT) + b"?" + c(INT) + b"?" + c(rb"[\x85\x86\x87]") + rb"\x94|"
            + c(rb"\((?:" + INT + rb")*t") + rb"\x94)")


def string(capture: bool) -> bytes:
    """A new string (length byte, printable ASCII text, MEMOIZE) or a reference to one."""
    c = functools.partial(_group, capture=capture)
    return rb"(?:\x8c" + c(b".") + c(rb"[\x20-\x7e]*") + rb"\x94|" + c(REF) + b")"


def chunk_record(p: dict[str, bytes], capture: bool) -> bytes:
    offsets = p["sz"] + args(capture) + SIZE_END  # read p["sz"] at each use: the first names it, the second refers
    return p["cls"] + NEW + p["ko"] + offsets + p["ks"] + p["sz"] + args(capture) + SIZE_END + b"ub"


def storage_record(p: dict[str, bytes], capture: bool) -> bytes:
    c = functools.partial(_group, capture=capture)
    return (p["mi"] + NEW + p["kf"] + string(capture) + p["ki"] + c(INT + b"|N") + p["ko"] + b"(?:" + p["sz"]
            + args(capture) + SIZE_END + b"|" + c(b"N") + b")ub" + p["si"] + NEW + p["kp"] + string(capture)
            + p["ko"] + c(INT) + p["kl"] + c(INT) + b"ub")


CHUNK_PINS = ("cls", "ko", "sz", "ks")
STORAGE_PINS = ("mi", "kf", "ki", "ko", "sz", "si", "kp", "kl")
RECORDS = {"chunk": (chunk_record, CHUNK_PINS, 10), "storage": (storage_record, STORAGE_PINS, 15)}


def _named() -> dict[str, bytes]:
    """References as named groups at their first use, back-references after (for a run's first record)."""
    seen: set[str] = set()

    class Names(dict):
        def __missing__(self, key: str) -> bytes:
            if key in seen:
                return b"(?P=" + key.encode() + b")"
            seen.add(key)
            return b"(?P<" + key.encode() + b">" + REF + b")"

    return Names()


FIRST = {kind: re.compile(build(_named(), False), FLAGS) for kind, (build, _, _) in RECORDS.items()}


def first(kind: str, data: bytes, pos: int) -> dict[str, bytes] | None:
    """The references of a run of `kind` ("chunk", "storage") starting at pos, or None if no record starts there."""
    m = FIRST[kind].match(data, pos)
    return None if m is None else {k: m[k] for k in RECORDS[kind][1]}


@functools.lru_cache(maxsize=64)
def _record(kind: str, pins: tuple[bytes, ...]) -> re.Pattern:
    """One record of a run, its references as literals, its variable parts captured."""
    build, names, _ = RECORDS[kind]
    return re.compile(build(dict(zip(names, map(re.escape, pins), strict=True)), True), FLAGS)


@functools.lru_cache(maxsize=64)
def _run(kind: str, pins: tuple[bytes, ...]) -> re.Pattern:
    build, names, _ = RECORDS[kind]
    return re.compile(b"(?:" + build(dict(zip(names, map(re.escape, pins), strict=True)), False) + b")*", FLAGS)


def _key(kind: str, pins: dict[str, bytes]) -> tuple[bytes, ...]:
    return tuple(pins[k] for k in RECORDS[kind][1])


@dataclass
class Run:
    """A run matched, its records' groups not decoded yet: `memo_base` is the index of its first MEMOIZE."""

    kind: str
    found: list[tuple[bytes, ...]]  # emptied once decoded
    memo_base: int
    n: int = 0
    offsets: torch.Tensor | None = None  # chunk runs, once decoded: [n, ndim] each
    sizes: torch.Tensor | None = None
    columns: StorageColumns | None = None  # storage runs, once decoded: rows start..start+len(found)
    start: int = 0

    def __len__(self) -> int:
        return self.n


def match(kind: str, pins: dict[str, bytes], data: bytes, start: int, memo_base: int) -> tuple[Run, int, int]:
    """The run of `kind` with these references that starts at `start`: the run, where it ends, how many MEMOIZE
    its records hold (per record: NEWOBJ, the state dict, a new string, and per Size its tuple unless empty,
    TUPLE1 and REDUCE)."""
    key = _key(kind, pins)
    end = _run(kind, key).match(data, start).end()
    found = _record(kind, key).findall(data, start, end)
    if kind == "chunk":
        memos = sum(6 + bool(r[0] or r[4]) + bool(r[5] or r[9]) for r in found)
    else:
        memos = sum(4 + bool(r[0]) + bool(r[10]) + (0 if r[9] else 2 + bool(r[4] or r[8])) for r in found)
    return Run(kind=kind, found=found, memo_base=memo_base, n=len(found)), end, memos


class Tokens:
    """The captured groups of n records, column by column: `text(g)` the n byte strings of group g, and for the
    groups decoded as numbers their bytes joined, one column at a time (the strings, most of the bytes, are never
    copied into them)."""

    def __init__(self, runs: list[Run], groups: int) -> None:
        flat = list(itertools.chain.from_iterable(itertools.chain.from_iterable(r.found for r in runs)))
        self.n = len(flat) // groups
        self.cols: list[list[bytes]] = [flat[g::groups] for g in range(groups)]
        self._joined: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def _column(self, g: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Group g's bytes (uint8, 9 spare bytes at the end to read past), each token's start and length."""
        if g not in self._joined:
            lens = torch.frombuffer(array("q", map(len, self.cols[g])) or array("q", [0]), dtype=torch.int64)[: self.n]
            blob = torch.frombuffer(bytearray(b"".join(self.cols[g]) + bytes(9)), dtype=torch.uint8)
            self._joined[g] = (blob, lens.cumsum(0) - lens, lens)
        return self._joined[g]

    def byte(self, g: int) -> torch.Tensor:
        """The first byte of group g (0 where it is empty)."""
        blob, starts, lens = self._column(g)
        return blob[starts].long() * (lens > 0)

    def ints(self, g: int) -> torch.Tensor:
        """Group g of every record as the integer its token encodes (K, M unsigned; J, LONG1 signed; h, j: a
        memo index); 0 where the group is empty."""
        blob, starts, lens = self._column(g)
        kind = blob[starts].long() * (lens > 0)
        long1 = (kind == 0x8A).long()
        width = (lens - 1 - long1).clamp(min=0)
        places = torch.arange(8)
        byte = blob[starts[:, None] + 1 + long1[:, None] + places].long() * (places < width[:, None])
        value = (byte << (8 * places)).sum(1)
        signed = (kind == ord("J")) | (long1 > 0)
        top = byte.gather(1, (width - 1).clamp(min=0)[:, None])[:, 0]
        negative = signed & (width > 0) & (width < 8) & (top >= 128)
        return value - (negative.long() << (8 * width).clamp(max=62))

    def present(self, g: int) -> torch.Tensor:
        return self._column(g)[2] > 0

    def length(self, g: int) -> torch.Tensor:
        return torch.tensor(list(map(len, self.cols[g])), dtype=torch.int64)

    def text(self, g: int) -> list[bytes]:
        return self.cols[g]


def size_ints(tok: Tokens, first: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A Size captured at groups first..first+4 (args()): its integers [n, max(3, most)] and its length [n]."""
    count = sum(tok.present(first + i).long() for i in range(3))
    expected = torch.where(count > 0, tok.byte(first + 3) - 0x84, torch.zeros_like(count))
    if not bool((expected == count).all()):
        raise NotDecoded("a Size whose tuple opcode does not count its integers")
    values = torch.stack([tok.ints(first + i) for i in range(3)], 1)
    marked = tok.present(first + 4).nonzero()[:, 0].tolist()
    if not marked:
        return values, count
    texts = tok.text(first + 4)  # MARK ints TUPLE: 0 or 4+ integers, read one by one (rare: 4-D chunks)
    rows = [[_int(t) for t in INTS.findall(texts[k], 1, len(texts[k]) - 1)] for k in marked]
    for k, row in zip(marked, rows, strict=True):
        if sum(map(len, INTS.findall(texts[k], 1, len(texts[k]) - 1))) != len(texts[k]) - 2:
            raise NotDecoded("a Size of something other than integers")
        count[k] = len(row)
    wide = torch.zeros(len(values), max(3, *map(len, rows)), dtype=torch.int64)
    wide[:, :3] = values
    for k, row in zip(marked, rows, strict=True):
        wide[k, : len(row)] = torch.tensor(row, dtype=torch.int64)
    return wide, count


INTS = re.compile(INT, FLAGS)


def _int(token: bytes) -> int:
    if token[0] == 0x8A:
        return int.from_bytes(token[2:], "little", signed=True)
    return int.from_bytes(token[1:], "little", signed=token[0] == ord("J"))


def decode_chunks(runs: list[Run]) -> None:
    """Every record's offsets and sizes, into each run (a run's records have one number of dimensions)."""
    tok = Tokens(runs, 10)
    offsets, on = size_ints(tok, 0)
    sizes, sn = size_ints(tok, 5)
    at = 0
    for run in runs:
        n = len(run)
        ndim = int(on[at]) if n else 0
        if not (bool((on[at : at + n] == ndim).all()) and bool((sn[at : at + n] == ndim).all())):
            raise NotDecoded("chunks of one list with different numbers of dimensions")
        run.offsets, run.sizes, run.found = offsets[at : at + n, :ndim], sizes[at : at + n, :ndim], []
        at += n


@dataclass
class StorageColumns:
    """(MetadataIndex, _StorageInfo) entries of storage_data as columns; strings as ids of the caller's names."""

    fqn: torch.Tensor  # name id
    ndim: torch.Tensor  # -1: offset None (a non-tensor entry)
    offsets: torch.Tensor  # [n, 3]
    path: torch.Tensor  # name id
    offset: torch.Tensor  # of the blob in the file
    length: torch.Tensor


def decode_storage(runs: list[Run], strings: Callable[[list[bytes]], list[int]],
                   ref: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Every entry of these storage runs, into one StorageColumns the runs share. `strings(texts)` gives ids to
    texts, `ref(indices, before)` the ids of the strings at memo indices of earlier batches (each before its
    record). Returns the memo indices of the strings these runs created, sorted, with their ids."""
    tok = Tokens(runs, 15)  # fqn (len, text, ref) index Size(5) None path (len, text, ref) offset length
    offsets, count = size_ints(tok, 4)
    none = tok.present(9)
    fqn_new, path_new = tok.present(0), tok.present(10)
    for g in (0, 10):  # a new string's length byte is its length (else the match split an opcode differently)
        if not bool(((tok.byte(g) == tok.length(g + 1)) | ~tok.present(g)).all()):
            raise NotDecoded("a string whose length byte is not its length")
    mi = 2 + fqn_new.long() + torch.where(none, torch.zeros_like(count), 2 + (count > 0).long())
    each = mi + 2 + path_new.long()
    sizes = torch.tensor([len(r) for r in runs])
    first = torch.tensor([r.memo_base for r in runs]).repeat_interleave(sizes)
    run_start = (sizes.cumsum(0) - sizes).repeat_interleave(sizes)
    done = each.cumsum(0) - each
    base = first + done - done[run_start]
    fqn = torch.tensor(strings(tok.text(1)), dtype=torch.int64)  # rows with a reference get the id of b""
    path = torch.tensor(strings(tok.text(11)), dtype=torch.int64)
    made_at = torch.cat([(base + 2)[fqn_new], (base + mi + 2)[path_new]])
    made_id = torch.cat([fqn[fqn_new], path[path_new]])
    order = made_at.argsort()
    made_at, made_id = made_at[order], made_id[order]
    for ids, g, record_at in ((fqn, 0, base), (path, 10, base + mi)):
        refs = ~tok.present(g)
        if bool(refs.any()):
            ids[refs] = _resolve(tok.ints(g + 2)[refs], record_at[refs], made_at, made_id, ref)
    # group 3, MetadataIndex.index: a hint torch neither compares nor hashes, not used
    columns = StorageColumns(fqn=fqn, ndim=torch.where(none, torch.full_like(count, -1), count), offsets=offsets,
                             path=path, offset=tok.ints(13), length=tok.ints(14))
    at = 0
    for run in runs:
        run.columns, run.start, run.found = columns, at, []
        at += len(run)
    return made_at, made_id


def _resolve(indices: torch.Tensor, record_at: torch.Tensor, made_at: torch.Tensor, made_id: torch.Tensor,
             ref: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """The ids of the strings these memo indices refer to: made earlier in this batch, or else (ref) before it."""
    if not bool((indices < record_at).all()):
        raise NotDecoded("a reference to a later memo entry")
    at = torch.searchsorted(made_at, indices).clamp(max=max(len(made_at) - 1, 0))
    here = made_at[at] == indices if len(made_at) else torch.zeros_like(indices, dtype=torch.bool)
    out = torch.empty_like(indices)
    out[here] = made_id[at[here]]
    if bool((~here).any()):
        out[~here] = ref(indices[~here], record_at[~here])
    return out


# -- the edges of the grammar: the file's frames, the allow-list as the fast reader takes it, torch's threads --
def unframe(raw: bytes) -> bytes:
    """The opcodes of a protocol 4/5 pickle without its FRAME headers, which must tile it."""
    if len(raw) < 3 or raw[0] != 0x80 or raw[1] not in PROTOCOLS:
        raise NotDecoded("not a protocol 4 or 5 pickle")
    pos, parts = 2, []
    while pos < len(raw):
        if raw[pos] != FRAME or pos + 9 > len(raw):
            raise NotDecoded("an opcode outside a frame")
        n = int.from_bytes(raw[pos + 1 : pos + 9], "little")
        parts.append(raw[pos + 9 : pos + 9 + n])
        pos += 9 + n
    if pos != len(raw):
        raise NotDecoded("a frame past the end of the file")
    return b"".join(parts)


def size(values: Any) -> tuple[int, ...]:
    """torch.Size(values) as a plain tuple of ints."""
    if not isinstance(values, tuple) or not all(type(v) is int for v in values):
        raise NotDecoded("a torch.Size of something other than integers")
    return values


size.pickled_as = "torch.Size"  # type: ignore[attr-defined]


def allowed(table: dict[tuple[str, str], Any]) -> dict[tuple[str, str], Any]:
    """The general reader's allow-list for .metadata, each record its own class (so a run can check the class
    it refers to) and torch.Size a plain tuple."""
    out = {}
    for (module, name), value in table.items():
        if value is Record:
            out[module, name] = record_class(module, name)
        elif (module, name) == ("torch", "Size"):
            out[module, name] = size
        else:
            out[module, name] = value
    return out

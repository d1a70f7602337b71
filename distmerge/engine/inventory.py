"""Inventories as they travel in discovery's all-gather: columns of integers, not pickled objects.

Every rank receives every rank's inventory, because every rank makes the same plan from all of them. At
frontier scale that is a lot: Llama-3.1-405B saved by FSDP2 at W=1024 is 1.16 million fragments. Sent as
pickled `Fragment` objects, each rank received 80 MB and spent about half of its 17.4 s of planning (one core)
unpickling them (tests/bench/bench_scale.py). Packed, a rank's part is a few tables (each distinct name, key, dtype and
global shape once) and one typed array per field, as narrow as its values allow; unpacking builds each
`Fragment` from plain integers and hands out one shared tuple per distinct shape, offset and length
combination (the lengths of 1024 Shard(0) pieces are two tuples, not 1024), which also shrinks what the plan
holds. The fragments that come out equal those that went in, in the same order.

    reader rank    pack(its fragments)         -> Packed (small, picklable)
                   all_gather_object            (comm.gather)
    every rank     unpack(every rank's Packed)  -> the fragments, rank by rank, in each rank's order
"""

from __future__ import annotations

import itertools
import operator
from array import array
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

from distmerge.formats.base import Fragment

TYPECODES = ("b", "h", "i", "q")  # signed, 1 to 8 bytes: the narrowest that holds a column is used


@dataclass(frozen=True, kw_only=True)
class Packed:
    """One rank's inventory. `columns` hold, per fragment: name, key (string indices), dtype, global shape
    (table indices), file index, byte offset, flat flag, number of offsets and of lengths; `box` holds
    the offsets then the lengths of each fragment in turn."""

    strings: tuple[str, ...]
    dtypes: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    columns: tuple[tuple[str, bytes], ...]  # (array typecode, bytes) per field, in FIELDS order
    box: tuple[str, bytes]

    def __len__(self) -> int:
        return len(_values(self.columns[0]))


FIELDS = ("name", "key", "dtype", "shape", "file_index", "byte_offset", "flat", "offsets_n", "lengths_n")
# Every field of Fragment travels (tests/test_inventory.py fails when Fragment gains one this module drops).
CARRIED = ("name", "dtype", "global_shape", "offsets", "lengths", "file_index", "byte_offset", "key", "flat")


def pack(fragments: list[Fragment]) -> Packed:
    """Column by column, each made by C-level iteration (map, attrgetter, a defaultdict numbering the distinct
    values): a million fragments pack in about a second, not in ten."""
    tables: tuple[dict, dict, dict] = tuple(defaultdict(itertools.count().__next__) for _ in range(3))  # type: ignore
    strings, dts, shapes = tables
    get = {f: list(map(operator.attrgetter(f), fragments)) for f in CARRIED}
    offsets, lengths = get["offsets"], get["lengths"]
    columns = [list(map(strings.__getitem__, get["name"])), list(map(strings.__getitem__, get["key"])),
               list(map(dts.__getitem__, get["dtype"])), list(map(shapes.__getitem__, get["global_shape"])),
               get["file_index"], get["byte_offset"], list(map(int, get["flat"])), list(map(len, offsets)),
               list(map(len, lengths))]
    box = list(itertools.chain.from_iterable(itertools.chain.from_iterable(zip(offsets, lengths, strict=True))))
    return Packed(strings=tuple(strings), dtypes=tuple(dts), shapes=tuple(shapes),
                  columns=tuple(_column(c) for c in columns), box=_column(box))


def unpack(parts: Iterable[Packed]) -> list[Fragment]:
    out: list[Fragment] = []
    shared: dict[tuple[int, ...], tuple[int, ...]] = {}  # one tuple object per distinct offsets / lengths
    for part in parts:
        out.extend(_unpack_one(part, shared))
    return out


def _unpack_one(part: Packed, shared: dict) -> list[Fragment]:
    names, keys, dts, shapes, files, starts, flats, n_offsets, n_lengths = (_values(c) for c in part.columns)
    box = _values(part.box)  # sliced as an array: its ints exist only inside the tuples kept
    strings = [shared.setdefault(s, s) for s in part.strings]  # one str object per name across all parts
    global_shapes = [shared.setdefault(s, s) for s in part.shapes]
    ends = list(itertools.accumulate(map(operator.add, n_offsets, n_lengths)))
    cuts = list(map(operator.sub, ends, n_lengths))  # where each fragment's lengths start in box
    begins = list(map(operator.sub, cuts, n_offsets))
    offsets = list(map(shared.setdefault, *_twice(map(tuple, map(box.__getitem__, map(slice, begins, cuts))))))
    lengths = list(map(shared.setdefault, *_twice(map(tuple, map(box.__getitem__, map(slice, cuts, ends))))))
    rows = zip(map(strings.__getitem__, names), map(part.dtypes.__getitem__, dts),
               map(global_shapes.__getitem__, shapes), offsets, lengths, files, starts,
               map(strings.__getitem__, keys), map(bool, flats), strict=True)
    return list(itertools.starmap(Fragment.make, rows))


def _twice(values: Iterable) -> tuple[list, list]:
    items = list(values)
    return items, items


def _column(values: list[int]) -> tuple[str, bytes]:
    low, high = (min(values), max(values)) if values else (0, 0)
    code = next(c for c in TYPECODES if -(1 << (8 * array(c).itemsize - 1)) <= low and
                high < (1 << (8 * array(c).itemsize - 1)))
    return code, array(code, values).tobytes()


def _values(column: tuple[str, bytes]) -> array:
    code, data = column
    values = array(code)
    values.frombytes(data)
    return values

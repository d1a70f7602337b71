"""DCP `.metadata` decoded without an opcode walk in Python and without an object per chunk.

A 1024-rank save of Llama-3.1-405B has 1.16 million chunks: 191 MB of pickle, 2.3 million records. The general
reader (pickle_scan, then the C unpickler with the restricted allow-list) walks its 60 million opcodes in Python
first (about 150 s) and then holds a record per chunk (about 5 GB). Here the file is taken apart instead:

    frames    the FRAME headers must tile the file; they are dropped (a frame is only a read-ahead hint)
    runs      the records of the chunks lists and of storage_data, matched and decoded in runs at C speed
              (runs.py): each run stays one object of integer columns (ChunkRun, a StorageSlice)
    the rest  a stack machine over the remaining opcodes (about a hundred per tensor) builds the skeleton:
              Metadata, each tensor's TensorStorageMetadata and TensorProperties, StorageMeta, ... as the
              inert records of the allow-list

It reads the pickles torch's FileSystemWriter.finish writes (`pickle.dump`, protocol 4 or 5), nothing else:
any other opcode, protocol or global, a PUT with an explicit index, a dict key that is not a string, an
integer or a record, a memo reference into a run, raises NotDecoded, and the caller reads the file with the
general reader, which gives its verdict, and its one-line refusals, for any pickle. docs/reliability.md says
why this is as safe as the general reader.
"""

from __future__ import annotations

import bisect
import itertools
import re
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

from distmerge.formats.torch_private.dcp import runs
from distmerge.formats.torch_private.dcp.runs import NotDecoded
from distmerge.formats.torch_private.restricted import DTYPES, Record, record_class
from distmerge.threads import one_thread

REF_RUN = re.compile(rb"(?:h.|j....)+", re.DOTALL)  # memo references, one after the other
REF_TOKEN = re.compile(rb"h.|j....", re.DOTALL)
STOP, MARK = 0x2E, 0x28
REFS = (0x68, 0x6A)  # BINGET, LONG_BINGET: a run's record starts with a reference to its class
BATCH = 1 << 15  # records decoded together: the per-call cost of torch's operations spread, the tokens' memory bounded
RECORD = b")\x81\x94}\x94("  # after its class: EMPTY_TUPLE NEWOBJ MEMOIZE EMPTY_DICT MEMOIZE MARK (runs.NEW)
MAX_LONG = 8  # LONG1 integers of at most 8 bytes: offsets and sizes are int64 in torch

# The class behind each pin a run must resolve to (runs.CHUNK_PINS, STORAGE_PINS).
METADATA, FILESYSTEM = "torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem"
PINS = {
    "chunk": {"cls": f"{METADATA}.ChunkStorageMetadata", "ko": "offsets", "ks": "sizes", "sz": "torch.Size"},
    "storage": {"mi": f"{METADATA}.MetadataIndex", "kf": "fqn", "ki": "index", "ko": "offset", "sz": "torch.Size",
                "si": f"{FILESYSTEM}._StorageInfo", "kp": "relative_path", "kl": "length"},
}


class StorageSlice:
    """storage_data's entries of one storage run (a key of storage_data, its value None)."""

    __slots__ = ("run",)

    def __init__(self, run: runs.Run) -> None:
        self.run = run


def decode(raw: bytes, table: dict[tuple[str, str], Any]) -> tuple[Any, list[str]]:
    """The skeleton of the pickled Metadata (runs standing in for their records), and the strings its storage
    runs name by id."""
    machine = Machine(runs.unframe(raw), runs.allowed(table))
    del raw  # the caller passes the file's bytes on: they are freed here, the opcodes kept
    with one_thread():
        return machine.run(), machine.texts()


class Machine:
    """The stack machine of the pickle opcodes torch's metadata uses, over `data` (frames removed)."""

    def __init__(self, data: bytes, table: dict[tuple[str, str], Any]) -> None:
        self.data, self.pos, self.table = data, 0, table
        self.stack: list[Any] = []
        self.marks: list[int] = []
        self.memo: dict[int, Any] = {}  # what the skeleton memoised
        self.memo_len = 0  # every MEMOIZE so far, the runs' included
        self.names: defaultdict[bytes, int] = defaultdict(itertools.count().__next__)  # a run string's id
        self.made: dict[int, int] = {}  # memo index of a string a run created -> its id in names
        self.pending: dict[str, list[runs.Run]] = {"chunk": [], "storage": []}  # matched, not decoded yet
        self.waiting = {"chunk": 0, "storage": 0}  # their records
        self.chunk_runs: list[runs.Run] = []  # every chunk run, by its first memo index (recall)
        self.chunk_bases: list[int] = []
        self.callables = {id(v) for v in table.values()}  # what REDUCE may call: the allow-list's constructors

    def run(self) -> Any:
        data, ops = self.data, HANDLERS
        try:
            while (op := data[self.pos]) != STOP:
                self.pos += 1
                handler = ops.get(op)
                if handler is None:
                    raise NotDecoded(f"opcode {op:#04x}")
                handler(self)
        except (IndexError, KeyError, TypeError, ValueError) as err:  # a short stack, a missing memo entry ...
            raise NotDecoded(str(err)) from None
        if len(self.stack) != 1 or self.marks or self.pos != len(data) - 1:
            raise NotDecoded("a pickle that does not end with one object")
        self.flush("chunk")
        self.flush("storage")
        return self.stack[0]

    def take(self, n: int) -> bytes:
        out = self.data[self.pos : self.pos + n]
        if len(out) != n:
            raise NotDecoded("a truncated opcode")
        self.pos += n
        return out

    def to_mark(self) -> list[Any]:
        at = self.marks.pop()
        items = self.stack[at:]
        del self.stack[at:]
        return items

    # -- values ---------------------------------------------------------------------------------------------------
    def op_int1(self) -> None:
        self.stack.append(self.take(1)[0])

    def op_int2(self) -> None:
        self.stack.append(int.from_bytes(self.take(2), "little"))

    def op_int4(self) -> None:
        self.stack.append(int.from_bytes(self.take(4), "little", signed=True))

    def op_long1(self) -> None:
        n = self.take(1)[0]
        if n > MAX_LONG:
            raise NotDecoded("an integer wider than 8 bytes")
        self.stack.append(int.from_bytes(self.take(n), "little", signed=True))

    def op_none(self) -> None:
        self.stack.append(None)

    def op_true(self) -> None:
        self.stack.append(True)

    def op_false(self) -> None:
        self.stack.append(False)

    def op_short_text(self) -> None:
        self.stack.append(self.take(self.take(1)[0]).decode())

    def op_text(self) -> None:
        self.stack.append(self.take(int.from_bytes(self.take(4), "little")).decode())

    # -- memo -----------------------------------------------------------------------------------------------------
    def op_memoize(self) -> None:
        self.memo[self.memo_len] = self.stack[-1]
        self.memo_len += 1

    # The two references are most of the opcodes of Megatron's plans (all_local_plans): inlined, a hit in the
    # memo costs one dict lookup.
    def op_get(self) -> None:
        index = self.take(1)[0]
        value = self.memo.get(index, self)
        self.stack.append(value if value is not self else self.recall(index))

    def op_long_get(self) -> None:
        index = int.from_bytes(self.take(4), "little")
        value = self.memo.get(index, self)
        self.stack.append(value if value is not self else self.recall(index))

    def recall(self, index: int) -> Any:
        """Memo entry `index`; one a run made (a string of storage_data, a chunk or its Size: Megatron's plans
        refer to the chunks) is rebuilt from the run's columns."""
        value = self.memo.get(index, self)
        if value is not self:
            return value
        if index >= self.memo_len:
            raise NotDecoded("a reference to a memo entry not made yet")
        self.flush("chunk")
        self.flush("storage")
        value = self.texts()[self.made[index]] if index in self.made else self._chunk_part(index)
        self.memo[index] = value
        return value

    def _chunk_part(self, index: int) -> Any:
        at = bisect.bisect_right(self.chunk_bases, index) - 1
        if at < 0:
            raise NotDecoded("a reference into a run that is not a chunk's")
        run = self.chunk_runs[at]
        ndim = run.offsets.shape[1]
        per = 6 + 2 * (ndim > 0)
        k, slot = divmod(index - run.memo_base, per)
        if k >= len(run):
            raise NotDecoded("a reference into a run that is not a chunk's")
        offsets, sizes = tuple(run.offsets[k].tolist()), tuple(run.sizes[k].tolist())
        state = {"offsets": offsets, "sizes": sizes}
        if slot == 0:
            kind = record_class(METADATA, "ChunkStorageMetadata")
            chunk = kind.__new__(kind)
            chunk.__setstate__(state)
            return chunk
        parts = [state, offsets, (offsets,), offsets, sizes, (sizes,), sizes] if ndim else [
            state, (offsets,), offsets, (sizes,), sizes]
        return parts[slot - 1]

    # -- containers -----------------------------------------------------------------------------------------------
    def op_mark(self) -> None:
        self.marks.append(len(self.stack))
        self.runs()
        if (refs := REF_RUN.match(self.data, self.pos)) is not None and refs.end() - self.pos > 64:
            self.references(refs.end())

    def references(self, end: int) -> None:
        """A batch of items that are all memo references (a list repeating objects): pushed at C speed."""
        tokens = REF_TOKEN.findall(self.data, self.pos, end)
        indices = [t[1] if t[0] == REFS[0] else int.from_bytes(t[1:], "little") for t in tokens]
        before = len(self.stack)
        try:
            self.stack.extend(map(self.memo.__getitem__, indices))
        except KeyError:  # extend keeps what it took before the miss
            self.stack.extend(map(self.recall, indices[len(self.stack) - before :]))
        self.pos = end

    def op_empty_tuple(self) -> None:
        self.stack.append(())

    def op_tuple1(self) -> None:
        self._tuple(1)

    def op_tuple2(self) -> None:
        self._tuple(2)

    def op_tuple3(self) -> None:
        self._tuple(3)

    def _tuple(self, n: int) -> None:
        if len(self.stack) - (self.marks[-1] if self.marks else 0) < n:
            raise NotDecoded("a tuple of more items than the stack holds")
        self.stack[-n:] = [tuple(self.stack[-n:])]

    def op_tuple(self) -> None:
        self.stack.append(tuple(self.to_mark()))

    def op_empty_list(self) -> None:
        self.stack.append([])

    def op_append(self) -> None:
        value = self.stack.pop()
        _list(self.stack[-1]).append(value)

    def op_appends(self) -> None:
        items = self.to_mark()
        _list(self.stack[-1]).extend(items)

    def op_empty_dict(self) -> None:
        self.stack.append({})

    def op_setitem(self) -> None:
        value, key = self.stack.pop(), self.stack.pop()
        _dict(self.stack[-1])[_key(key)] = value

    def op_setitems(self) -> None:
        items = self.to_mark()
        if len(items) % 2:
            raise NotDecoded("SETITEMS of an odd number of items")
        target = _dict(self.stack[-1])
        for key, value in zip(items[::2], items[1::2], strict=True):
            target[_key(key)] = value

    # -- objects --------------------------------------------------------------------------------------------------
    def op_stack_global(self) -> None:
        name, module = self.stack.pop(), self.stack.pop()
        if not (isinstance(module, str) and isinstance(name, str)):
            raise NotDecoded("STACK_GLOBAL of something other than names")
        if (module, name) in self.table:
            self.stack.append(self.table[module, name])
        elif module == "torch" and name in DTYPES:
            self.stack.append(DTYPES[name])
        else:
            raise NotDecoded(f"global {module}.{name}")

    def op_newobj(self) -> None:
        args, cls = self.stack.pop(), self.stack.pop()
        if not (isinstance(cls, type) and issubclass(cls, Record) and isinstance(args, tuple)):
            raise NotDecoded("NEWOBJ of something other than a metadata record")
        self.stack.append(cls.__new__(cls, *args))

    def op_reduce(self) -> None:
        args, func = self.stack.pop(), self.stack.pop()
        if not (id(func) in self.callables and isinstance(args, tuple)):
            raise NotDecoded("REDUCE of something other than an allowed constructor")
        self.stack.append(func(*args))

    def op_build(self) -> None:
        state = self.stack.pop()
        obj = self.stack[-1]
        if not isinstance(obj, Record):
            raise NotDecoded("BUILD of something other than a record")
        obj.__setstate__(state)
        self.runs()

    # -- runs -----------------------------------------------------------------------------------------------------
    def runs(self) -> None:
        """At the start of a list's or a dict's items (after MARK) or between them (after a record's BUILD):
        match the run of records that starts here, if one does; its records are decoded in batches (flush)."""
        if not self.marks or self.marks[-1] == 0 or self.pos >= len(self.data) or self.data[self.pos] not in REFS:
            return
        container, items = self.stack[self.marks[-1] - 1], len(self.stack) - self.marks[-1]
        kind = "chunk" if isinstance(container, list) else "storage" if isinstance(container, dict) else None
        if kind is None or (kind == "storage" and items % 2):
            return
        if not self.data.startswith(RECORD, self.pos + (2 if self.data[self.pos] == REFS[0] else 5)):
            return  # a key or a value, not a record (Megatron's plans: most items of their dicts)
        pins = runs.first(kind, self.data, self.pos)
        if pins is None or not all(self._pinned(pins[k], want) for k, want in PINS[kind].items()):
            return
        run, self.pos, memos = runs.match(kind, pins, self.data, self.pos, self.memo_len)
        self.memo_len += memos
        self.stack += [run] if kind == "chunk" else [StorageSlice(run), None]
        if kind == "chunk":
            self.chunk_runs.append(run)
            self.chunk_bases.append(run.memo_base)
        self.pending[kind].append(run)
        self.waiting[kind] += len(run)
        if self.waiting[kind] >= BATCH:
            self.flush(kind)

    def flush(self, kind: str) -> None:
        batch, self.pending[kind], self.waiting[kind] = self.pending[kind], [], 0
        if not batch:
            return
        if kind == "chunk":
            runs.decode_chunks(batch)
            return
        made_at, made_id = runs.decode_storage(batch, self._ids, self._refs)
        self.made.update(zip(made_at.tolist(), made_id.tolist(), strict=True))

    def _pinned(self, ref: bytes, want: str) -> bool:
        value = self.memo.get(ref[1] if ref[0] == REFS[0] else int.from_bytes(ref[1:], "little"))
        return value == want if isinstance(value, str) else getattr(value, "pickled_as", None) == want

    def _ids(self, texts: list[bytes]) -> list[int]:
        return list(map(self.names.__getitem__, texts))

    def _refs(self, indices: torch.Tensor, before: torch.Tensor) -> torch.Tensor:
        """The ids of the strings at these memo indices (made by earlier batches, or by the skeleton)."""
        out = []
        for index in indices.tolist():
            found = self.made.get(index)
            if found is None:
                value = self.memo.get(index)
                if not isinstance(value, str):
                    raise NotDecoded("a reference to something other than a string where a name belongs")
                found = self.names[value.encode()]
            out.append(found)
        return torch.tensor(out, dtype=torch.int64)

    def texts(self) -> list[str]:
        """The strings the runs named, by id."""
        out = [""] * len(self.names)
        for raw, i in self.names.items():
            out[i] = raw.decode()
        return out


def _list(value: Any) -> list:
    if not isinstance(value, list):
        raise NotDecoded("APPEND to something other than a list")
    return value


def _dict(value: Any) -> dict:
    if not isinstance(value, dict):
        raise NotDecoded("SETITEM on something other than a dict")
    return value


def _key(key: Any) -> Any:
    """Dict keys are hashed: only what hashes in constant time (not a tuple, which may nest or share itself)."""
    if key is None or type(key) in (str, int, bool) or isinstance(key, (Record, StorageSlice)):
        return key
    raise NotDecoded("a dict key that is not a name, an integer or a record")


OPCODES = {
    "K": "int1", "M": "int2", "J": "int4", "\x8a": "long1", "N": "none", "\x88": "true", "\x89": "false",
    "\x8c": "short_text", "X": "text", "\x94": "memoize", "h": "get", "j": "long_get", "(": "mark",
    ")": "empty_tuple", "\x85": "tuple1", "\x86": "tuple2", "\x87": "tuple3", "t": "tuple", "]": "empty_list",
    "a": "append", "e": "appends", "}": "empty_dict", "s": "setitem", "u": "setitems", "\x93": "stack_global",
    "\x81": "newobj", "R": "reduce", "b": "build",
}

# Each opcode's handler, the class's function (called with the machine), not a bound method kept on the machine: a
# machine holding its own bound methods is a reference cycle, which kept the whole decoded skeleton (its runs'
# columns: ~0.3 GB at 1024 ranks) alive after `decode` returned, until a full collection, never while the engine
# runs with the collector off (engine/run.py).
HANDLERS: dict[int, Callable[[Machine], None]] = {ord(k): getattr(Machine, f"op_{v}") for k, v in OPCODES.items()}

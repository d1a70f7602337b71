"""A pickle's opcode stream checked against budgets before anything unpickles it.

Python's unpickler (and torch's weights_only one) trusts the stream's shape: one `LONG_BINPUT 2**28`
makes a 4 GiB memo, a tuple nested 10^6 deep crashes the process when it is freed or hashed, a dict key
that is a tuple sharing itself 60 levels deep is hashed 2^60 times, a REDUCE of an allowed allocator
asks for gigabytes. `check` walks the stream once with `pickletools.genops` and simulates the stack
with small stand-ins that remember only what the budgets need: how many nodes each value expands to
as a tree, how deep it nests, and, for short strings and ints, their value. Nothing is built.

Rules (each refusal names the file and the limit):
- every global is on the caller's allow-list, checked by name (nothing is imported or looked up);
- the memo grows one entry at a time, as pickle writes it (no index past its size);
- a value nests at most `max_depth` containers and expands to at most `nodes_per_byte` nodes per byte
  of the pickle, so any later walk of it (str, hash, copy) is linear in the file;
- dict keys and set elements are small (`max_key_nodes`): hashing them is cheap;
- a list, dict or object is filled before it is placed in another (no cycles, no growth after sharing);
- no extension codes, out-of-band buffers or text persistent ids; a storage's persistent id names a
  record that exists and is large enough for the elements it declares.
"""

from __future__ import annotations

import _compat_pickle
import pickletools
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from distmerge.errors import CorruptInputError

MiB = 2**20


@dataclass(frozen=True, kw_only=True)
class Budget:
    """What one pickle may cost. The defaults fit a 671B-parameter model's largest torch.save pickle
    (an FSDP rank file of ~92k DTensors: ~37 MB, ~10M nodes, depth ~12) with room to spare; see
    docs/reliability.md for the estimates."""

    max_bytes: int = 256 * MiB
    max_depth: int = 64  # nested containers; Python's own recursion needs ~1000 to crash
    max_items: int = 2**24  # entries in one list, dict or set
    nodes_per_byte: int = 64  # tree size of any value, per byte of the pickle
    max_key_nodes: int = 64  # tree size of a dict key or set element
    max_int_bytes: int = 64  # LONG1/LONG4 ints: str() of a huge int is quadratic


DEFAULT = Budget()
SHORT = 256  # strings up to this length keep their value (global names, storage keys)
REFUSED_OPS = {"EXT1", "EXT2", "EXT4", "NEXT_BUFFER", "READONLY_BUFFER", "PERSID"}
HASHING_CALLS = {("builtins", "set"), ("builtins", "frozenset"), ("collections", "OrderedDict"), ("builtins", "dict")}
MUTABLE = {"list", "dict", "set", "object"}
REBUILD_TENSOR = ("torch._utils", "_rebuild_tensor_v2")


def python3_name(module: str, name: str) -> tuple[str, str]:
    """A global of a protocol 0-2 pickle as pickle's fix_imports names it (`__builtin__ getattr`: `builtins`)."""
    return _compat_pickle.NAME_MAPPING.get((module, name)) or (_compat_pickle.IMPORT_MAPPING.get(module, module), name)


class _Item:
    """A stand-in for one value on the simulated stack."""

    __slots__ = ("kind", "nodes", "depth", "sealed", "value", "parts", "count", "max_part")

    def __init__(self, kind: str, nodes: int = 1, depth: int = 0, value: object = None,
                 parts: tuple[_Item, ...] | None = None) -> None:
        self.kind, self.nodes, self.depth, self.value, self.parts = kind, nodes, depth, value, parts
        self.sealed, self.count, self.max_part = False, 0, 0


class _Refused(Exception):
    pass


def check(data: bytes, where: str, allowed: Callable[[str, str], bool], *, budget: Budget = DEFAULT,
          storages: Mapping[str, int] | None = None, itemsize: Callable[[str, str], int | None] | None = None,
          unknown: Callable[[str, str], str] | None = None) -> None:
    """Raise CorruptInputError naming `where` and the limit when `data` breaks a rule above.

    `allowed(module, name)`: may the pickle name this global. `storages` (record key -> bytes), when
    given, is what persistent ids may point at; `itemsize(module, name)` gives the element size of the
    storage type or dtype a persistent id names; `unknown(module, name)`, what to add when a global is refused
    (a torch class of a release the reader does not know yet, say)."""
    if len(data) > budget.max_bytes:
        raise CorruptInputError(f"{where}: its pickle is {len(data)} bytes, over the limit of {budget.max_bytes} "
                                "(max_bytes)")
    sim = _Machine(allowed, budget, storages, itemsize, budget.nodes_per_byte * max(len(data), 4096), unknown)
    try:
        for op, arg, _pos in pickletools.genops(data):
            sim.step(op.name, arg)
    except _Refused as why:
        raise CorruptInputError(f"{where}: refused before unpickling: {why}") from None
    except (ValueError, IndexError, KeyError, TypeError, UnicodeDecodeError) as err:
        raise CorruptInputError(f"{where}: not a valid pickle ({str(err)[:120]}): truncated or corrupt") from None


class _Machine:
    def __init__(self, allowed, budget: Budget, storages, itemsize, max_nodes: int, unknown=None) -> None:
        self.allowed, self.budget, self.storages, self.itemsize = allowed, budget, storages, itemsize
        self.max_nodes, self.unknown = max_nodes, unknown  # unknown: why a refused global may be legitimate (check)
        self.stack: list[_Item] = []
        self.marks: list[int] = []
        self.memo: dict[int, _Item] = {}
        self.proto = 0
        self.handlers = {op.name: getattr(self, "op_" + op.name) for op in pickletools.opcodes
                         if op.name not in REFUSED_OPS}

    # -- the stack -------------------------------------------------------------------------------------
    def pop(self) -> _Item:
        if not self.stack or (self.marks and len(self.stack) <= self.marks[-1]):
            raise _Refused("the pickle pops below a mark or an empty stack")
        return self.stack.pop()

    def pop_mark(self) -> list[_Item]:
        if not self.marks:
            raise _Refused("the pickle closes a mark it never opened")
        at = self.marks.pop()
        items, self.stack[at:] = self.stack[at:], []
        return items

    def sized(self, item: _Item) -> _Item:
        if item.depth > self.budget.max_depth:
            raise _Refused(f"values nest deeper than {self.budget.max_depth} containers (limit max_depth)")
        if item.nodes > self.max_nodes:
            raise _Refused(f"a value expands to more than {self.max_nodes} objects, {self.budget.nodes_per_byte} per "
                           "byte of the pickle (limit nodes_per_byte): shared sub-values multiply")
        if item.count > self.budget.max_items:
            raise _Refused(f"a container holds more than {self.budget.max_items} entries (limit max_items)")
        return item

    def made(self, kind: str, parts: list[_Item], value: object = None) -> _Item:
        """A new value holding `parts` (each now shared: sealed)."""
        nodes, depth, biggest = 1, 0, 0
        for p in parts:
            p.sealed = True
            nodes += p.nodes
            depth = max(depth, p.depth)
            biggest = max(biggest, p.nodes)
        item = _Item(kind, nodes, depth + 1, value, tuple(parts) if len(parts) <= 8 else None)
        item.count, item.max_part = len(parts), biggest
        if depth >= self.budget.max_depth or nodes > self.max_nodes or item.count > self.budget.max_items:
            self.sized(item)
        return item

    def grow(self, target: _Item, parts: list[_Item], keys: list[_Item] = ()) -> None:
        """Add `parts` to a list, dict, set or object still being filled."""
        if target.kind not in MUTABLE:
            raise _Refused(f"the pickle adds items to a {target.kind}")
        if target.sealed:
            raise _Refused("a container is changed after it was placed in another (a cycle or later growth)")
        for key in keys:
            self.key(key)
        for p in parts:
            p.sealed = True
            target.nodes += p.nodes
            target.depth = max(target.depth, p.depth + 1)
            target.max_part = max(target.max_part, p.nodes)
        target.count += len(parts) - len(keys)
        self.sized(target)

    def key(self, key: _Item) -> None:
        if key.kind == "text":
            return
        if key.nodes > self.budget.max_key_nodes or key.kind in MUTABLE - {"object"}:
            raise _Refused(f"a dict key or set element is a {key.kind} of {key.nodes} objects (limit max_key_nodes "
                           f"= {self.budget.max_key_nodes} scalars)")

    # -- one opcode --------------------------------------------------------------------------------------
    def step(self, name: str, arg: object) -> None:
        handler = self.handlers.get(name)
        if handler is None:
            raise _Refused(f"opcode {name} is not allowed (extension codes, buffers, text persistent ids)")
        handler(arg)

    def op_PROTO(self, arg) -> None:
        self.proto = int(arg)

    def op_FRAME(self, arg) -> None:
        pass

    def op_STOP(self, arg) -> None:
        self.pop()

    def atom(self, arg) -> None:
        kind = type(arg)
        if kind is str:
            self.stack.append(_Item("text", value=arg if len(arg) <= SHORT else None))
        elif kind is int:
            if arg.bit_length() > 8 * self.budget.max_int_bytes:
                raise _Refused(f"an integer of more than {self.budget.max_int_bytes} bytes (limit max_int_bytes)")
            self.stack.append(_Item("atom", value=arg))
        else:
            self.stack.append(_Item("atom"))

    op_INT = op_BININT = op_BININT1 = op_BININT2 = op_LONG = op_LONG1 = op_LONG4 = atom
    op_STRING = op_BINSTRING = op_SHORT_BINSTRING = op_BINBYTES = op_SHORT_BINBYTES = op_BINBYTES8 = atom
    op_BYTEARRAY8 = op_NONE = op_NEWTRUE = op_NEWFALSE = op_FLOAT = op_BINFLOAT = atom
    op_UNICODE = op_SHORT_BINUNICODE = op_BINUNICODE = op_BINUNICODE8 = atom

    def op_EMPTY_LIST(self, arg) -> None:
        self.stack.append(_Item("list", depth=1))

    def op_EMPTY_DICT(self, arg) -> None:
        self.stack.append(_Item("dict", depth=1))

    def op_EMPTY_SET(self, arg) -> None:
        self.stack.append(_Item("set", depth=1))

    def op_EMPTY_TUPLE(self, arg) -> None:
        self.stack.append(_Item("tuple", depth=1, parts=()))

    def op_TUPLE(self, arg) -> None:
        self.stack.append(self.made("tuple", self.pop_mark()))

    def op_TUPLE1(self, arg) -> None:
        self.stack.append(self.made("tuple", [self.pop()]))

    def op_TUPLE2(self, arg) -> None:
        b, a = self.pop(), self.pop()
        self.stack.append(self.made("tuple", [a, b]))

    def op_TUPLE3(self, arg) -> None:
        c, b, a = self.pop(), self.pop(), self.pop()
        self.stack.append(self.made("tuple", [a, b, c]))

    def op_LIST(self, arg) -> None:
        self.stack.append(self.made("list", self.pop_mark()))

    def op_DICT(self, arg) -> None:
        items = self.pop_mark()
        for key in items[0::2]:
            self.key(key)
        self.stack.append(self.made("dict", items))

    def op_FROZENSET(self, arg) -> None:
        items = self.pop_mark()
        for key in items:
            self.key(key)
        self.stack.append(self.made("frozenset", items))

    def top(self) -> _Item:
        if not self.stack or (self.marks and len(self.stack) <= self.marks[-1]):
            raise _Refused("the pickle changes a value that is not on its stack")
        return self.stack[-1]

    def op_APPEND(self, arg) -> None:
        item = self.pop()
        self.grow(self.top(), [item])

    def op_APPENDS(self, arg) -> None:
        items = self.pop_mark()
        self.grow(self.top(), items)

    def op_SETITEM(self, arg) -> None:
        value, key = self.pop(), self.pop()
        self.grow(self.top(), [key, value], keys=[key])

    def op_SETITEMS(self, arg) -> None:
        items = self.pop_mark()
        if len(items) % 2:
            raise _Refused("SETITEMS with an odd number of items")
        self.grow(self.top(), items, keys=items[0::2])

    def op_ADDITEMS(self, arg) -> None:
        items = self.pop_mark()
        self.grow(self.top(), items, keys=items)

    def op_POP(self, arg) -> None:
        if self.marks and len(self.stack) == self.marks[-1]:
            self.marks.pop()  # POP of a mark, as pickle allows
        else:
            self.pop()

    def op_POP_MARK(self, arg) -> None:
        self.pop_mark()

    def op_DUP(self, arg) -> None:
        self.stack.append(self.top())

    def op_MARK(self, arg) -> None:
        self.marks.append(len(self.stack))

    # -- the memo: entries are numbered in order, as pickle writes them ---------------------------------
    def put(self, index: int) -> None:
        if not 0 <= index <= len(self.memo):
            raise _Refused(f"memo index {index} with {len(self.memo)} entries stored (the memo grows one at a time)")
        self.memo[index] = self.top()

    def op_PUT(self, arg) -> None:
        self.put(arg)

    op_BINPUT = op_LONG_BINPUT = op_PUT

    def op_MEMOIZE(self, arg) -> None:
        self.put(len(self.memo))

    def op_GET(self, arg) -> None:
        if arg not in self.memo:
            raise _Refused(f"memo index {arg} was never stored")
        self.stack.append(self.memo[arg])

    op_BINGET = op_LONG_BINGET = op_GET

    # -- globals and calls -------------------------------------------------------------------------------
    def global_item(self, module: str, name: str) -> _Item:
        module, name = python3_name(module, name) if self.proto < 3 else (module, name)
        if not self.allowed(module, name):
            why = self.unknown(module, name) if self.unknown else ""
            raise _Refused(f"global {module}.{name} is not allowed (distmerge never runs code from checkpoints)"
                           + (f": {why}" if why else ""))
        return _Item("global", value=(module, name))

    def op_GLOBAL(self, arg) -> None:
        module, _, name = str(arg).partition(" ")
        self.stack.append(self.global_item(module, name))

    def op_STACK_GLOBAL(self, arg) -> None:
        name, module = self.pop(), self.pop()
        if not (module.kind == name.kind == "text" and module.value is not None and name.value is not None):
            raise _Refused("STACK_GLOBAL names a global with something other than two short strings")
        self.stack.append(self.global_item(module.value, name.value))

    def call(self, func: _Item, args: list[_Item]) -> None:
        # getattr(owner, name) results are callable too (ShardedTensor.ProcessGroupState): the unpickler's own
        # stand-in for getattr allows only the lookups it lists
        if not (func.kind == "global" or (func.kind == "object" and func.value == ("builtins", "getattr"))):
            raise _Refused(f"the pickle calls a {func.kind}, not an allowed global")
        if func.value in HASHING_CALLS:  # set([...]) hashes its elements; dicts come empty, filled by SETITEMS
            elements = [p for a in args for p in a.parts or ()]
            if func.value[1] in ("set", "frozenset") and any(e.max_part > self.budget.max_key_nodes for e in elements):
                raise _Refused(f"{'.'.join(func.value)} of elements larger than {self.budget.max_key_nodes} "
                               "objects (limit max_key_nodes)")
            if func.value[1] not in ("set", "frozenset") and elements:
                raise _Refused(f"{'.'.join(func.value)} called with items (pickle writes them with SETITEMS)")
        if func.value == REBUILD_TENSOR and self.storages is not None and args:
            self.tensor_view(args[0])
        self.stack.append(self.made("object", [func, *args], value=func.value if func.kind == "global" else None))

    def op_REDUCE(self, arg) -> None:
        args, func = self.pop(), self.pop()
        self.call(func, [args])

    def op_NEWOBJ(self, arg) -> None:
        args, cls = self.pop(), self.pop()
        self.call(cls, [args])

    def op_NEWOBJ_EX(self, arg) -> None:
        kwargs, args, cls = self.pop(), self.pop(), self.pop()
        self.call(cls, [args, kwargs])

    def op_INST(self, arg) -> None:
        module, _, name = str(arg).partition(" ")
        args = self.pop_mark()
        self.call(self.global_item(module, name), args)

    def op_OBJ(self, arg) -> None:
        items = self.pop_mark()
        if not items:
            raise _Refused("OBJ without a class")
        self.call(items[0], items[1:])

    def op_BUILD(self, arg) -> None:
        state = self.pop()
        self.grow(self.top(), [state])

    def op_BINPERSID(self, arg) -> None:
        pid = self.pop()
        if self.storages is not None:
            self.storage_pid(pid)
        self.stack.append(self.made("object", [pid]))

    def storage_pid(self, pid: _Item) -> None:
        """('storage', storage type, key, location, numel): the record exists and holds numel elements."""
        parts = pid.parts or ()
        if pid.kind != "tuple" or len(parts) < 5 or parts[0].value != "storage" or parts[1].kind != "global":
            raise _Refused("a persistent id that is not a torch storage")
        key, numel = parts[2].value, parts[4].value
        size = self.itemsize(*parts[1].value) if self.itemsize else None
        if not isinstance(key, str) or key not in self.storages or not isinstance(numel, int) or size is None:
            raise _Refused(f"a storage persistent id names no record of this file ({key!r})")
        if numel < 0 or numel * size > self.storages[key]:
            raise _Refused(f"storage {key} declares {numel} elements of {size} bytes but its record holds "
                           f"{self.storages[key]} bytes (limit: storages fit their record)")

    def tensor_view(self, args: _Item) -> None:
        """_rebuild_tensor_v2(storage, offset, size, stride, ...): the view stays inside the storage's record."""
        parts = args.parts or ()
        storage, sizes, strides = (parts[0], parts[2].parts, parts[3].parts) if len(parts) >= 4 else (None, None, None)
        pid = storage.parts[0] if storage is not None and storage.kind == "object" and storage.parts else None
        numbers = [parts[1].value, *(p.value for p in sizes or ()), *(p.value for p in strides or ())] if pid else []
        if (pid is None or pid.kind != "tuple" or sizes is None or strides is None or len(sizes) != len(strides)
                or not all(type(n) is int and n >= 0 for n in numbers)):
            raise _Refused("a tensor whose storage, offset, sizes or strides are not plain non-negative numbers")
        offset, dims = numbers[0], len(sizes)
        sizes, strides = numbers[1 : 1 + dims], numbers[1 + dims :]
        extent = 0 if 0 in sizes else 1 + sum((n - 1) * st for n, st in zip(sizes, strides, strict=True))
        key, size = pid.parts[2].value, self.itemsize(*pid.parts[1].value)
        if (offset + extent) * size > self.storages[key]:
            raise _Refused(f"a tensor view reaches byte {(offset + extent) * size} of storage {key}, which holds "
                           f"{self.storages[key]} bytes (limit: views stay inside their record)")

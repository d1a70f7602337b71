"""A pickle reader that runs nothing from the file: every global the pickle names is looked up in an
allow-list of inert stand-ins (or plain, side-effect-free constructors); anything else is refused.

Tensors inside a torch.save pickle become `TensorRef`s: where their bytes are (storage record key,
element offset), their shape and strides. No storage is read and no tensor is built. `loads` first checks the
opcode stream against a budget (pickle_scan.py), so the unpickler only ever sees a bounded, allowed pickle.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from distmerge.formats.torch_private import pickle_scan


class Record:
    """Stand-in for a pickled object: keeps constructor args and state, runs nothing. NEWOBJ (cls.__new__ with
    the args, no __init__) and REDUCE (cls(*args)) both keep the args."""

    pickled_as = ""  # "module.name" of the global a named record stands for (record_class)
    tensor_subclass = False  # _rebuild_from_type_v2 may rebuild it (a DTensor, a ShardedTensor)

    def __new__(cls, *args: Any) -> Record:
        obj = super().__new__(cls)
        obj._args = args
        return obj

    def __init__(self, *args: Any) -> None:
        self._args = args

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2 and isinstance(state[1], dict):
            state = {**(state[0] or {}), **state[1]}  # (dict, slots) as pickle's BUILD gives it
        if isinstance(state, dict):
            self.__dict__.update(state)
        else:
            self._state = state


class OrderedDictStandIn(dict):
    """collections.OrderedDict with instance attributes (a state_dict's `_metadata`), which BUILD sets."""

    def __setstate__(self, state: Any) -> None:
        self.attributes = state


def as_text(*args: Any) -> str:
    """torch.device / pathlib paths as text. Only scalars: str() of shared tuples grows exponentially."""
    if not all(isinstance(a, (str, int)) and not isinstance(a, bool) for a in args):
        raise pickle.UnpicklingError("a device or path built from something other than strings and ints")
    return "/".join(map(str, args))


# torch's dtypes by the name a pickle gives them (GLOBAL 'torch float32'), read from torch's namespace
# without getattr: torch's module __getattr__ imports deprecated attributes (torch._inductor and more).
DTYPES: dict[str, torch.dtype] = {name: v for name, v in vars(torch).items() if isinstance(v, torch.dtype)}


# torch.save names a storage by its legacy typed class (GLOBAL 'torch FloatStorage').
STORAGE_DTYPES = {
    "DoubleStorage": torch.float64, "FloatStorage": torch.float32, "HalfStorage": torch.float16,
    "BFloat16Storage": torch.bfloat16, "LongStorage": torch.int64, "IntStorage": torch.int32,
    "ShortStorage": torch.int16, "CharStorage": torch.int8, "ByteStorage": torch.uint8, "BoolStorage": torch.bool,
}


@dataclass(frozen=True)
class StorageType:
    dtype: torch.dtype


@dataclass(frozen=True)
class StorageRef:
    key: str
    dtype: torch.dtype


@dataclass(frozen=True)
class TensorRef:
    storage: StorageRef
    storage_offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]

    @property
    def contiguous(self) -> bool:
        return self.stride == contiguous_strides(self.size)

    def bytes_needed(self, itemsize: int) -> int:
        """Bytes of its storage record the view reaches (offset to the farthest element, inclusive)."""
        if any(n == 0 for n in self.size):
            return self.storage_offset * itemsize
        extent = 1 + sum((n - 1) * s for n, s in zip(self.size, self.stride, strict=True))
        return (self.storage_offset + extent) * itemsize

    def check_shape(self) -> bool:
        """Sizes, strides and offset are non-negative ints of the same rank (a hostile pickle can say -1)."""
        numbers = (self.storage_offset, *self.size, *self.stride)
        return (len(self.size) == len(self.stride) and all(isinstance(n, int) for n in numbers)
                and all(n >= 0 for n in numbers))


def rebuild_tensor(storage, storage_offset, size, stride, *_ignored) -> TensorRef:
    return TensorRef(storage, storage_offset, tuple(size), tuple(stride))


def rebuild_parameter(data, *_ignored) -> Any:
    return data  # a saved nn.Parameter: only its tensor matters


class _TensorClass:
    """torch.Tensor as a pickle names it (plain tensors rebuilt through _rebuild_from_type_v2)."""


_RECORD_CLASSES: dict[tuple[str, str], type[Record]] = {}


def record_class(module: str, name: str, *, tensor_subclass: bool = False) -> type[Record]:
    """A Record subclass that remembers which global it stands for (one per name): readers of the records
    tell a `Shard` placement from a `Replicate` one by `pickled_as`, never by rebuilding torch's class."""
    key = (module, name)
    if key not in _RECORD_CLASSES:
        attrs = {"pickled_as": f"{module}.{name}", "tensor_subclass": tensor_subclass}
        _RECORD_CLASSES[key] = type(f"Record[{name}]", (Record,), attrs)
    return _RECORD_CLASSES[key]


@dataclass(frozen=True)
class SubclassTensor:
    """A tensor subclass's pickle, inert: `wrapper` is what `func` returned for it (for torch's wrapper
    subclasses, `WrapperArgs`), `state` its pickled state (DTensor: a dict, ShardedTensor: a tuple)."""

    kind: type[Record]
    wrapper: Any
    state: Any


@dataclass(frozen=True)
class WrapperArgs:
    """torch._utils._rebuild_wrapper_subclass(cls, dtype, size, stride, storage_offset, layout, device,
    requires_grad), the same eight arguments from torch 2.0 to 2.15, kept as given."""

    args: tuple

    @property
    def size(self) -> tuple[int, ...]:
        return tuple(self.args[2])


def rebuild_wrapper_subclass(*args: Any) -> WrapperArgs:
    return WrapperArgs(args)


def rebuild_from_type(func, new_type, args, state) -> Any:
    """torch._tensor._rebuild_from_type_v2: rebuild with `func` (itself from this allow-list), then set the
    subclass. Plain torch.Tensor, or a record class the caller's allow-list marks as a tensor subclass (kept
    inert as a SubclassTensor); any other subclass would run its own code."""
    if isinstance(new_type, type) and issubclass(new_type, Record) and new_type.tensor_subclass:
        return SubclassTensor(new_type, func(*args), state)
    if new_type is not _TensorClass:
        raise pickle.UnpicklingError("a tensor subclass is not allowed")
    return func(*args)


def contiguous_strides(size: tuple[int, ...]) -> tuple[int, ...]:
    strides, acc = [], 1
    for n in reversed(size):
        strides.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(strides))


# What a torch.save of tensors (and of dicts of them) needs.
TENSOR_GLOBALS: dict[tuple[str, str], Any] = {
    ("torch", "Size"): torch.Size,
    ("torch", "device"): as_text,
    ("torch._utils", "_rebuild_tensor_v2"): rebuild_tensor,
    ("torch._utils", "_rebuild_parameter"): rebuild_parameter,
    ("torch._tensor", "_rebuild_from_type_v2"): rebuild_from_type,
    ("torch", "Tensor"): _TensorClass,
    ("collections", "OrderedDict"): OrderedDictStandIn,
}


class Restricted(pickle.Unpickler):
    """`allowed` maps (module, name) to what the pickle gets instead; `inert_modules` lists module prefixes
    whose every global becomes a `Record` (training metadata such as argparse args or enums)."""

    def __init__(self, data: bytes, allowed: dict[tuple[str, str], Any], inert_modules: tuple[str, ...] = ()):
        super().__init__(io.BytesIO(data))
        self.allowed = allowed
        self.inert_modules = inert_modules

    def find_class(self, module: str, name: str) -> Any:
        # Python 2 names as pickle's fix_imports maps them (protocol 2: `__builtin__ getattr`); an override of
        # find_class gets them raw. pickle_scan already refused such names in protocol 3+ streams.
        module, name = pickle_scan.python3_name(module, name)
        if (module, name) in self.allowed:
            return self.allowed[(module, name)]
        if module == "torch" and name in DTYPES:
            return DTYPES[name]
        if module == "torch" and name in STORAGE_DTYPES:
            return StorageType(STORAGE_DTYPES[name])  # a legacy typed-storage class: only its dtype matters
        if is_inert(module, self.inert_modules):
            return Record
        raise pickle.UnpicklingError(f"global {module}.{name} is not allowed")

    def persistent_load(self, pid: Any) -> StorageRef:
        if not (isinstance(pid, tuple) and len(pid) >= 3 and pid[0] == "storage"):
            raise pickle.UnpicklingError("unexpected persistent id")
        dtype = pid[1] if isinstance(pid[1], torch.dtype) else getattr(pid[1], "dtype", None)
        if not isinstance(pid[2], str) or not isinstance(dtype, torch.dtype):
            raise pickle.UnpicklingError("a storage persistent id without a record key and a dtype")
        return StorageRef(pid[2], dtype)


def is_inert(module: str, inert_modules: tuple[str, ...]) -> bool:
    return any(module == m or module.startswith(m + ".") for m in inert_modules)


def itemsize_of(module: str, name: str) -> int | None:
    """Element size of the storage class or dtype a persistent id names; None for anything else."""
    dtype = STORAGE_DTYPES.get(name, DTYPES.get(name)) if module == "torch" else None
    return dtype.itemsize if dtype is not None else None


def loads(data: bytes, allowed: dict[tuple[str, str], Any], inert_modules: tuple[str, ...] = (), *,
          where: str = "pickle", storages: dict[str, int] | None = None,
          budget: pickle_scan.Budget = pickle_scan.DEFAULT, unknown: Callable[[str, str], str] | None = None) -> Any:
    """Checks the opcode stream against `budget` (pickle_scan), then unpickles with the allow-list.
    `storages` (record key -> bytes), when known, bounds what each storage's persistent id may declare;
    `unknown` explains a refused global (pickle_scan.check)."""
    names = set(allowed)

    def permitted(module: str, name: str) -> bool:
        return ((module, name) in names or (module == "torch" and (name in DTYPES or name in STORAGE_DTYPES))
                or is_inert(module, inert_modules))

    pickle_scan.check(data, where, permitted, budget=budget, storages=storages, itemsize=itemsize_of, unknown=unknown)
    return Restricted(data, allowed, inert_modules).load()

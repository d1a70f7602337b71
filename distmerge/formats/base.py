"""The contract of an input format: the files of a checkpoint and the fragments inside them.

Call order (distmerge/engine/run.py drives it; see docs/extending.md):

    rank 0       fmt.detect(source)            is this my layout? (cheap: names, small marker files)
    rank 0       fmt.scan(source, options)     -> Scan: the files, the config folder, the hints for the
                                               model family, and the format's own state for open()
                                               (the Scan is broadcast to every rank)
    every rank   fmt.open(source, scan, file)  -> OpenedFile: the fragments of one file it was assigned
    the engine   reads each fragment's bytes at `byte_offset` (or from the view open() kept)

`source` is the input (input/source.py): a format looks at `source.root` and lists, tests, sizes and opens
files only through the source's methods (`listdir`, `is_file`, `stat`, `read_json`, `open` ...), so a layout read
from a folder is read the same from a bucket; paths are names within the source. A save inside the folder given
is looked at through `source.at(folder)`.

A format module defines its class; registry.py lists every format (FORMATS), the one place that says which exist.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from distmerge import dtypes
from distmerge.errors import InputError
from distmerge.input.source import Source


@dataclass(frozen=True, kw_only=True)
class InputFile:
    """One file of the checkpoint; `rank` is the training rank that wrote it (-1 when not per-rank)."""

    index: int
    path: str  # relative to the input folder
    size: int
    rank: int = -1
    mtime_ns: int = 0  # with size, tells --resume whether the input changed since the interrupted run
    reads: int = -1  # the bytes a merge is expected to read from it, when the format knows it is not all of them

    @property
    def read_weight(self) -> int:
        """What reading this file costs, for spreading files over readers (the whole file unless told)."""
        return self.size if self.reads < 0 else self.reads
    root: str = ""  # "": in the input folder; else a second input root it lies in (--base-model DIR)


# Tensors of a second input root (the --base-model folder) carry this prefix, so their names never meet the
# checkpoint's: the engine keeps them out of the family's claim and hands them over as FamilyContext.base_weights.
BASE_MODEL_PREFIX = "base-model:"
# The other inputs of an average (merge --input A --input B --average): the tensors of the input given n-th (n >= 2)
# carry this prefix with n, `input-2:model.norm.weight`; the first input's keep their own names (engine/inputs.py).
INPUT_PREFIX = "input-{}:"


def input_prefix(index: int) -> str:
    """The prefix of the tensor names of input `index` (0-based: the first input's are "") in an average."""
    return INPUT_PREFIX.format(index + 1) if index else ""


def input_file(src: Source, root: Path, index: int, path: str, rank: int = -1) -> InputFile:
    st = src.stat(inside(src, root, path))
    return InputFile(index=index, path=path, size=st.size, rank=rank, mtime_ns=st.mtime_ns)


def inside(src: Source, root: Path, path: str) -> Path:
    """root/path, refusing names (from a listing or from metadata) and links that lead out of the input.
    Judged by the input's walk (Source.resolve, input/tree.py), made at discovery: never by a subfolder's own
    resolution, so a linked save folder cannot move the anchor."""
    found, why = src.resolve(Path(root) / path)
    if why:
        raise InputError(f"{root}: {path} leads outside the input folder or is not a plain file ({why}); "
                         "distmerge does not follow it")
    return found


def config_dir(src: Source, folders: Iterable[Path], names: tuple[str, ...] = ("huggingface",)) -> str | None:
    """The config folder a format finds near its save (Scan.hf_dir): the first folder/name, folder by folder and
    name by name in the order given, that holds a config.json ("" names the folder itself). Asked of the input's
    source: beside the input folder on disk as beside the prefix in a bucket."""
    folders = list(folders)
    return src.config_dir(folders, names) if folders else None


@dataclass(frozen=True, kw_only=True)
class Hints:
    """What a format tells the model families about its tensors, beyond names and shapes."""

    naming: str = "hf"  # whose parameter names the tensors carry: "hf", "megatron", ...
    fc1_shards: int = 1  # SwiGLU fc1 stored as this many [gate_i; up_i] blocks (Megatron legacy: TP)
    expert_fc1_shards: int = 1  # the same for MoE experts (Megatron legacy: expert TP)
    lora_meta: Mapping[str, Any] | None = None  # the trainer's LoRA settings (verl: lora_train_meta.json)


@dataclass(frozen=True, kw_only=True)
class Scan:
    """What rank 0 found in the input folder, broadcast to every rank before any file is opened."""

    format: str
    root: str
    files: tuple[InputFile, ...]
    hf_dir: str | None  # folder with config.json / tokenizer to copy, or None
    world_size: int  # training world size the checkpoint was saved with
    not_model_files: tuple[str, ...] = ()  # files of hf_dir that belong to the trainer, not the model
    notes: tuple[str, ...] = ()
    hints: Hints = field(default_factory=Hints)
    state: Any = None  # the format's own scan -> open() state (picklable); nothing else reads it
    walked: Any = None  # local.Walked: the walk's record of `files`, each rank opens them by (discover sets it)
    base_walked: Any = None  # the same for a --base-model folder the nodes joined (engine/nodes.py); else None
    # An average's other inputs, each read by its own format and source (engine/inputs.py): their files follow
    # this scan's own in `files`, their tensors' names carry input_prefix(i)
    parts: tuple[Part, ...] = ()


@dataclass(frozen=True, kw_only=True)
class Part:
    """Input `index` (0-based, >= 1) of an average: its own scan (format, root, state, walk record, hints), and
    where its files begin in the combined scan's `files` (each there with `root` = its input's root, `index` shifted
    by `first`)."""

    index: int
    scan: Scan
    first: int

    def holds(self, file_index: int) -> bool:
        return self.first <= file_index < self.first + len(self.scan.files)


_set = object.__setattr__  # a frozen dataclass's fields, set once (Fragment.make, the cached sizes)


@dataclass(frozen=True, kw_only=True, slots=True)
class Fragment:
    """A piece of one global tensor held in one input file (the unit of reading and of transfer).

    Two kinds, one contract:
        block (flat=False): offsets/lengths per dimension, a box of the global tensor
                            (FSDP Shard(d), DCP chunks, Megatron TP slices)
        flat  (flat=True):  offsets == (start,), lengths == (count,): elements start..start+count of
                            the tensor flattened in row-major order, which may begin mid-row
                            (a ZeRO partition)
    The engine uses only the methods below, never the kind.
    """

    name: str
    dtype: str  # safetensors code
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    lengths: tuple[int, ...]
    file_index: int
    byte_offset: int  # first byte in the file; -1: only readable through the view its reader keeps
    key: str  # the entry's key in its file, for the view fallback and for messages
    flat: bool = False
    # numel and nbytes are read several times per fragment by the plan, the exchange and the assembly, for up to
    # millions of fragments: computed once when the fragment is made, plain slots (not properties) after that;
    # flat_start is computed on first use. None of them is part of the fragment's value (its equality, hash,
    # repr and packed form). Slots: a 1024-rank save's 1.16M fragments are on every rank.
    numel: int = field(default=0, init=False, repr=False, compare=False)
    nbytes: int = field(default=0, init=False, repr=False, compare=False)
    _flat: int | None = field(default=None, init=False, repr=False, compare=False)  # -1: not one run

    def __post_init__(self) -> None:
        numel = math.prod(self.lengths)
        _set(self, "numel", numel)
        _set(self, "nbytes", numel * dtypes.itemsize(self.dtype))

    @classmethod
    def make(cls, name: str, dtype: str, global_shape: tuple[int, ...], offsets: tuple[int, ...],
             lengths: tuple[int, ...], file_index: int, byte_offset: int, key: str, flat: bool = False) -> Fragment:
        """Fragment(...) with the same fields, positional, without the frozen dataclass's __init__ (nine
        object.__setattr__ calls): 0.4 us instead of 3, for the million fragments of a 1024-rank save that every
        rank unpacks (inventory.py) and the formats open."""
        obj = object.__new__(cls)
        _set(obj, "name", name)
        _set(obj, "dtype", dtype)
        _set(obj, "global_shape", global_shape)
        _set(obj, "offsets", offsets)
        _set(obj, "lengths", lengths)
        _set(obj, "file_index", file_index)
        _set(obj, "byte_offset", byte_offset)
        _set(obj, "key", key)
        _set(obj, "flat", flat)
        numel = math.prod(lengths)
        _set(obj, "numel", numel)
        _set(obj, "nbytes", numel * dtypes.itemsize(dtype))
        _set(obj, "_flat", None)
        return obj

    @property
    def region(self) -> tuple:
        """Where in the tensor, as a key: equal regions are replicas of one another."""
        return (self.flat, self.offsets, self.lengths)

    def inside_tensor(self) -> bool:
        if self.flat:
            (start,), (count,) = self.offsets, self.lengths
            return start >= 0 and count >= 0 and start + count <= math.prod(self.global_shape)
        return all(o >= 0 and n >= 0 and o + n <= s for o, n, s in
                   zip(self.offsets, self.lengths, self.global_shape, strict=True))

    def flat_start(self) -> int | None:
        """First element in the flattened tensor when the fragment is one contiguous run of it, else None."""
        start = self._flat
        if start is None:
            start = self._flat_start()
            _set(self, "_flat", -1 if start is None else start)
        return None if start == -1 else start

    def _flat_start(self) -> int | None:
        if self.flat:
            return self.offsets[0]
        shape, lengths = self.global_shape, self.lengths
        lead = 0
        while lead < len(shape) and lengths[lead] == 1:
            lead += 1
        if any(lengths[d] != shape[d] for d in range(lead + 1, len(shape))):
            return None
        start, stride = 0, 1
        for d in reversed(range(len(shape))):
            start += self.offsets[d] * stride
            stride *= shape[d]
        return start

    def view_in(self, tensor: torch.Tensor) -> torch.Tensor:
        """The part of `tensor` (of the global shape) this fragment fills, shaped as `lengths`."""
        if self.flat:
            return tensor.view(-1)[self.offsets[0] : self.offsets[0] + self.lengths[0]]
        return tensor[tuple(slice(o, o + n) for o, n in zip(self.offsets, self.lengths, strict=True))]

    def overlaps(self, other: Fragment) -> bool:
        """Blocks of one tensor that share an element (flat fragments are compared as runs)."""
        if self.flat or other.flat:
            a, b = self.flat_start(), other.flat_start()
            if a is None or b is None:
                raise AssertionError("flat fragments are only compared with contiguous ones")
            return a < b + other.numel and b < a + self.numel
        return all(ao < bo + bn and bo < ao + an for ao, an, bo, bn in
                   zip(self.offsets, self.lengths, other.offsets, other.lengths, strict=True))


@dataclass
class OpenedFile:
    """A file opened by its reading rank: its fragments, plus views kept only for the fallback path."""

    fragments: list[Fragment]
    views: dict[tuple[str, tuple[int, ...]], torch.Tensor] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)
    layout: dict[str, int] = field(default_factory=dict)  # sharding description -> entry count


@dataclass(frozen=True, kw_only=True)
class FormatOption:
    """A command-line option that belongs to some formats (Megatron's --iteration). Formats that share
    one declare the same object; merge and inspect both get it."""

    flag: str  # "--iteration"
    dest: str  # key in the options handed to scan()
    help: str
    metavar: str = "VALUE"
    parse: Callable[[str], Any] = str  # raises argparse.ArgumentTypeError on a bad value
    picks_save: bool = False  # names one save of several in a folder (Megatron's iteration): `watch` finds saves itself


class InputFormat(Protocol):
    name: str  # the --format choice
    order: int  # detection order: lower is asked first (a more specific layout before a general one)
    help: str  # a few words for --help: what writes this layout
    options: tuple[FormatOption, ...]

    def detect(self, source: Source) -> bool: ...

    def scan(self, source: Source, options: Mapping[str, Any]) -> Scan: ...

    def open(self, source: Source, scan: Scan, file: InputFile) -> OpenedFile: ...

    def explain(self, source: Source) -> str | None:
        """When no format detects the input: a message that says what to pass instead, if this format can tell."""
        ...




class FormatDefaults:
    """Mix-in with the optional parts of InputFormat."""

    options: tuple[FormatOption, ...] = ()

    def explain(self, source: Source) -> str | None:
        return None

"""torch.save files read without torch.load: the pickle through the restricted reader, and the byte
offset of every storage record from the zip directory.

    file.pt (zip, stored)   <name>/data.pkl       the pickled object; tensors name their storage record
                            <name>/data/<key>     each storage's raw bytes, 64-byte aligned
                            <name>/byteorder, .format_version, ...

Megatron-LM's legacy model_optim_rng.pt pickles `args` (an argparse.Namespace holding megatron enums),
numpy RNG state and the model's tensors: globals of the modules in `TRAINING_MODULES` become inert
records, tensors become references, and nothing from the file runs.
"""

from __future__ import annotations

import os
import pickle
import struct
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from distmerge.errors import CorruptInputError
from distmerge.formats.torch_private.restricted import TENSOR_GLOBALS, loads

# Training metadata a trainer pickles beside its tensors; read as inert records, never as live objects.
TRAINING_MODULES = ("argparse", "numpy", "megatron", "transformer_engine", "enum", "_io", "io", "types", "apex")


def _latin1_bytes(text: str, encoding: str = "latin1") -> bytes:
    """Protocol-2 pickles spell bytes as _codecs.encode(text, 'latin1'); nothing else is accepted."""
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise pickle.UnpicklingError("_codecs.encode is allowed only to rebuild bytes")
    return text.encode("latin1")


SAFE_GLOBALS = {("builtins", "set"): set, ("builtins", "frozenset"): frozenset, ("builtins", "slice"): slice,
                ("_codecs", "encode"): _latin1_bytes}
ZIP_LOCAL_HEADER = 30


@dataclass(frozen=True, kw_only=True)
class SavedObject:
    value: Any  # the unpickled object, tensors as restricted.TensorRef
    storage_offsets: dict[str, int]  # storage key -> file offset of its first byte


def read(path: Path, inert_modules: tuple[str, ...] = TRAINING_MODULES) -> SavedObject:
    """`inert_modules`: the trainer's own modules whose pickled objects become inert records."""
    try:
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
            pkl = next((n for n in names if n.endswith("/data.pkl") or n == "data.pkl"), None)
            if pkl is None:
                raise CorruptInputError(f"{path} is not a torch.save file (no data.pkl inside)")
            value = loads(archive.read(pkl), {**TENSOR_GLOBALS, **SAFE_GLOBALS}, inert_modules)
            prefix = pkl[: -len("data.pkl")] + "data/"
            records = [i for i in archive.infolist() if i.filename.startswith(prefix)]
            offsets = _record_offsets(path, records)
            return SavedObject(value=value, storage_offsets={i.filename[len(prefix) :]: offsets[i.filename]
                                                              for i in records})
    except zipfile.BadZipFile:
        raise CorruptInputError(f"{path} is not a torch.save file (not a zip archive: truncated, not a checkpoint, "
                                "or saved in torch's pre-1.6 format, which distmerge does not read)") from None
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError) as err:
        raise CorruptInputError(f"{path} cannot be read safely ({err}); distmerge loads no code from "
                                "checkpoints") from None


def _record_offsets(path: Path, records: list[zipfile.ZipInfo]) -> dict[str, int]:
    """The first data byte of each stored record: its local header's position plus the header's length."""
    out = {}
    fd = os.open(path, os.O_RDONLY)
    try:
        for info in records:
            if info.compress_type != zipfile.ZIP_STORED:
                raise CorruptInputError(f"{path}: record {info.filename} is compressed; torch.save never does that")
            header = os.pread(fd, ZIP_LOCAL_HEADER, info.header_offset)
            if len(header) < ZIP_LOCAL_HEADER or header[:4] != b"PK\x03\x04":
                raise CorruptInputError(f"{path}: record {info.filename} has no local header: the file is damaged")
            name_len, extra_len = struct.unpack("<HH", header[26:30])
            out[info.filename] = info.header_offset + ZIP_LOCAL_HEADER + name_len + extra_len
    finally:
        os.close(fd)
    return out

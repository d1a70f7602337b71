"""Where the merged model goes: the output store (store.py: the protocol and its call order), the local store
(local.py) and the object store (s3.py), the names written (names.py), and the safetensors file writer
(writer.py). The engine is handed a store by `open_store` and never asks where the output lives."""

from __future__ import annotations

import os
from pathlib import Path

from distmerge.output.store import Store


def is_url(location: str | os.PathLike) -> bool:
    """An object-store location (`s3://bucket/prefix`), as the user typed it."""
    return isinstance(location, str) and "://" in location


def open_store(location: str | os.PathLike) -> Store:
    """The store for `--output`: `s3://bucket/prefix` is an S3-compatible object store (the `s3` extra, imported
    only then), anything else a folder. Another scheme is refused, never taken for a folder named `x:`."""
    if is_url(location):
        from distmerge.output.s3 import ObjectStore

        return ObjectStore(str(location))
    from distmerge.output.local import LocalStore

    return LocalStore(Path(location))

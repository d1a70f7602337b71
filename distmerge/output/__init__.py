"""Where the merged model goes: the output store (store.py: the protocol and its call order), the local store
(local.py) and the object store (s3.py), the names written (names.py), and the safetensors file writer
(writer.py). The engine is handed a store by `open_store` and never asks where the output lives."""

from __future__ import annotations

import json
import os
from pathlib import Path

from distmerge.errors import OutputError
from distmerge.output.store import Store, missing_members, store_members


def is_url(location: str | os.PathLike) -> bool:
    """An object-store location (`s3://bucket/prefix`), as the user typed it."""
    return isinstance(location, str) and "://" in location


def is_store(value: object) -> bool:
    """Tell a Store object given as the output (the API's `output=`: storage plugged in from outside) from a name:
    an object with any member of a Store. Whether it has them all is incomplete_store's question."""
    return not isinstance(value, (str, os.PathLike)) and len(missing_members(value)) < len(store_members())


def incomplete_store(value: object) -> str | None:
    """Say, in one line, which members of which roles a Store object lacks; None when it has them all. Checked
    when the object is handed in, so that a plug-in missing a method is refused before anything starts."""
    missing = missing_members(value)
    if not missing:
        return None
    return (f"{type(value).__name__} is not a whole Store: it lacks {', '.join(missing)} (every method of every "
            "role of distmerge/output/store.py: PlaceChecks, Locking, Writing, ResumeReads)")


def beneath(location: str | os.PathLike, name: str) -> Path | str:
    """Return the output `name` (a relative path, '/' between its parts) inside the output `location`: a folder's
    Path, or an object-store URL kept as typed (a Path would fold s3://b/p into s3:/b/p)."""
    return f"{str(location).rstrip('/')}/{name}" if isinstance(location, str) else Path(location) / name


def read_json(store: Store, name: str) -> dict | None:
    """Return the JSON object stored as `name`, or None when it is absent, unreadable or not an object (a record
    another version wrote, or a half-written one: the caller treats it as missing)."""
    try:
        data = json.loads(store.read(name) or b"")
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def store_name(location: object) -> str:
    """An output as messages and records name it: a Store by its url."""
    return str(location.url) if is_store(location) else str(location)  # type: ignore[attr-defined]


def open_store(location: str | os.PathLike | Store) -> Store:
    """The store for `--output`: a Store object as it is (each process passes its own); `s3://bucket/prefix` is an
    S3-compatible object store (the `s3` extra, imported only then), anything else a folder. Another scheme is
    refused, never taken for a folder named `x:`."""
    if is_store(location):
        if (lacking := incomplete_store(location)) is not None:
            raise OutputError(lacking)
        return location  # type: ignore[return-value]
    if is_url(location):
        from distmerge.output.s3 import ObjectStore

        return ObjectStore(str(location))
    from distmerge.output.local import LocalStore

    return LocalStore(Path(location))

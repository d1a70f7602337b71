"""Rank files that are copies of one another, told from their bytes (docs/reliability.md, "Identity").

Two checks, cheap first:

- `first_copy`: one file under two names (a link), or two files equal in size and in their first and last
  64 KiB. A torch.save zip starts with its pickle and ends with its directory, which holds every record's
  CRC and the folder name the file was saved under: files of one save always differ there.
- `payload_twin`: the tensor bytes (the storage records of the zip, whatever the names and the pickle around
  them say). A copy whose labels were all rewritten to fit its new name (archive folder, recorded rank)
  still carries the other rank's tensors byte for byte. Each file is fingerprinted by its record sizes and
  SAMPLES blocks at fixed fractions of its payload; files whose fingerprints agree are then compared in
  full, so only payloads equal to the last byte are refused. Blocks alone would not do: constant tensors
  (norm weights, zero padding, Adam moments before the first step) are equal slices on every rank.
  Use it only where the format's files hold distinct partitions (DeepSpeed ZeRO optimizer files); never
  where ranks may hold replicas (FSDP's HSDP replica groups, Megatron's EP ranks' dense tensors).
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path
from typing import Any

from distmerge.formats.torch_private import zip_records
from distmerge.input.source import Source

HASHED = 64 * 1024  # bytes hashed at each end of a file to tell copies apart
SAMPLES, BLOCK = 16, 4096  # payload blocks fingerprinted per file
COMPARED = 1 << 20  # bytes compared at a time when two fingerprints agree


def first_copy(src: Source, paths: list[Path]) -> tuple[Path, Path] | None:
    """Two files of a save (of the input `src`) that are one file (a link to the other) or copies of each other:
    the same size and the same first and last 64 KiB, or None."""
    seen: dict[tuple, Path] = {}
    by_size: dict[int, list[Path]] = {}
    for path in paths:
        with src.open(path) as f:
            if f.ident in seen:
                return seen[f.ident], path
            seen[f.ident] = path
            by_size.setdefault(f.size, []).append(path)
    for group in (g for g in by_size.values() if len(g) > 1):
        digests: dict[str, Path] = {}
        for path, digest in zip(group, _ends_digests(src, group), strict=True):
            if digest in digests:
                return digests[digest], path
            digests[digest] = path
    return None


def _ends_digests(src: Source, paths: list[Path]) -> list[str]:
    """Each file's ends digest, as the input's source makes several small reads (an object store's several at once:
    two GETs each, a round trip apiece)."""
    return src.each(functools.partial(_ends_digest, src), paths)


def _ends_digest(src: Source, path: Path) -> str:
    with src.open(path) as f:
        head = f.pread(HASHED, 0)
        tail = f.pread(HASHED, max(0, f.size - HASHED))
    return hashlib.sha256(head + tail).hexdigest()


Spans = list[tuple[int, int]]  # (file offset, size) of each storage record, in file order


def payload_twin(src: Source, paths: list[Path]) -> tuple[Path, Path] | None:
    """Two torch.save files whose storage records hold the same bytes, record for record, or None."""
    by_print: dict[str, list[Path]] = {}
    for path in paths:
        by_print.setdefault(_fingerprint(src, path), []).append(path)
    for group in (g for g in by_print.values() if len(g) > 1):
        for i, first in enumerate(group):
            for other in group[i + 1 :]:  # a real save gets here only for files of constant tensors
                if _same_payload(src, first, other):
                    return first, other
    return None


def _spans(fd: Any, where: str) -> Spans:
    found = zip_records.records(fd, where)
    _, prefix = zip_records.pickle_record(found, where)
    return sorted((r.start, r.size) for n, r in found.items() if n.startswith(prefix) and r.size)


def _fingerprint(src: Source, path: Path) -> str:
    with src.open(path) as f:
        spans = _spans(f, str(path))
        total = sum(size for _, size in spans)
        digest = hashlib.sha256(repr([size for _, size in spans]).encode())
        for i in range(SAMPLES if total else 0):
            at = max(0, total - BLOCK) * i // (SAMPLES - 1)
            for start, size in _pieces(spans, at, min(BLOCK, total)):
                digest.update(f.pread(size, start))
    return digest.hexdigest()


def _pieces(spans: Spans, at: int, length: int) -> list[tuple[int, int]]:
    """File ranges of payload bytes [at, at + length) (the payload: the records one after the other)."""
    out, base = [], 0
    for start, size in spans:
        lo, hi = max(at, base), min(at + length, base + size)
        if lo < hi:
            out.append((start + lo - base, hi - lo))
        base += size
    return out


def _same_payload(src: Source, a: Path, b: Path) -> bool:
    with src.open(a) as fd_a, src.open(b) as fd_b:
        spans_a, spans_b = _spans(fd_a, str(a)), _spans(fd_b, str(b))
        if [s for _, s in spans_a] != [s for _, s in spans_b]:
            return False
        for (start_a, size), (start_b, _) in zip(spans_a, spans_b, strict=True):
            for done in range(0, size, COMPARED):
                n = min(COMPARED, size - done)
                if fd_a.pread(n, start_a + done) != fd_b.pread(n, start_b + done):
                    return False
    return True

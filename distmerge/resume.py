"""Resume: keep the output files an interrupted merge finished, redo only the rest.

Every output file is fsynced under a hidden name and then renamed, so a file under its final name is
whole. Its owner then writes a record `.distmerge/NAME.json` with the plan's fingerprint (input files
with sizes and mtimes, output headers, options). `--resume` keeps a file when its record carries the
current fingerprint, its size and header bytes are the planned ones and, with `--checksum`, its sha256
still matches. The rest is merged again: the result is byte-identical to an uninterrupted run.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict
from pathlib import Path

from distmerge.formats.base import InputFile
from distmerge.output_files import MANIFEST, atomic_write_text, record_path
from distmerge.plan import OutputFile, Plan
from distmerge.writer import header_bytes


def fingerprint(plan: Plan, inputs: tuple[InputFile, ...], options: dict) -> str:
    digest = hashlib.sha256()
    digest.update(json.dumps([asdict(f) for f in inputs], sort_keys=True).encode())
    digest.update(json.dumps(options, sort_keys=True, default=str).encode())
    for f in plan.files:
        digest.update(f.name.encode())
        digest.update(header_bytes(f.targets)[0])
    return digest.hexdigest()


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def record_done(out: Path, file: OutputFile, fp: str, checksum: bool) -> None:
    """Called by the owner right after the file is renamed into place."""
    path = out / file.name
    record = {"fingerprint": fp, "name": file.name, "bytes": path.stat().st_size,
              "tensors": [t.name for t in file.targets]}
    if checksum:
        record["sha256"] = sha256_of(path)
    atomic_write_text(record_path(out, file.name), json.dumps(record, indent=1) + "\n")


def finished_files(out: Path, plan: Plan, fp: str) -> list[int]:
    """Indices of planned files that an earlier run with the same plan completed and left intact."""
    return [i for i, f in enumerate(plan.files) if _intact(out, f, fp)]


def _intact(out: Path, file: OutputFile, fp: str) -> bool:
    path, record_file = out / file.name, record_path(out, file.name)
    if not (path.is_file() and record_file.is_file()):
        return False
    try:
        record = json.loads(record_file.read_text())
    except ValueError:
        return False
    head = header_bytes(file.targets)[0]
    if record.get("fingerprint") != fp or path.stat().st_size != len(head) + file.nbytes:
        return False
    with open(path, "rb") as f:
        if f.read(len(head)) != head:
            return False
    return "sha256" not in record or record["sha256"] == sha256_of(path)


def write_manifest(out: Path, plan: Plan) -> None:
    """Per file: tensors, bytes and (with --checksum) sha256, from the owners' records."""
    files = []
    for f in plan.files:
        record = json.loads(record_path(out, f.name).read_text())
        record.pop("fingerprint", None)
        files.append(record)
    atomic_write_text(out / MANIFEST, json.dumps({"files": files}, indent=1) + "\n")

"""Correctness checks for bench_fsdp.py: tensor-by-tensor equality and byte identity of merged outputs.

Both read lazily (safe_open per tensor, hashing in chunks) so checking a large merge never holds a whole
model in memory next to the other jobs on the machine.
"""

from __future__ import annotations

import hashlib
from contextlib import ExitStack
from pathlib import Path


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def tensor_index(folder: Path) -> dict[str, Path]:
    from safetensors import safe_open

    index: dict[str, Path] = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open handles are not mappings
                index[key] = path
    return index


def tensor_differences(a: Path, b: Path) -> list[str]:
    """Problems found comparing every tensor of folder a with folder b by name; empty when they agree."""
    import torch
    from safetensors import safe_open

    ia, ib = tensor_index(a), tensor_index(b)
    problems = [f"{k}: only in {a}" for k in sorted(ia.keys() - ib.keys())]
    problems += [f"{k}: only in {b}" for k in sorted(ib.keys() - ia.keys())]
    if not ia:
        problems.append(f"{a}: no tensors at all")
    with ExitStack() as stack:
        handles = {p: stack.enter_context(safe_open(str(p), framework="pt")) for p in {*ia.values(), *ib.values()}}
        for key in sorted(ia.keys() & ib.keys()):
            ta, tb = handles[ia[key]].get_tensor(key), handles[ib[key]].get_tensor(key)
            if ta.dtype != tb.dtype or ta.shape != tb.shape:
                problems.append(f"{key}: {ta.dtype}{list(ta.shape)} vs {tb.dtype}{list(tb.shape)}")
            elif not torch.equal(ta, tb):
                problems.append(f"{key}: values differ (max abs diff {(ta.float() - tb.float()).abs().max():.3g})")
    return problems


def byte_differences(a: Path, b: Path) -> list[str]:
    """Files that are missing on one side or differ in content; empty when the folders are byte-identical."""
    fa = {p.name for p in a.iterdir() if p.is_file()}
    fb = {p.name for p in b.iterdir() if p.is_file()}
    problems = [f"{n}: only in {a}" for n in sorted(fa - fb)] + [f"{n}: only in {b}" for n in sorted(fb - fa)]
    problems += [f"{n}: contents differ" for n in sorted(fa & fb) if sha256_of(a / n) != sha256_of(b / n)]
    return problems

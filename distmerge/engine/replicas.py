"""Replicated tensors are read once, from the lowest file's copy: Megatron's norms, router and row-parallel
biases sit on every TP rank, HSDP keeps one copy per replica group. When a replicated block is small, its
other copies are cheap to check: each rank hashes the copies in its own files (one collective carries the
digests) and every rank compares them the same way. Copies that differ mean the run let them drift apart
(a known failure of sequence-parallel setups) or mixes files of several runs: the merge keeps the lowest
file's copy, like Megatron's own converters, and says so in a note. Checked copies are not counted as
bytes read: they are not what the output is made of.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict

import torch

from distmerge.distributed.comm import Comm
from distmerge.engine.plan import Plan
from distmerge.engine.reader import Reader
from distmerge.formats.base import Fragment

SMALL = 1 << 20  # bytes per block: norms and biases, never a weight matrix
SHOWN = 4  # tensors named in the note


def check(plan: Plan, comm: Comm, reader: Reader) -> list[str]:
    """Collective: every rank calls it after the plan; returns the notes (the same on every rank)."""
    digests = comm.gather(lambda: _digests(plan, comm.rank, reader))
    seen: dict[tuple[str, tuple], set[bytes]] = defaultdict(set)
    for found in digests:
        for (name, region, _file), digest in found.items():
            seen[(name, region)].add(digest)
    differ = sorted({name for (name, _), kinds in seen.items() if len(kinds) > 1})
    if not differ:
        return []
    shown = ", ".join(differ[:SHOWN]) + (f" and {len(differ) - SHOWN} more" if len(differ) > SHOWN else "")
    return [f"replicated copies differ for {len(differ)} tensor(s) ({shown}): kept the lowest rank file's copy; "
            "the training run let them drift apart, or files of several runs are mixed"]


def _checked(plan: Plan) -> list[Fragment]:
    """Every copy of each small replicated block: the chosen one and the others."""
    out = []
    for source in plan.sources.values():
        if not source.replicas:
            continue
        regions = {f.region for f in source.replicas}
        out += [f for f in (*source.fragments, *source.replicas) if f.region in regions and f.nbytes <= SMALL]
    return out


def _digests(plan: Plan, rank: int, reader: Reader) -> dict[tuple[str, tuple, int], bytes]:
    out = {}
    for frag in _checked(plan):
        if plan.readers[frag.file_index] != rank:
            continue
        data = torch.empty(frag.nbytes, dtype=torch.uint8)
        reader.read_into(frag, data, count=False)
        digest = hashlib.blake2b(data.numpy().tobytes(), digest_size=16).digest()
        out[(frag.name, frag.region, frag.file_index)] = digest
    return out

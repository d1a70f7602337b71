"""The `.metadata` a simulated dcp.save would write (bench_scale.py `--layout dcp`), and the time and memory to
read it: torch's own `pickle.load` beside distmerge's `read_metadata`, each in a fresh interpreter (issue #27).

bench_scale.py simulates inventories, not bytes; `.metadata` is the one file of a DCP save whose size grows
with W x tensors, so this writes it for real from the simulated chunks: torch's own metadata classes
(Metadata, TensorStorageMetadata, ChunkStorageMetadata, MetadataIndex, _StorageInfo), pickled as torch's
FileSystemWriter.finish pickles them (`pickle.dump`, the default protocol), with each rank's `.distcp` beside it
as a sparse file of the simulated size (read_metadata's byte budget counts them; nothing reads their bytes).
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from bench_dcp_scale import READERS  # noqa: E402  (the same two readers the real-save bench runs)
from torch.distributed.checkpoint import metadata as dcp_md
from torch.distributed.checkpoint.filesystem import _StorageInfo

from distmerge import dtypes

ROOT = Path(__file__).resolve().parents[2]


def fresh(text: str) -> str:
    return text.encode().decode()  # an equal string, another object (pickle memoises by identity)


def metadata_of(files: tuple, per_file: list[list], blob: tuple[int, int]) -> dcp_md.Metadata:
    """torch's Metadata for the simulated save: one chunk per fragment, in its file's order; a chunk's blob is
    `blob` = (bytes before, bytes after) its elements (bench_scale.BLOB_HEAD, BLOB_TAIL)."""
    tensors: dict[str, dcp_md.TensorStorageMetadata] = {}
    storage: dict[dcp_md.MetadataIndex, _StorageInfo] = {}
    for f, frags in zip(files, per_file, strict=True):
        for frag in frags:
            fqn = frag.key
            if fqn not in tensors:
                props = dcp_md.TensorProperties(dtype=dtypes.torch_dtype(frag.dtype))
                tensors[fqn] = dcp_md.TensorStorageMetadata(properties=props, size=torch.Size(frag.global_shape),
                                                            chunks=[])
            chunks = tensors[fqn].chunks
            chunks.append(dcp_md.ChunkStorageMetadata(offsets=torch.Size(frag.offsets), sizes=torch.Size(frag.lengths)))
            # a Size of its own, as in a real save (the planner's WriteItem and the chunk hold two): one object
            # for both would pickle the key's offsets as a memo reference, a file torch never writes
            # and strings of their own: in a real save every write result's fqn and path arrive, unpickled, from
            # their rank, as new objects, so the file spells them out each time instead of referring back
            index = dcp_md.MetadataIndex(fqn=fresh(fqn), offset=torch.Size(frag.offsets), index=len(chunks) - 1)
            storage[index] = _StorageInfo(relative_path=fresh(f.path), offset=frag.byte_offset - blob[0],
                                          length=blob[0] + frag.nbytes + blob[1])
    return dcp_md.Metadata(state_dict_metadata=tensors, storage_data=storage)


def write_save(files: tuple, per_file: list[list], blob: tuple[int, int], where: Path) -> Path:
    with open(where / ".metadata", "wb") as out:
        pickle.dump(metadata_of(files, per_file, blob), out)
    for f in files:
        with open(where / f.path, "wb") as sparse:
            sparse.truncate(f.size)
    return where / ".metadata"


def read_in_fresh_process(reader: str, path: Path) -> dict:
    """{"seconds", "chunks", "rss"}: one reader of READERS in its own interpreter, and its peak RSS: VmHWM, the
    high-water mark of its own address space (rusage's ru_maxrss would start at this big parent's RSS at fork)."""
    code = READERS[reader] + ("hwm = [x for x in open('/proc/self/status') if x.startswith('VmHWM:')][0]\n"
                              "print(json.dumps({'rss': int(hwm.split()[1]) * 1024}))\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, env=env,
                         check=True).stdout.splitlines()
    return {**json.loads(out[-2]), **json.loads(out[-1])}


def line(files: tuple, per_file: list[list], blob: tuple[int, int]) -> str:
    """One report line: the file's size and chunks, and each reader's seconds and peak RSS."""
    with tempfile.TemporaryDirectory(prefix="scale-metadata-") as tmp:
        path = write_save(files, per_file, blob, Path(tmp))
        size = path.stat().st_size
        got = {reader: read_in_fresh_process(reader, path) for reader in READERS}
    chunks = {r: g["chunks"] for r, g in got.items()}
    if len(set(chunks.values())) != 1:
        raise SystemExit(f"the readers disagree on the chunk count: {chunks}")
    cells = ", ".join(f"{r} {g['seconds']:.1f} s / {g['rss'] / 1e9:.2f} GB" for r, g in got.items())
    return f".metadata: {size / 1e6:.1f} MB, {chunks['torch']:,} chunks; read (wall / peak RSS): {cells}"

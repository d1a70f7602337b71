"""Rank 0, once every file is written: the save's `.metadata`, metadata.json and common.pt, then the tracker.

    OUT/latest_checkpointed_iteration.txt   "release": written last, the commit marker (no tracker, no import)
    OUT/release/.metadata                    DCP's index of every blob (formats/torch_private/dcp/write.py)
    OUT/release/metadata.json                megatron-core's record of the backends (dist_checkpointing/core.py)
    OUT/release/common.pt                    Megatron-LM's args and the iteration (megatron_args.py)

A release save, as Megatron-LM names a converted model: read_metadata accepts no iteration 0 ("assert iteration
> 0 or release"), and load_checkpoint starts a release at iteration 0 without optimizer or RNG state.
"""

from __future__ import annotations

import io
import json

import torch

from distmerge.formats.torch_private.dcp import write as dcp
from distmerge.output.store import Store

TRACKER = "latest_checkpointed_iteration.txt"
RELEASE = "release"
BACKENDS = {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
            "common_backend_version": 1}


def finalize(store: Store, entries: list[dcp.Entry], common: dict) -> None:
    store.write_small(f"{RELEASE}/.metadata", dcp.metadata_bytes(entries))
    store.write_small(f"{RELEASE}/metadata.json", json.dumps(BACKENDS).encode())
    buf = io.BytesIO()
    torch.save(common, buf)
    store.write_small(f"{RELEASE}/common.pt", buf.getvalue())
    store.write_small(TRACKER, RELEASE.encode())

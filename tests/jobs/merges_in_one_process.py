"""A script (no group of its own) calling distmerge.merge several times in one process under torchrun
(tests/test_api.py): each call starts and ends distmerge's own group on the job's rendezvous store.

    python -m torch.distributed.run --nproc-per-node N tests/jobs/merges_in_one_process.py CKPT OUT COUNT

Merges CKPT into OUT/0 .. OUT/COUNT-1, one after another; each rank prints one line per merge.
"""

import os
import sys
from pathlib import Path

import distmerge

ckpt, out, count = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
for k in range(count):
    result = distmerge.merge(ckpt, out / str(k))
    rank = os.environ["RANK"]
    print(f"rank {rank}: merge {k}: {result.tensors} tensors with {result.processes} processes", flush=True)

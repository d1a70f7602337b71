"""A training-like job calling distmerge.merge on every rank (tests/test_api.py): the job starts gloo itself, and
the merge must leave its group, GC, default dtype, RNG and environment as it found them."""

import gc
import os
import sys

import torch
import torch.distributed as dist

import distmerge


def main(checkpoint: str, output: str) -> None:
    dist.init_process_group("gloo")
    total = torch.ones(1)
    dist.all_reduce(total)
    gc.freeze()
    before = (gc.isenabled(), gc.get_freeze_count(), torch.get_default_dtype(), torch.get_rng_state().clone(),
              dict(os.environ))
    result = distmerge.merge(checkpoint, output)
    after = (gc.isenabled(), gc.get_freeze_count(), torch.get_default_dtype(), torch.get_rng_state(),
             dict(os.environ))
    assert before[:3] == after[:3], (before[:3], after[:3])
    assert torch.equal(before[3], after[3]), "RNG state changed"
    assert before[4] == after[4], "environment changed"
    assert dist.is_initialized()
    again = torch.ones(1)
    dist.all_reduce(again)  # the job's collectives still work
    assert int(total) == int(again) == dist.get_world_size()
    print(f"rank {dist.get_rank()}: merged {result.tensors} tensors into {len(result.files)} file(s) with "
          f"{result.processes} processes; all_reduce after: {int(again)}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:3])

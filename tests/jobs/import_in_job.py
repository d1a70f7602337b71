"""A training-like job importing a Hugging Face model with distmerge's API on every rank (tests/test_import_api.py):

    python -m torch.distributed.run --nproc-per-node N tests/jobs/import_in_job.py HF_DIR OUT TP PP VPP

The job starts its gloo group and takes a training step. Then, in the job's processes,
distmerge.import_checkpoint(HF_DIR, OUT/first, tp=TP, pp=PP, vpp=VPP) in the job's group, and again into
OUT/second: each call must leave the process as it found it (api_in_job.checked: signal handlers, GC, RNG,
environment, threads, open files, process groups, and from the second call on no distmerge object or tensor left
alive), every rank gets the same result, and the job's group and its training steps work after. Rank 0 prints one
line per rank and exits 0 only when all of that holds.
"""

import gc
import sys

import torch
import torch.distributed as dist
from api_in_job import checked, same_on_every_rank, say_and_exit, train_step  # this folder is sys.path[0]

import distmerge


def figures(result) -> tuple:
    return result.tensors, result.chunks, result.files, result.nbytes, result.processes


def main(hf_dir: str, output: str, tp: str, pp: str, vpp: str) -> None:
    device = torch.device("cpu")
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    first_loss = train_step(model, device)
    gc.freeze()
    problems: list[str] = []
    layout = dict(tp=int(tp), pp=int(pp), vpp=int(vpp))
    first = checked(lambda: figures(distmerge.import_checkpoint(hf_dir, f"{output}/first", **layout)), device,
                    problems, "import", warm=False)
    second = checked(lambda: figures(distmerge.import_checkpoint(hf_dir, f"{output}/second", **layout)), device,
                     problems, "import 2", warm=True)
    if not same_on_every_rank((first, second)) or first != second:
        problems.append(f"the results differ (between ranks, or between the two imports): {first} {second}")
    later_loss = train_step(model, device)  # the job's collectives and training still work
    tensors, chunks, files, _, processes = first
    say_and_exit(f"rank {dist.get_rank()}: imported {tensors} tensors in {chunks} chunks into {files} file(s) with "
                 f"{processes} processes, twice; training step after: loss {first_loss:.4f} -> {later_loss:.4f}; ",
                 problems)


if __name__ == "__main__":
    main(*sys.argv[1:6])

"""A training-like job calling distmerge's API on every rank (tests/test_api.py; on a GPU, launch/gpu_check.sh):

    python -m torch.distributed.run --nproc-per-node N tests/jobs/api_in_job.py CKPT OUT REFERENCE [gloo|nccl]

The job starts its group itself (gloo on the CPU; NCCL on each rank's GPU) and takes a training step. Then, in the
job's processes: distmerge.merge(CKPT, OUT/first); distmerge.verify(OUT/first, REFERENCE); a second merge into
OUT/second with the other layout of groups (gloo: the gloo side group distmerge makes beside an NCCL group, forced by
the test seam DISTMERGE_TEST_SIDE_GROUP and checked to be made; NCCL: device='cpu', the fragments then in the side
group too); distmerge.verify(CKPT, REFERENCE) of the checkpoint merged in memory. Each call must leave the process as
it found it: no signal handler, the GC's state, default dtype, RNG states, environment, cwd, threads, open files,
process groups, torch.cuda untouched on the CPU (current device and allocated memory on a GPU), no distmerge object or
tensor left alive; every rank gets the same results; the job's group and its training steps work after it. Rank 0
prints one line per rank and exits 0 only when all of that holds.
"""

import contextlib
import gc
import os
import random
import signal
import sys
import threading

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

import distmerge
from distmerge.input import tree as input_tree


def state(device: torch.device) -> dict:
    """What the job expects to find unchanged after a call."""
    gc.collect()
    found = {
        "signals": {s: signal.getsignal(s) for s in signal.valid_signals() - {signal.SIGKILL, signal.SIGSTOP}},
        "gc": (gc.isenabled(), gc.get_threshold()),
        "frozen": gc.get_freeze_count(),  # compared apart: frozen objects that die leave the count
        "dtype": torch.get_default_dtype(),
        "rng": (torch.get_rng_state().numpy().tobytes(), random.getstate()),  # bytes: no tensor alive
        "environ": dict(os.environ),
        "cwd": os.getcwd(),
        "threads": threading.active_count(),
        "files": sorted(os.listdir("/proc/self/fd")),
        "groups": len(distributed_c10d._world.pg_map),
        # Every reference to the job's group: one held past the call (a module's default argument, a cache) makes
        # the group outlive destroy_process_group(), and its worker threads abort the process at exit, at random.
        "job_group_references": sys.getrefcount(dist.group.WORLD),
        "torch_threads": torch.get_num_threads(),
        "cuda_initialized": torch.cuda.is_initialized(),
        "distmerge_objects": sum(type(o).__module__.startswith("distmerge.") for o in gc.get_objects()),
        "tensors": sum(isinstance(o, torch.Tensor) for o in gc.get_objects()),
        "input_walks": sum(isinstance(o, input_tree.InputTree) for o in gc.get_objects()),
    }
    if device.type == "cuda":
        found.update(cuda_device=torch.cuda.current_device(), cuda_rng=torch.cuda.get_rng_state().numpy().tobytes(),
                     cuda_allocated=torch.cuda.memory_allocated())
    return found


def changed(before: dict, after: dict) -> list[str]:
    """What differs; the frozen count may only shrink (a frozen object died), never grow (gc.freeze) or drop to 0
    (gc.unfreeze)."""
    differ = [f"{key}: {_shown(value, after[key])}" for key, value in before.items()
              if key != "frozen" and value != after[key]]
    if not 0 < after["frozen"] <= before["frozen"]:
        differ.append(f"frozen: {before['frozen']} -> {after['frozen']}")
    if after["input_walks"]:
        differ.append(f"input walks held: {after['input_walks']}")
    return differ


def _shown(before, after) -> str:
    if isinstance(before, dict):  # the entries that differ (signals, environ)
        keys = sorted({*before, *after} - {k for k in before if k in after and before[k] == after[k]}, key=str)
        before, after = ({k: d.get(k) for k in keys} for d in (before, after))
    return f"{before!r:.200} -> {after!r:.200}"


def train_step(model: torch.nn.Module, device: torch.device) -> float:
    """One step of data-parallel training: forward, backward, the gradients all-reduced in the job's group."""
    x = torch.ones(4, 8, device=device)
    loss = model(x).square().mean()
    loss.backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.1 * p.grad / dist.get_world_size()
            p.grad = None
    return float(loss)


def merged_figures(r) -> tuple:
    return r.tensors, r.files, r.total_bytes, r.processes


def verdict(v) -> tuple:
    return v.passed, [(c.name, c.passed, c.outcome) for c in v.checks], v.processes


def same_on_every_rank(value) -> bool:
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, value)
    return all(v == every[0] for v in every)


# What imports make on the first call (the modules' tables, their tensors): checked from the second call on.
ALLOCATIONS = ("distmerge_objects", "tensors", "cuda_allocated")


def checked(call, device: torch.device, problems: list[str], what: str, *, warm: bool):
    """call() -> its result's figures (plain values: the result itself is not counted as left alive)."""
    before = state(device)
    result = call()
    after = state(device)
    if not warm:
        before = {k: v for k, v in before.items() if k not in ALLOCATIONS}
    problems += [f"{what}: {line}" for line in changed(before, after)]
    return result


@contextlib.contextmanager
def side_groups_counted():
    """The backends of the groups distmerge makes in the block (dist.new_group: its side group), listed."""
    made: list[str] = []
    new_group = dist.new_group

    def counted(*args, **kwargs):
        made.append(kwargs.get("backend"))
        return new_group(*args, **kwargs)

    dist.new_group = counted
    try:
        yield made
    finally:
        dist.new_group = new_group


def main(checkpoint: str, output: str, reference: str, backend: str = "gloo") -> None:
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
        torch.cuda.set_device(device)
    dist.init_process_group(backend)
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8).to(device)
    first_loss = train_step(model, device)
    gc.freeze()
    problems: list[str] = []

    merged = checked(lambda: merged_figures(distmerge.merge(checkpoint, f"{output}/first")), device, problems,
                     "merge", warm=False)
    report = checked(lambda: verdict(distmerge.verify(f"{output}/first", reference)), device, problems, "verify",
                     warm=False)
    if backend == "gloo":  # the second merge: the group layout of an NCCL job, on the CPU (the test seam)
        os.environ["DISTMERGE_TEST_SIDE_GROUP"] = "1"
    second = dict(device="cpu") if backend == "nccl" else {}
    with side_groups_counted() as side_groups:
        again = checked(lambda: merged_figures(distmerge.merge(checkpoint, f"{output}/second", **second)), device,
                        problems, "merge 2", warm=True)
    in_memory = checked(lambda: verdict(distmerge.verify(checkpoint, reference, **second)), device, problems,
                        "verify 2", warm=True)
    os.environ.pop("DISTMERGE_TEST_SIDE_GROUP", None)
    if side_groups != ["gloo"]:  # the seam not applied: merge 2 would check nothing the first did not
        problems.append(f"merge 2: side groups made {side_groups}, not one gloo group")

    if not same_on_every_rank((merged, again, report, in_memory)) or merged != again:
        problems.append("the results differ (between ranks, or between the two merges)")
    if not (report[0] and in_memory[0]):
        problems.append("verify failed")
    if not dist.is_initialized():
        problems.append("the job's group is gone")
    later_loss = train_step(model, device)  # the job's collectives and training still work
    tensors, files, _, processes = merged
    say_and_exit(f"rank {dist.get_rank()}: merged {tensors} tensors into {len(files)} file(s) with {processes} "
                 f"processes, twice; verify passed {len(report[1])} + {len(in_memory[1])}; "
                 f"training step after: loss {first_loss:.4f} -> {later_loss:.4f}; ", problems)


def say_and_exit(line: str, problems: list[str]) -> None:
    """Every rank's line, ended with its problems, printed by rank 0; the job's group ended; exit 1 if a rank found
    any."""
    line += "process unchanged" if not problems else "PROBLEMS: " + "; ".join(problems)
    lines = [None] * dist.get_world_size()
    dist.all_gather_object(lines, line)
    failed = any("PROBLEMS" in str(x) for x in lines)
    if dist.get_rank() == 0:
        print("\n".join(map(str, lines)), flush=True)
    dist.destroy_process_group()
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main(*sys.argv[1:5])

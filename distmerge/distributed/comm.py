"""The process group and the few collectives the phases use. With one process, all are no-ops.

Call order (every rank makes every call, in the same order):
    root_only   rank 0 does the work, the result or its error reaches every rank   (broadcast)
    agree       every rank does its part; any rank's error is raised on all ranks   (all_gather)
    gather      the same, and every rank gets every rank's small result             (all_gather)
    all_to_all  fragment bytes from readers to owners, asynchronous                 (all_to_all_single)
    close       destroy the group, on success and on failure (a borrowed group is left as it was)

Each of the first four is a step: every rank counts them alike, and marks the time it waits in one (a Pulse). A
Comm that starts its own group runs a watchdog that reads them (distributed/watchdog/): it names a rank that makes
another wait --timeout seconds. The engine says which phase it is in with `phase`, and what must be undone before
the watchdog ends the process with `on_abort`.

A Comm either starts its own group (a command, under torchrun: `Comm(...)`) or borrows a running job's
(`Comm.borrow(group)`, the API called inside training): fragments then travel in that group (NCCL: on the job's
current GPU), the small messages in it too when it runs gloo, else in a gloo side group of ours; close() destroys
the side group and drops distmerge's references, never the job's group.
"""

from __future__ import annotations

import os
import pickle
import sys
import traceback
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import torch

from distmerge import errors
from distmerge import testing_seams as seams
from distmerge.distributed import held_defaults
from distmerge.distributed.namespaces import next_namespace
from distmerge.distributed.watchdog.dog import Watchdog
from distmerge.distributed.watchdog.pulse import BACKSTOP_S, Pulse, WatchedWork
from distmerge.errors import DistmergeError, InputError
from distmerge.input import source as input_source

T = TypeVar("T")
KEPT_COLLECTIVES = 16  # object collectives whose tensors Comm holds (_keep): a worker thread lags a few behind


@dataclass(frozen=True, kw_only=True)
class Failure:
    """An error crossing ranks: class name and message, so every rank raises the same thing."""

    rank: int
    kind: str
    message: str
    trace: str


def launched_world() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


class Comm:
    def __init__(self, *, device: str, timeout_s: float, on_silence: Callable[[str, bool], None] | None = None) -> None:
        """A group of our own over the processes torchrun (or srun) started. With several, a watchdog names a rank
        that makes another wait `timeout_s` (distributed/watchdog/); the group's own timeout, timeout_s + BACKSTOP_S,
        is the backstop. `on_silence(line, speak)`: the command's (cli.report_silence); given, the watchdog calls it
        with its verdict and ends the process."""
        self.world = launched_world()
        self.rank = int(os.environ.get("RANK", "0"))
        self.device = torch.device(device)
        self._data = self._control = None
        self._kept: deque[tuple[torch.Tensor, ...]] = deque(maxlen=KEPT_COLLECTIVES)
        self._kept_data: tuple[torch.Tensor, ...] = ()
        self._root = 0  # the global rank of the group's rank 0 (the source of broadcasts)
        self._borrowed = False
        self._side = None  # a borrowing Comm's gloo group beside the job's NCCL one (borrow)
        self._pulse, self._aborts, self._watchdog = Pulse(), [], None
        if self.device.type == "cuda":
            # Before any CUDA work and before NCCL starts: each process's tensors, and its NCCL communicator,
            # live on its own GPU (cuda:0 for every rank otherwise).
            self.device = cuda_device(int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(self.device)
        if self.world > 1:
            self._start_group(timedelta(seconds=timeout_s + BACKSTOP_S))
            self._watchdog = Watchdog.start_for(self._pulse, rank=self.rank, world=self.world, timeout_s=timeout_s,
                                                aborts=self._aborts, on_silence=on_silence)

    @classmethod
    def borrow(cls, group: Any = None, *, device: str = "auto", timeout_s: float = 600.0) -> Comm:
        """A Comm over a group the caller started (None: the default group) and still owns; close() leaves it up.

        Fragments travel in that group on `device` (auto: the job's current GPU when the group runs NCCL, else the
        CPU). The small messages need a group that carries CPU tensors: the job's own when it runs gloo, else a
        gloo side group of ours over the same ranks (`dist.new_group`, made by every process of the job, so the
        group must be all of them), destroyed by close(). The CUDA current device is read, never set."""
        import torch.distributed as dist

        group = group if group is not None else dist.group.WORLD
        backend = str(dist.get_backend(group))
        comm = cls.__new__(cls)
        comm.world, comm.rank = dist.get_world_size(group), dist.get_rank(group)
        comm.device = _borrowed_device(device, backend)
        comm._kept = deque(maxlen=KEPT_COLLECTIVES)
        comm._kept_data = ()
        comm._root = dist.get_global_rank(group, 0) if comm.world > 1 else 0
        comm._borrowed = True
        comm._side = None
        comm._pulse, comm._aborts, comm._watchdog = Pulse(), [], None  # the job's group: no watchdog of ours
        comm._modules_at_borrow = held_defaults.loaded_now()  # what our imports may make hold the job's group
        if "gloo" not in backend or seams.side_group_on_gloo():  # the test seam: a CPU runs it too
            comm._side = _side_group(group, timedelta(seconds=timeout_s))
        cpu_data = comm.device.type == "cpu" and "gloo" not in backend  # NCCL carries only CUDA tensors
        comm._control = comm._side if comm._side is not None else group
        comm._data = comm._side if cpu_data else group
        return comm

    def _start_group(self, timeout: timedelta) -> None:
        import torch.distributed as dist
        import torch.distributed.nn.functional  # noqa: F401  (before the group: see below)

        # torch.distributed.nn.functional's collectives take `group=group.WORLD` as a default argument, evaluated
        # at its first import: imported while our group is up (transformers imports it), ten functions hold the
        # group past close(), and a gloo worker ending at exit aborts the runtime in ~1 merge of 15
        # (docs/reliability.md). Imported first, the defaults are None (looked up per call). 2 ms.
        store, rank, world = _own_store(timeout)
        if self.device.type != "cuda":
            dist.init_process_group("gloo", timeout=timeout, store=store, rank=rank, world_size=world)
            self._control = self._data = dist.group.WORLD
            return
        try:  # device_id: NCCL connects now, so a refusal is reported here, not at the first exchange
            dist.init_process_group("nccl", timeout=timeout, device_id=self.device, store=store, rank=rank,
                                    world_size=world)
            self._control = dist.new_group(backend="gloo", timeout=timeout)  # objects stay on the CPU
        except Exception as err:
            if dist.is_initialized():
                dist.destroy_process_group()
            gpus, here = torch.cuda.device_count(), int(os.environ.get("LOCAL_WORLD_SIZE", self.world))
            hint = (f"{here} processes on {gpus} GPU(s), and NCCL refuses two ranks on one GPU: run at most "
                    f"{gpus} per node" if here > gpus else "NCCL_DEBUG=INFO says more")
            raise _before_group(DistmergeError(f"NCCL could not start on {self.device} ({type(err).__name__}: "
                                               f"{_first_line(err)}): {hint}, or use --device cpu")) from None
        self._data = dist.group.WORLD

    @property
    def control(self) -> Any:
        """The group of the small messages (gloo, CPU): distributed/requests.py's point-to-point ones travel in it."""
        return self._control

    # -- what the engine tells the watchdog ------------------------------------------------------------
    def phase(self, words: str) -> None:
        """What the ranks are doing from here on ("discovery", "round 3 of 12"): a silent rank is named with it."""
        self._pulse.phase = words

    def on_abort(self, callback: Callable[[], Any]) -> Callable[[], None]:
        """Call `callback` (no arguments) if the watchdog ends this process (a silent rank, under a command):
        what an exception's unwinding would otherwise undo, e.g. rank 0 releasing a lock on the output. Runs in
        another thread, while the main thread is blocked in a collective, within watchdog.dog.CLEANUP_WAIT_S.
        Without a watchdog (one process, a borrowed group, the store not a TCPStore) it is never called.
        Returns a function that unregisters it."""
        self._aborts.append(callback)

        def unregister() -> None:
            if callback in self._aborts:
                self._aborts.remove(callback)

        return unregister

    @property
    def silence(self) -> str | None:
        """The watchdog's verdict, once it found a silent rank (without on_silence the process goes on)."""
        return self._watchdog.verdict.line if self._watchdog is not None and self._watchdog.verdict else None

    # -- collectives -------------------------------------------------------------------------------
    def root_only(self, work: Callable[[], T]) -> T:
        mine = self._attempt(work) if self.rank == 0 else None
        return self._unwrap([self._broadcast(mine) if self.world > 1 else mine])[0]

    def agree(self, work: Callable[[], T]) -> T:
        """Run `work` here; if any rank failed, raise the lowest failing rank's error on every rank."""
        mine = self._attempt(work)
        status = mine if isinstance(mine, Failure) else None
        self._unwrap(self._all_gather(status))
        return mine

    def gather(self, work: Callable[[], T]) -> list[T]:
        """Like agree, but every rank also gets every rank's (small, picklable) result."""
        return self._unwrap(self._all_gather(self._attempt(work)))

    def _broadcast(self, obj: Any) -> Any:
        """Rank 0's object on every rank: its pickle's length, then its bytes (torch's broadcast_object_list,
        with the tensors kept: see _keep)."""
        import torch.distributed as dist

        data = pickle.dumps(obj) if self.rank == 0 else b""
        size = torch.tensor([len(data)], dtype=torch.int64)
        with self._pulse.waiting(self._pulse.join()):
            dist.broadcast(size, src=self._root, group=self._control)
            buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if self.rank == 0 else torch.empty(
                int(size), dtype=torch.uint8)
            dist.broadcast(buf, src=self._root, group=self._control)
        self._keep(size, buf)
        return pickle.loads(buf.numpy().tobytes())

    def _all_gather(self, obj: Any) -> list[Any]:
        """Every rank's object on every rank (torch's all_gather_object, with the tensors kept: see _keep)."""
        if self.world == 1:
            return [obj]
        import torch.distributed as dist

        data = pickle.dumps(obj)
        size = torch.tensor([len(data)], dtype=torch.int64)
        sizes = [torch.empty(1, dtype=torch.int64) for _ in range(self.world)]
        with self._pulse.waiting(self._pulse.join()):
            dist.all_gather(sizes, size, group=self._control)
            longest = max(int(s) for s in sizes)
            buf = torch.zeros(longest, dtype=torch.uint8)
            buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else buf[:0]
            every = [torch.empty(longest, dtype=torch.uint8) for _ in range(self.world)]
            dist.all_gather(every, buf, group=self._control)
        self._keep(size, *sizes, buf, *every)
        return [pickle.loads(b[: int(n)].numpy().tobytes()) for b, n in zip(every, sizes, strict=True)]

    def _keep(self, *tensors: torch.Tensor) -> None:
        """Hold the tensors of the last few collectives until the group is destroyed. A gloo worker thread
        frees a finished collective's work, and with it the last reference to a tensor Python made, which
        needs the GIL; destroying the group joins those threads while holding the GIL. With torch 2.6 the two
        met at exit in 4 runs of 6 (a hang, not an error); a tensor Python still holds is freed by Python."""
        self._kept.append(tensors)

    def all_to_all_async(
        self, recv: torch.Tensor, send: torch.Tensor, send_splits: list[int], recv_splits: list[int]
    ) -> Any:
        """Start sending send[sum(send_splits[:d]) : ...] to rank d; `.wait()` fills `recv`."""
        if self.world == 1:
            return None
        import torch.distributed as dist

        self._kept_data = (recv, send)  # the last exchange's buffers, for the reason _keep gives
        step = self._pulse.join()
        work = dist.all_to_all_single(recv, send, recv_splits, send_splits, group=self._data, async_op=True)
        return WatchedWork(work, self._pulse, step, poll=recv.device.type == "cuda")  # NCCL: polled

    def close(self) -> None:
        """Destroy the groups now, while this process still runs.

        Our own references go too: a ProcessGroupGloo that outlives destroy_process_group() is destroyed at
        interpreter exit with its worker threads running, and the C++ runtime aborts (SIGABRT), which hid
        distmerge's own error under torchrun in a third of failed runs.

        A borrowed group (borrow) is the caller's: it stays up; only our references (and our side group) go."""
        import torch.distributed as dist

        if self._watchdog is not None:  # first: under srun rank 0's process serves the store it reads
            self._watchdog.stop()
            self._watchdog = None
        if self.world > 1 and not self._borrowed and dist.is_initialized():
            dist.destroy_process_group()
        if self._side is not None:  # ours, beside a borrowed group
            dist.destroy_process_group(self._side)
            self._side = None
        if self._borrowed:  # what our imports made hold the job's group, handed back
            held_defaults.give_back(dist.group.WORLD, self._modules_at_borrow)
        self._data = self._control = None
        self._aborts.clear()
        self._kept.clear()  # after the worker threads are gone (_keep)
        self._kept_data = ()

    # -- error transport ---------------------------------------------------------------------------
    def _attempt(self, work: Callable[[], T]) -> T | Failure:
        try:
            return work()
        except DistmergeError as err:  # an object-store input's objects by their URLs, not the paths looked up by
            return Failure(rank=self.rank, kind=type(err).__name__, message=input_source.shown(str(err)),
                           trace=traceback.format_exc())
        except Exception as err:  # a bug or an environment fault: still one line, on every rank
            message = f"internal error on rank {self.rank}: {type(err).__name__}: {err} (rerun with --debug)"
            return Failure(rank=self.rank, kind="DistmergeError", message=message, trace=traceback.format_exc())

    def _unwrap(self, outcomes: list[Any]) -> list[Any]:
        failed = [o for o in outcomes if isinstance(o, Failure)]
        if failed:
            first = min(failed, key=lambda f: f.rank)
            cls = getattr(errors, first.kind, DistmergeError)
            err = cls(first.message)
            err.trace = first.trace  # shown with --debug
            err.origin_rank = first.rank
            raise err
        return outcomes


def _own_store(timeout: timedelta) -> tuple[Any, int, int]:
    """The job's rendezvous store (env://, made with `timeout`), rank and world size, under a prefix of this group's
    own: torch keys each default group alike ("default_pg", group "0" again once destroyed), so a second merge in one
    process read the first's gloo addresses left there (refused, or a hang, in half the runs: tests/test_api.py)."""
    import torch.distributed as dist
    store, rank, world = next(dist.rendezvous("env://", timeout=timeout))
    return dist.PrefixStore(next_namespace("group"), store), rank, world


@contextmanager
def process_group(*, device: str, timeout_s: float, borrow: bool = False, group: Any = None,
                  on_silence: Callable[[str, bool], None] | None = None) -> Iterator[Comm]:
    """A Comm for one command. An unexpected exception (a peer died, a collective timed out) becomes this rank's
    one-line error (the watchdog's verdict, or the ranks it finds gone); the group is destroyed and
    stdout flushed on success and on failure. `borrow`: use the running job's `group` (None: its default group)
    instead, and leave it up (Comm.borrow); `device` is then auto, cpu or cuda, resolved against that group; no
    watchdog runs, and `on_silence` (Comm's) is not used."""
    comm = None
    try:  # inside: a group that cannot start is one line too
        comm = Comm.borrow(group, device=device, timeout_s=timeout_s) if borrow else Comm(
            device=device, timeout_s=timeout_s, on_silence=on_silence)
        yield comm
    except DistmergeError:
        raise
    except Exception as err:
        rank = comm.rank if comm is not None else int(os.environ.get("RANK", "0"))
        if comm is not None and comm.silence is not None:
            comm._watchdog.await_end()  # a command's: the watchdog ends the process and says why, once
            raise DistmergeError(comm.silence) from err
        lost = comm._watchdog.lost(err) if comm is not None and comm._watchdog is not None else None  # who is gone
        raise DistmergeError(lost or f"rank {rank}: {type(err).__name__}: {_first_line(err)}") from err
    finally:
        if comm is not None:
            comm.close()
        sys.stdout.flush()


def _borrowed_device(asked: str, backend: str) -> torch.device:
    """Where a borrowing Comm's tensors go: the job's current GPU over NCCL; the CPU otherwise (torch.cuda is not
    touched then)."""
    if asked not in ("auto", "cpu", "cuda"):
        raise InputError(f"device={asked!r}: choose one of auto, cpu, cuda")
    if asked == "auto":
        asked = "cuda" if "nccl" in backend else "cpu"
    if asked == "cpu":
        return torch.device("cpu")
    if "nccl" not in backend:
        raise InputError(f"device='cuda' in a job whose group runs {backend}: gloo carries the fragments on the CPU "
                         "here; pass device='cpu' (or 'auto'), or a group that runs NCCL")
    return torch.device("cuda", torch.cuda.current_device())  # the job's: its NCCL group works on it


def _side_group(group: Any, timeout: timedelta) -> Any:
    """A gloo group over the ranks of `group`, in its order (so ranks agree in both). dist.new_group must be
    called by every process of the job: `group` must be all of them."""
    import torch.distributed as dist

    if dist.get_world_size(group) != dist.get_world_size():
        raise InputError(f"the group passed runs {dist.get_backend(group)} on {dist.get_world_size(group)} of the "
                         f"job's {dist.get_world_size()} processes: distmerge needs a gloo group beside it, which "
                         "every process of the job must make. Make one over the same ranks on every process "
                         "(dist.new_group(ranks, backend='gloo')) and pass it as group= (device='cpu'), or call "
                         "distmerge on every process with the default group")
    ranks = None if group is dist.group.WORLD else dist.get_process_group_ranks(group)
    order = {} if ranks is None or ranks == sorted(ranks) else {"sort_ranks": False}  # torch >= 2.5 has it
    return dist.new_group(ranks=ranks, backend="gloo", timeout=timeout, **order)


def resolve_device(device: str) -> str:
    """--device auto: the GPU when torch sees one. --device cuda without one: a clear error, before any
    process group exists (every rank finds the same, rank 0 says it)."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise _before_group(InputError(f"--device cuda: {_why_no_cuda()}; use --device cpu (or auto)"))
    return device


def cuda_device(local_rank: int) -> torch.device:
    """The GPU of the process with this LOCAL_RANK. More processes than GPUs share them round-robin; NCCL
    then decides whether two ranks may use one GPU (recent versions refuse: see _start_group)."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        raise _before_group(InputError(f"--device cuda: {_why_no_cuda()}; use --device cpu (or auto)"))
    return torch.device("cuda", gpu_for_rank(local_rank, count))


def gpu_for_rank(local_rank: int, gpus: int) -> int:
    return local_rank % gpus


def _why_no_cuda() -> str:
    if torch.version.cuda is None:
        return f"this torch ({torch.__version__}) is built without CUDA"
    hidden = os.environ.get("CUDA_VISIBLE_DEVICES")
    return "no GPU is visible" + (f" (CUDA_VISIBLE_DEVICES={hidden!r})" if hidden is not None else "")


def _before_group(err: DistmergeError) -> DistmergeError:
    err.before_group = True  # the same error on every rank: rank 0 alone prints it
    return err


def _first_line(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return lines[0][:300] if lines else ""

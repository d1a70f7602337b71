"""Reads made together: the fragments one phase of a round reads (exchange's packing for the other ranks, an
owner's local fragments), handed to a `Batch` before any is read.

A fragment of a local file is read at once, in call order, exactly as `Reader.read_into` / `copy_to` read it
(pread into memory, or through the 1 MiB bounce buffer into an output file): a batch changes nothing on disk.

A fragment of an object (an object-store input) waits for `run`, where each object's ranges are sorted and
neighbours are merged into one ranged GET across what lies between them: bytes no fragment holds (a zip record's
data descriptor and the next local header, about a hundred bytes), or fragments this rank reads in a later round
(a round ends inside a layer whose tensors the file orders otherwise), read now and kept for their round
(Reader.keep: at most HOLE between two ranges, KEEP held in all), so that every byte is still read once. Requests,
not bytes, are what an object store charges time for (a round trip each on S3; the whole object's read on some
servers: docs/benchmarks.md, "Object stores"), and a round's fragments of a rank file lie mostly side by side, so
a round costs a GET or two per object instead of one per fragment. A merged GET is never held whole: its pieces
(objects.PIECE) go to their fragments' destinations as they arrive (a send buffer's slot, a source tensor,
an output file's part), so memory stays what the round's destinations already are, whatever the GET's length.
A few GETs of one batch are in flight at once (THREADS); their pieces are handed over one at a time (the
destinations are not thread-safe: an upload's parts).
"""

from __future__ import annotations

import bisect
import threading
from collections import defaultdict
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

Fragment = Any  # formats/base.Fragment (the input side is below the formats that name what it reads)
GAP = 1 << 16  # the most bytes between two ranges read in one GET that are no fragment's (zip headers)
HOLE = 8 << 20  # the most bytes between two ranges read in one GET, fragments of a later round included
KEEP = 64 << 20  # the most bytes of later rounds' fragments a reader holds (Reader.keep)
THREADS = 4  # GETs of one batch in flight


class Reader(Protocol):
    """What a batch asks of reader.Reader (which makes batches: this module does not import it)."""

    bytes_read: int

    def can_copy(self, frag: Fragment) -> bool: ...

    def by_request(self, frag: Fragment) -> bool: ...

    def taken(self, index: int) -> list[tuple[int, int]] | None: ...

    def later(self, index: int, ranges: list[tuple[int, int]]) -> list[Fragment] | None: ...

    def keep(self, frag: Fragment, data: torch.Tensor) -> None: ...

    def kept(self, frag: Fragment) -> torch.Tensor | None: ...

    def read_done(self, frags: Iterable[Fragment]) -> None: ...

    kept_bytes: int

    def file(self, index: int) -> Any: ...

    def pool(self, threads: int) -> ThreadPoolExecutor: ...

    def read_into(self, frag: Fragment, dest: torch.Tensor | None = None, count: bool = True,
                  then: Callable[[torch.Tensor], None] | None = None) -> None: ...

    def copy_to(self, frag: Fragment, put: Callable[[memoryview, int], None], out_offset: int,
                nbytes: int) -> None: ...

    def fill(self, pairs: list[tuple[Fragment, memoryview | torch.Tensor]]) -> None: ...


@dataclass(kw_only=True)
class _Job:
    """One fragment's bytes [offset, offset + nbytes) of the input, and where they go."""

    frag: Fragment
    offset: int
    nbytes: int
    put: Callable[[memoryview, int], None] | None = None  # an output file's pwrite (copy_to), at out_offset + i
    out_offset: int = 0
    dest: torch.Tensor | None = None  # uint8 (read_into); made when the first piece arrives if None
    then: Callable[[torch.Tensor], None] | None = None  # called with dest once it is full
    count: bool = True
    got: int = 0
    view: memoryview | None = field(default=None, repr=False)

    def deliver(self, piece: memoryview, at: int) -> None:
        if self.put is not None:
            self.put(piece, self.out_offset + at)
        else:
            if self.view is None:
                if self.dest is None:
                    self.dest = torch.empty(self.nbytes, dtype=torch.uint8)
                self.view = memoryview(self.dest.numpy()).cast("B")
            self.view[at : at + len(piece)] = piece
        self.got += len(piece)
        if self.got == self.nbytes and self.then is not None:
            self.then(self.dest)
            self.dest = self.view = None


def _tensor(dest: memoryview | torch.Tensor) -> torch.Tensor:
    return dest if isinstance(dest, torch.Tensor) else torch.frombuffer(dest, dtype=torch.uint8)


class FileBatch:
    """A local folder's read policy: each read made at once, in call order (Reader.read_into, copy_to), but `fill`'s,
    which `run` reads together (Reader.fill: small fragments that touch in one read). Nothing changes on disk."""

    def __init__(self, reader: Reader) -> None:
        self.reader = reader
        self.pairs: list[tuple[Fragment, memoryview | torch.Tensor]] = []

    def can_copy(self, frag: Fragment) -> bool:
        return self.reader.can_copy(frag)

    def read_into(self, frag: Fragment, dest: torch.Tensor | None = None, count: bool = True,
                  then: Callable[[torch.Tensor], None] | None = None) -> None:
        self.reader.read_into(frag, dest, count, then)

    def copy_to(self, frag: Fragment, put: Callable[[memoryview, int], None], out_offset: int, nbytes: int) -> None:
        self.reader.copy_to(frag, put, out_offset, nbytes)

    def fill(self, frag: Fragment, dest: memoryview | torch.Tensor) -> None:
        """The fragment's bytes into `dest` (its size), when the batch runs."""
        self.pairs.append((frag, dest))

    def run(self) -> None:
        pairs, self.pairs = self.pairs, []
        if pairs:
            self.reader.fill(pairs)


class Batch:
    """An object store's read policy: the reads of one phase of a round; `run` makes those still waiting (the
    module docstring says how)."""

    def __init__(self, reader: Reader) -> None:
        self.reader = reader
        self.jobs: dict[int, list[_Job]] = defaultdict(list)  # input file -> its fragments waiting
        self.keeping = 0  # bytes of later rounds' fragments this batch reads in passing

    def can_copy(self, frag: Fragment) -> bool:
        return self.reader.can_copy(frag)

    def read_into(self, frag: Fragment, dest: torch.Tensor | None = None, count: bool = True,
                  then: Callable[[torch.Tensor], None] | None = None) -> None:
        """Reader.read_into: the fragment's bytes into `dest` (None: a buffer made when they arrive), then
        `then(dest)`."""
        kept = self.reader.kept(frag)
        if kept is not None:  # read in passing by an earlier round's GET
            dest = kept if dest is None else dest.copy_(kept)
            if then is not None:
                then(dest)
            return
        if not self.reader.by_request(frag):
            self.reader.read_into(frag, dest, count, then)
            return
        self.jobs[frag.file_index].append(_Job(frag=frag, offset=frag.byte_offset, nbytes=frag.nbytes, dest=dest,
                                               then=then, count=count))

    def copy_to(self, frag: Fragment, put: Callable[[memoryview, int], None], out_offset: int, nbytes: int) -> None:
        """The fragment's first nbytes to `put(buffer, out_offset + i)` (Reader.copy_to)."""
        kept = self.reader.kept(frag)
        if kept is not None:
            put(memoryview(kept.numpy())[:nbytes], out_offset)
            return
        if not self.reader.by_request(frag):
            self.reader.copy_to(frag, put, out_offset, nbytes)
            return
        self.jobs[frag.file_index].append(_Job(frag=frag, offset=frag.byte_offset, nbytes=nbytes, put=put,
                                               out_offset=out_offset))

    def fill(self, frag: Fragment, dest: memoryview | torch.Tensor) -> None:
        """The fragment's bytes into `dest` (its size), when the batch runs."""
        self.read_into(frag, _tensor(dest))

    def run(self) -> None:
        """Read every fragment still waiting: each object's merged ranges, a few GETs at once."""
        runs = [(index, run) for index, jobs in self.jobs.items() for run in self._runs(index, jobs)]
        self.jobs.clear()
        if not runs:
            return
        lock = threading.Lock()
        if len(runs) == 1:
            self._read(*runs[0], lock)
            return
        pool = self.reader.pool(THREADS)
        futures = [pool.submit(self._read, index, run, lock) for index, run in runs]
        wait(futures)  # every GET over before an error is raised: nothing writes into a buffer after
        for future in futures:
            future.result()

    def _runs(self, index: int, jobs: list[_Job]) -> list[list[_Job]]:
        """The jobs of one object in file order, cut where what lies between two neighbours cannot be read in
        passing (`_through`)."""
        jobs.sort(key=lambda j: j.offset)
        runs: list[list[_Job]] = []
        end = 0
        for job in jobs:
            passing = None if not runs else [] if job.offset <= end else self._through(index, end, job.offset)
            if passing is None:
                runs.append([job])
                end = job.offset + job.nbytes
                continue
            for frag in passing:  # another round's fragments in the way: read now, kept for their round
                self.keeping += frag.nbytes
                runs[-1].append(_Job(frag=frag, offset=frag.byte_offset, nbytes=frag.nbytes,
                                     then=lambda data, frag=frag: self.reader.keep(frag, data)))
            runs[-1].append(job)
            end = max(end, job.offset + job.nbytes)
        return runs

    def _through(self, index: int, start: int, end: int) -> list[Fragment] | None:
        """What to read in passing to join two neighbours across bytes [start, end): nothing (at most GAP bytes, no
        fragment's), or the fragments this rank reads in a later round, each wholly inside, with at most GAP other
        bytes, at most HOLE in all and what is kept staying under KEEP; None when the GET must stop before."""
        taken = self.reader.taken(index)
        if end - start > HOLE or taken is None:
            return None
        k = bisect.bisect_left(taken, (start, -1))
        k -= k > 0 and taken[k - 1][1] > start
        inside = []
        while k < len(taken) and taken[k][0] < end:
            inside.append(taken[k])
            k += 1
        if not inside:
            return [] if end - start <= GAP else None
        later = self.reader.later(index, inside)
        if later is None or end - start - sum(f.nbytes for f in later) > GAP:
            return None
        if self.reader.kept_bytes + self.keeping + sum(f.nbytes for f in later) > KEEP:
            return None
        return later

    def _read(self, index: int, run: list[_Job], lock: threading.Lock) -> None:
        def put(job: _Job) -> Callable[[memoryview, int], None]:
            def deliver(piece: memoryview, at: int) -> None:
                with lock:
                    job.deliver(piece, at)
            return deliver

        start, end = run[0].offset, max(j.offset + j.nbytes for j in run)
        run.sort(key=lambda j: j.offset)  # read_spans wants them in file order
        self.reader.file(index).read_spans(start, end, [(j.offset, j.nbytes, put(j)) for j in run])
        with lock:
            self.reader.bytes_read += sum(j.nbytes for j in run if j.count)
            self.reader.read_done(j.frag for j in run)



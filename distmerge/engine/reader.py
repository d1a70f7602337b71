"""Reads fragment bytes on the rank that owns the input file: pread into memory, or through one reused 1 MiB
buffer into an output file. No mapping of the input is kept (mmap only told us where bytes are). Every
file is opened through the input's source (input/source.py), by the walk's record that came with the scan: on
every rank, a file replaced by a link or a FIFO after discovery is refused, never followed."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from distmerge import dtypes
from distmerge.engine.plan import Plan
from distmerge.errors import CorruptInputError
from distmerge.formats import registry
from distmerge.formats.base import Fragment, InputFormat, OpenedFile, Scan
from distmerge.input import source

# The copy of a fragment into an output file goes through one reused buffer of this size: preadv from the input,
# pwrite into the output, 1 MiB each (writer.WRITE_CHUNK). copy_file_range, used before, splices 64 KiB at a time
# on ext4 and takes the output file's inode lock for each piece, so two processes writing one shared file took
# turns. tests/bench/bench_copy_paths.py, 0.78 GB into one file with fsync (docs/benchmarks.md): 0.65 s by
# copy_file_range, 0.54 s through this buffer; with early writeback (writeback.py) 0.50 s and 0.34 s; two
# processes writing halves of one file 0.46 s and 0.25 s. 4 MiB writes were 2-4x slower than 1 MiB ones.
BOUNCE = 1 << 20
# Small fragments that follow one another in a file are read together, up to SPAN bytes a read: a 1024-rank save
# holds 1.16 million chunks, a pread each is a system call per few KB. Only fragments that touch: the bytes
# between two (a DCP blob's zip records, the next tensor's pickle) are never read, so each input byte is still
# read once (tests/test_promises.py); a DCP file's tiny chunks, 1.6 KB of records apart, are read one by one.
SMALL = 1 << 20
SPAN = 4 << 20


class Reader:
    def __init__(self, scan: Scan, fmt: InputFormat, *, second: bool = False) -> None:
        """`second`: a second input read in the same run (verify of two checkpoints): the first's record stays."""
        self.scan = scan
        self.root = Path(scan.root)
        self.fmt = fmt
        self.files = scan.files
        self.opened: dict[int, OpenedFile] = {}
        self._files: dict[int, Any] = {}  # source.InFile: a file, or an object of an object-store input
        self.bytes_read = 0
        self._bounce = memoryview(bytearray(BOUNCE))
        self._taken: dict[int, list[tuple[int, int]]] = {}
        self._pool: ThreadPoolExecutor | None = None
        self._planned: dict[int, dict[tuple[int, int], Fragment]] = {}  # plan_reads: file -> range -> fragment
        self._done: set[Fragment] = set()  # read by a batch
        self._kept: dict[Fragment, torch.Tensor] = {}  # read in passing, for a later round
        self.kept_bytes = 0
        self._session = source.session()
        self._session.adopt(scan.walked, also=second)  # files are opened by the walk's record, on every rank
        if scan.base_walked is not None:  # a --base-model folder the nodes joined: opened by its record
            self._session.adopt(scan.base_walked, also=True)
        for part in scan.parts:  # an average's other inputs (engine/inputs.py): each opened by its own record
            self._session.adopt(part.scan.walked, also=True)
        # the input's source (input/source.py) sets the read policy: what `batch` makes, and whether a round's
        # reads plan ahead (an object store's merged GETs) or read each round's own (a file's spans: `fill`); an
        # average's other inputs are opened through their own sources, under the first input's policy
        self.source = source.of(self.root)
        self._parts = {part.index: source.of(Path(part.scan.root)) for part in scan.parts}

    def open(self, indices: list[int]) -> list[Fragment]:
        """Discover: open the assigned files, return their fragments (the rank's inventory). They are the caller's:
        `opened` keeps each file's views and layout, not its fragments, which the plan holds again once the
        inventories are gathered (a 1024-rank DCP save's 1.16 million, ~0.3 GB, kept twice at N=1 before); the
        byte ranges they take are kept where a batch asks for them (taken)."""
        found: list[Fragment] = []
        for i in indices:
            opened = registry.open_file(self.fmt, self._source_of(i), self.scan, self.files[i])
            if self.source.plans_ahead:
                self._taken[i] = sorted((f.byte_offset, f.byte_offset + f.nbytes) for f in opened.fragments
                                        if f.byte_offset >= 0)
            found.extend(opened.fragments)
            self.opened[i] = replace(opened, fragments=[])
        return found

    def _source_of(self, index: int) -> Any:
        """The source that holds input file `index`: its input's (an average's other input); for a --base-model
        file, the record of that folder where the nodes' listings were joined; else the input's."""
        part = registry.part_of(self.scan, index) if self._parts else None
        if part is not None:
            return self._parts[part.index]
        file = self.files[index]
        return (source.find(Path(file.root) / file.path) or self.source) if file.root else self.source

    def can_copy(self, frag: Fragment) -> bool:
        return frag.byte_offset >= 0

    def read_into(self, frag: Fragment, dest: torch.Tensor | None = None, count: bool = True,
                  then: Callable[[torch.Tensor], None] | None = None) -> None:
        """Fill `dest` (CPU, contiguous uint8 of the fragment's size; None: a buffer made here) with the fragment's
        bytes, then call `then(dest)`; `count`: add them to bytes_read (the summary's `read`: bytes the output is
        made of). reads.Batch takes the same calls and may make them later."""
        if dest is None:
            dest = torch.empty(frag.nbytes, dtype=torch.uint8)
        self._read_into(frag, dest, count)
        if then is not None:
            then(dest)

    def _read_into(self, frag: Fragment, dest: torch.Tensor, count: bool) -> None:
        if frag.byte_offset < 0:
            view = self.opened[frag.file_index].views[(frag.key, frag.offsets)]
            dest.view(dtypes.torch_dtype(frag.dtype)).view(frag.lengths).copy_(view)
            self.bytes_read += dest.numel() * count
            return
        buf = memoryview(dest.numpy()).cast("B")
        done = self._file(frag.file_index).read_full(buf, frag.byte_offset)  # a pread loop; one ranged GET
        if done < len(buf):
            self._truncated(frag)
        self.bytes_read += done * count

    def fill(self, pairs: list[tuple[Fragment, memoryview | torch.Tensor]]) -> None:
        """Each fragment's bytes into its destination (a writable memoryview, or a CPU uint8 tensor, of its size);
        small fragments of one file that touch come in one read."""
        small = sorted((p for p in pairs if p[0].byte_offset >= 0 and p[0].nbytes <= SMALL),
                       key=lambda p: (p[0].file_index, p[0].byte_offset))
        for frag, dest in pairs:
            if frag.byte_offset < 0 or frag.nbytes > SMALL:
                self.read_into(frag, _tensor(dest))
        at = 0
        while at < len(small):
            first, end, stop = small[at][0], small[at][0].byte_offset + small[at][0].nbytes, at + 1
            while stop < len(small):
                f = small[stop][0]
                if f.file_index != first.file_index or f.byte_offset > end or f.byte_offset + f.nbytes - \
                        first.byte_offset > SPAN:
                    break
                end, stop = max(end, f.byte_offset + f.nbytes), stop + 1
            self._fill_span(small[at:stop], first.byte_offset, end)
            at = stop

    def _fill_span(self, pairs: list[tuple[Fragment, memoryview | torch.Tensor]], start: int, end: int) -> None:
        """One read of [start, end) of the pairs' file; a lone fragment's bytes go straight to its destination."""
        lone = len(pairs) == 1 and pairs[0][0].byte_offset == start and pairs[0][0].nbytes == end - start
        dest = pairs[0][1] if lone else None
        buf = (dest if isinstance(dest, memoryview) else memoryview(dest.numpy()).cast("B")) if lone else \
            memoryview(bytearray(end - start))
        done = self._file(pairs[0][0].file_index).read_full(buf, start)
        if done < len(buf):
            self._truncated(next(f for f, _ in pairs if f.byte_offset + f.nbytes > start + done))
        if lone:
            self.bytes_read += done
            return
        for frag, dest in pairs:
            view = dest if isinstance(dest, memoryview) else memoryview(dest.numpy()).cast("B")
            view[:] = buf[frag.byte_offset - start : frag.byte_offset - start + frag.nbytes]
            self.bytes_read += frag.nbytes

    def copy_to(self, frag: Fragment, put: Callable[[memoryview, int], None], out_offset: int, nbytes: int) -> None:
        """Copy the first nbytes of the fragment to `put(buffer, offset)` (the output file's pwrite), 1 MiB at a
        time. A read failure is this input file's error; put's own failures (a full disk) pass through."""
        done = self._file(frag.file_index).copy_range(frag.byte_offset, nbytes,
                                                      lambda piece, at: put(piece, out_offset + at), self._bounce,
                                                      self.files[frag.file_index].path)
        if done < nbytes:
            self._truncated(frag)
        self.bytes_read += done

    def batch(self) -> Any:
        """Reads to make together, as the source's read policy makes them (input/reads.py): a round's packing, an
        owner's local fragments."""
        return self.source.batch(self)

    def by_request(self, frag: Fragment) -> bool:
        """The fragment's bytes come through the file's methods (a request each) rather than its descriptor or a
        mapped view."""
        return frag.byte_offset >= 0 and self._file(frag.file_index).by_request

    def with_packing(self, frags: Iterable[Fragment]) -> list[Fragment]:
        """Of an owner's own fragments of a round, those the source's policy reads with the round's packing
        (exchange.held_back): an object store's, in the same merged GETs; none of a folder's."""
        return [f for f in frags if self.by_request(f)] if self.source.plans_ahead else []

    def taken(self, index: int) -> list[tuple[int, int]] | None:
        """(start, end) of every fragment of an input file this rank opened, sorted: bytes a batch may not read
        in passing, since they are read in another round (each input byte once). None: a file it did not open.
        Kept by `open` under a read policy that plans ahead (an object store's), the only one that asks."""
        return self._taken.get(index)

    def plan_reads(self, plan: Plan, rank: int) -> None:
        """The fragments this rank reads in the rounds to come (before the first): a batch may read one early, in
        passing, and keep it for its round (reads.py); nothing when the source's policy reads each round's own."""
        self._planned.clear()
        self._done.clear()
        self._kept.clear()
        self.kept_bytes = 0
        if not self.source.plans_ahead:
            return
        for k in range(len(plan.rounds)):
            for _, names in plan.brings(k):
                for frag in (f for name in names for f in plan.sources[name].fragments):
                    if plan.readers[frag.file_index] == rank and frag.byte_offset >= 0:
                        at = (frag.byte_offset, frag.byte_offset + frag.nbytes)
                        self._planned.setdefault(frag.file_index, {}).setdefault(at, frag)

    def later(self, index: int, ranges: list[tuple[int, int]]) -> list[Fragment] | None:
        """The planned fragments at these byte ranges of a file, none read yet; None if a range is another's."""
        planned = self._planned.get(index, {})
        found = [planned.get(r) for r in dict.fromkeys(ranges)]
        if any(f is None or f in self._done or f in self._kept for f in found):
            return None
        return found

    def keep(self, frag: Fragment, data: torch.Tensor) -> None:
        """A fragment read in passing, held for the round that needs it (`kept`)."""
        self._kept[frag] = data
        self.kept_bytes += frag.nbytes

    def kept(self, frag: Fragment) -> torch.Tensor | None:
        data = self._kept.pop(frag, None)
        if data is not None:
            self.kept_bytes -= frag.nbytes
        return data

    def read_done(self, frags: Iterable[Fragment]) -> None:
        self._done.update(frags)

    def file(self, index: int) -> Any:
        """The input file, opened once by the source: a file, or an object of an object-store input."""
        return self._file(index)

    def pool(self, threads: int) -> ThreadPoolExecutor:
        """Threads for a batch's GETs, made on first use."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="distmerge-read",
                                            initializer=self._session.bind)
        return self._pool

    def _truncated(self, frag: Fragment) -> None:
        path = self.files[frag.file_index].path
        raise CorruptInputError(f"{path} ends before the bytes of {frag.key}: the file is truncated")

    def _file(self, index: int) -> Any:
        if index not in self._files:
            file = self.files[index]  # a second input root's file (--base-model, an average's) names its folder
            self._files[index] = self._source_of(index).open(Path(file.root or self.root) / file.path)
        return self._files[index]

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()
        self.opened.clear()
        self._taken.clear()
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
        self._session.adopt(None)


def _tensor(dest: memoryview | torch.Tensor) -> torch.Tensor:
    return dest if isinstance(dest, torch.Tensor) else torch.frombuffer(dest, dtype=torch.uint8)

"""Where the engine's assembled targets go: the `Sink` protocol, and merge's sink, the output files.

The engine (run.run_rounds) is the same for every sink; a sink only decides what happens to a target once
it is built. Call order on each rank, per round:

    output(i)     once per unit i of the round this rank owns, before any of its fragments is placed: where the
                  unit's targets go (assemble.TargetOut)
    round_done()  after the round's units are finished: the sink completes what it can (merge: fsync and rename
                  the files whose every byte is in)

`output` and `round_done` run inside the round's all_gather, so an error in either is raised on every rank.
Three sinks exist: `FileSink` below (`merge`: safetensors files), verifier/stream.StreamSink (`verify` of a
checkpoint: each target compared with a reference, nothing written) and importer/sink.ImportSink (`import` of a
checkpoint: each unit's targets cut into Megatron chunks, no safetensors written).
"""

from __future__ import annotations

from typing import Any, Protocol

from distmerge.distributed.comm import Comm
from distmerge.engine import resume, spread
from distmerge.engine.assemble import TargetOut
from distmerge.engine.plan import Plan
from distmerge.output.store import Store
from distmerge.output.writer import ShardWriter, header_bytes


class Sink(Protocol):
    def output(self, unit: int) -> TargetOut: ...

    def round_done(self) -> None: ...


class FileSink:
    """merge's sink: each owner writes its units' targets into its output files (output/writer.py) through the
    output store, files several ranks write (plan.OutputFile.shared) in three steps: `create_shared` before the
    first round, every writer's part in the rounds, `commit_shared` after the last (with every writer's receipt,
    `receipts`, when the store needs them: an object store's part numbers and ETags)."""

    def __init__(self, plan: Plan, store: Store, run: resume.RunRecord, rank: int, *, checksum: bool) -> None:
        self.plan, self.store, self.run, self.rank, self.checksum = plan, store, run, rank, checksum
        self.writers: dict[int, ShardWriter] = {}  # output file index -> this rank's writer of it
        self.tokens: dict[int, Any] = {}  # shared file -> what its other writers join it by (the store's token)

    def create_shared(self, kept: tuple[int, ...], comm: Comm) -> None:
        """Owners create the shared files they own before any other writer opens them. Collective only when the
        plan has shared files to write (the same plan on every rank, so all ranks agree to call it or not)."""
        shared = [f for f, file in enumerate(self.plan.files) if file.shared and f not in kept]
        if not shared:
            return

        def create() -> dict[int, Any]:
            for f in shared:
                if self.plan.files[f].owner == self.rank:
                    self.writers[f] = self._writer(f, create=True)
            return {f: w.file.token for f, w in self.writers.items()}
        for made in comm.gather(create):
            self.tokens.update(made)

    def output(self, unit: int) -> ShardWriter:
        f = self.plan.file_of_unit[unit]
        if f not in self.writers:  # a shared file was created by its owner before the first round
            self.writers[f] = self._writer(f, create=not self.plan.files[f].shared)
        return self.writers[f]

    def round_done(self) -> None:
        """Finish the files that are complete."""
        for f, writer in self.writers.items():
            if writer.complete and not writer.finished:
                writer.finish()
                if not writer.shared:  # a shared file is committed and recorded by its owner after the last round
                    resume.record_done(self.store, self.plan.files[f], self.run, self.checksum)

    @property
    def needs_receipts(self) -> bool:
        """The same on every rank (same plan, same store): whether commit_shared needs an all_gather of receipts."""
        return self.store.sharing.receipts and any(f.shared for f in self.plan.files)

    def receipts(self) -> dict[int, Any]:
        """What this rank's parts of shared files left for their owners' commits (an object store: part ETags)."""
        return {f: w.receipt for f, w in self.writers.items() if w.shared}

    def commit_shared(self, receipts: list[dict[int, Any]] | None = None) -> None:
        """After the last round every writer's part is durable (each finishes its part inside a round's gather, and
        that gather has returned on every rank): owners commit their shared files and record them."""
        for f, writer in self.writers.items():
            if writer.shared and self.plan.files[f].owner == self.rank:
                writer.commit(None if receipts is None else [r[f] for r in receipts if f in r])
                resume.record_done(self.store, self.plan.files[f], self.run, self.checksum)

    def abort(self) -> None:
        for writer in self.writers.values():
            writer.abort()

    def _writer(self, f: int, *, create: bool) -> ShardWriter:
        plan, file = self.plan, self.plan.files[f]
        if not file.shared:
            return ShardWriter(self.store, file.name, file.targets, create=create, rank=self.rank)
        part = sum(t.nbytes for i in file.units if plan.owner_of_unit[i] == self.rank for t in plan.units[i].targets)
        return ShardWriter(self.store, file.name, file.targets, part=part, create=create, rank=self.rank,
                           runs=file_runs(plan, f), token=self.tokens.get(f))


def file_runs(plan: Plan, f: int) -> tuple[tuple[int, int, int], ...]:
    """(start, end, writer) of a file's runs of bytes one rank writes, in file order; the header in the first."""
    file = plan.files[f]
    writer_of = {t.name: plan.owner_of_unit[i] for i in file.units for t in plan.units[i].targets}
    head, ranges = header_bytes(file.targets)
    runs = spread.writer_runs([(ranges[t.name][1] - ranges[t.name][0], writer_of[t.name]) for t in file.targets])
    return tuple((0 if k == 0 else len(head) + s, len(head) + e, w) for k, (s, e, w) in enumerate(runs))

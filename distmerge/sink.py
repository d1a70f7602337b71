"""Where the engine's assembled targets go: the `Sink` protocol, and merge's sink, the output files.

The engine (engine.run_rounds) is the same for every sink; a sink only decides what happens to a target once
it is built. Call order on each rank, per round:

    output(i)     once per unit i of the round this rank owns, before any of its fragments is placed: where the
                  unit's targets go (assemble.TargetOut)
    round_done()  after the round's units are finished: the sink completes what it can (merge: fsync and rename
                  the files whose every byte is in)

`output` and `round_done` run inside the round's all_gather, so an error in either is raised on every rank.
Two sinks exist: `FileSink` below (`merge`: safetensors files) and verify/stream.StreamSink (`verify` of a
checkpoint: each target compared with a reference, nothing written).
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from distmerge import resume
from distmerge.assemble import TargetOut
from distmerge.comm import Comm
from distmerge.plan import Plan
from distmerge.writer import ShardWriter


class Sink(Protocol):
    def output(self, unit: int) -> TargetOut: ...

    def round_done(self) -> None: ...


class FileSink:
    """merge's sink: each owner writes its units' targets into its output files (writer.py), files several ranks
    write (plan.OutputFile.shared) in three steps: `create_shared` before the first round, every writer's part
    in the rounds, `commit_shared` after the last."""

    def __init__(self, plan: Plan, out: Path, run: resume.RunRecord, rank: int, *, checksum: bool) -> None:
        self.plan, self.out, self.run, self.rank, self.checksum = plan, out, run, rank, checksum
        self.writers: dict[int, ShardWriter] = {}  # output file index -> this rank's writer of it

    def create_shared(self, kept: tuple[int, ...], comm: Comm) -> None:
        """Owners create the shared files they own before any other writer opens them. Collective only when the
        plan has shared files to write (the same plan on every rank, so all ranks agree to call it or not)."""
        shared = [f for f, file in enumerate(self.plan.files) if file.shared and f not in kept]
        if not shared:
            return

        def create() -> None:
            for f in shared:
                if self.plan.files[f].owner == self.rank:
                    self.writers[f] = self._writer(f, create=True)
        comm.agree(create)

    def output(self, unit: int) -> ShardWriter:
        f = self.plan.file_of_unit[unit]
        if f not in self.writers:  # a shared file was created by its owner before the first round
            self.writers[f] = self._writer(f, create=not self.plan.files[f].shared)
        return self.writers[f]

    def round_done(self) -> None:
        """Finish the files that are complete."""
        for f, writer in self.writers.items():
            if writer.complete and writer.fd >= 0:
                writer.finish()
                if not writer.shared:  # a shared file is renamed and recorded by its owner after the last round
                    resume.record_done(self.out, self.plan.files[f], self.run, self.checksum)

    def commit_shared(self) -> None:
        """After the last round every writer's part is durable (each fsyncs its part inside a round's gather, and
        that gather has returned on every rank): owners rename their shared files and record them."""
        for f, writer in self.writers.items():
            if writer.shared and self.plan.files[f].owner == self.rank:
                writer.commit()
                resume.record_done(self.out, self.plan.files[f], self.run, self.checksum)

    def abort(self) -> None:
        for writer in self.writers.values():
            writer.abort()

    def _writer(self, f: int, *, create: bool) -> ShardWriter:
        plan, file = self.plan, self.plan.files[f]
        part = sum(t.nbytes for i in file.units if plan.owner_of_unit[i] == self.rank for t in plan.units[i].targets)
        return ShardWriter(self.out, file.name, file.targets, part=part if file.shared else None, create=create)

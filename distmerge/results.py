"""What a merge reports: per-rank figures and the whole run's result (printed by report.py, returned by
engine/run.py)."""

from __future__ import annotations

import resource
import time
from dataclasses import dataclass, field


@dataclass(frozen=True, kw_only=True)
class RankStats:
    rank: int
    bytes_read: int
    bytes_written: int
    files_written: int
    peak_rss: int
    node: int = 0  # its node (engine/nodes.py), with several
    bytes_from_other_nodes: int = 0  # source bytes this rank's units received from ranks on other nodes
    phases: dict[str, float] = field(default_factory=dict)  # wall seconds of each phase on this rank (Laps)
    phases_cpu: dict[str, float] = field(default_factory=dict)  # CPU seconds of the same (steadier on a busy machine)
    phases_rss: dict[str, int] = field(default_factory=dict)  # peak RSS in bytes as each phase ended


class Laps(dict):
    """Wall seconds of the phases of a run, as they end: `lap("open")` records the time since the last lap
    (and `cpu` the process's CPU seconds over the same)."""

    def __init__(self) -> None:
        super().__init__()
        self.cpu: dict[str, float] = {}
        self.rss: dict[str, int] = {}
        self._last, self._last_cpu = time.perf_counter(), time.process_time()

    def lap(self, name: str) -> None:
        now, cpu = time.perf_counter(), time.process_time()
        self[name], self.cpu[name] = round(now - self._last, 3), round(cpu - self._last_cpu, 3)
        self.rss[name] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        self._last, self._last_cpu = now, cpu


@dataclass(frozen=True, kw_only=True)
class MergeResult:
    output: str
    format: str
    input_world_size: int
    processes: int
    device: str
    tensors: int
    files: list[tuple[str, int]]
    total_bytes: int
    seconds: float
    ranks: list[RankStats]
    notes: list[str] = field(default_factory=list)
    copied: list[str] = field(default_factory=list)
    resumed_files: int = 0  # kept by --resume from the interrupted run, not written again
    bytes_written: int = 0  # tensor bytes this run wrote (total_bytes less the kept files')
    resume: str = ""  # what --resume found and did, one line
    already_complete: bool = False  # --resume found this very merge finished: nothing was written
    nodes: int = 1  # the nodes the ranks ran on (engine/nodes.py: each node's disk read where it lies)

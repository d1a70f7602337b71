"""The import's input: a Hugging Face folder, or any checkpoint distmerge merges (issue #45, item 3: a Megatron
legacy TP save written as torch_dist at another TP, an FSDP or DCP save, ...), read in one pass.

    FolderInput       the folder's safetensors: each Megatron tensor's maker reads the rows its chunks need
                      (write.from_folder, read.Files)
    CheckpointInput   the checkpoint read by the merge engine (engine/run.py: discovery, plan, exchange, assemble;
                      every format it reads, its bounded memory): each unit's owner is handed its Hugging Face
                      tensors whole, in memory, and cuts the Megatron chunks from them (sink.ImportSink). No
                      Hugging Face folder is written: each input byte is read once.

Both give the Model the import plans from (names, dtypes, shapes, config.json) on every rank. A checkpoint's is
made from the merge plan's targets, whose units are joined first (`together`) so that the Hugging Face tensors
of one Megatron tensor reach one owner in one round. Before the checkpoint is opened, what the import would refuse
anyway is refused (refuse_early): an output it may not write, and, with --hf-config, a layout config.json does not
allow.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from distmerge.disjoint_sets import DisjointSets
from distmerge.distributed.comm import Comm
from distmerge.engine.discover import Discovery
from distmerge.engine.inputs import check_inputs, discover_inputs
from distmerge.engine.prepare import OutputSettings
from distmerge.engine.reader import Reader
from distmerge.engine.run import plan_checkpoint, run_rounds
from distmerge.families.base import Unit
from distmerge.families.joined import join_units
from distmerge.formats import registry
from distmerge.formats.registry import HF_MODEL_FILES
from distmerge.importer.discover import Model, Tensor, discover
from distmerge.importer.plan import ImportPlan
from distmerge.importer.read import Files
from distmerge.importer.sink import ImportSink
from distmerge.importer.write import Output, from_folder
from distmerge.input import source as input_source
from distmerge.input.source import Source
from distmerge.output.store import Sharing
from distmerge.report import Progress
from distmerge.threads import one_thread

# The import's plan of a model at one process: its refusals, and which Hugging Face tensors make each Megatron one
PlanOf = Callable[[Model], ImportPlan]
# The merge engine's plan may give any rank any unit, wherever it runs: its output files are never written (sink.py)
ANY_RANK = Sharing(within="any")


class ImportInput(Protocol):
    """Call order, every rank: open (collective) -> the Model; writer(plan, comm) -> write.write_files' `write_mine`
    (collective when called); close, on every path."""

    chooses_makers: bool  # whether the import may say which process makes each tensor's chunks (write.py)

    def open(self, comm: Comm) -> Model: ...

    def writer(self, plan: ImportPlan, comm: Comm) -> Callable[[Output], None]: ...

    def close(self) -> None: ...


def is_checkpoint(src: Source) -> bool:
    """Rank 0: whether the walked input is a training checkpoint that a format detects, not a Hugging Face
    folder."""
    if any(src.is_file(src.root / name) for name in HF_MODEL_FILES):
        return False
    return registry.detect(src) is not None


def open_input(location: Any, hf_config: Path | None, comm: Comm, refuse_early: Callable[[], None],
               plan_of: PlanOf) -> ImportInput:
    """Collective: the input (a folder, an object-store URL, a Source object: input/source.open_source), as rank 0
    finds it, walked once. An input no format detects is left to the folder's discovery, whose refusal says what a
    model folder holds."""
    walked: list[Source] = []

    def look() -> bool:
        src = input_source.open_source(location)
        src.walk()  # one line for an input that is missing, empty, or no folder
        walked.append(input_source.session().use(src))  # errors name its objects by their URLs (comm.py)
        return is_checkpoint(src)

    if comm.root_only(look):
        return CheckpointInput(location, hf_config, refuse_early, plan_of)
    return FolderInput(walked[0] if walked else None)


class FolderInput:
    """A Hugging Face folder, discovered by rank 0 through its walked source (discover.py); the other ranks have
    none, and open its files by the record the Model carries (read.Files)."""

    chooses_makers = True  # the import gives each tensor's chunks to the process it likes (write.py)

    def __init__(self, walked: Source | None) -> None:
        self.walked = walked
        self.files: Files | None = None

    def open(self, comm: Comm) -> Model:
        self.model = comm.root_only(lambda: discover(self.walked))
        return self.model

    def writer(self, plan: ImportPlan, comm: Comm) -> Callable[[Output], None]:
        self.files = Files(self.model)
        return from_folder(plan, self.files, comm)

    def close(self) -> None:
        if self.files is not None:
            self.files.close()


class CheckpointInput:
    """A training checkpoint, read by the merge engine's phases into the import's chunks."""

    chooses_makers = False  # the merge engine hands each unit's tensors to the owner its plan gave it

    def __init__(self, location: Any, hf_config: Path | None, refuse_early: Callable[[], None],
                 plan_of: PlanOf) -> None:
        self.location, self.hf_config, self.refuse_early, self.plan_of = location, hf_config, refuse_early, plan_of
        self.reader: Reader | None = None

    def open(self, comm: Comm) -> Model:
        """Collective: discovery (rank 0), the inventories and the merge plan (every rank, the units joined)."""
        found = comm.root_only(self._discover)
        self.reader = Reader(found.scan, registry.get(found.scan.format))
        self.merge_plan = plan_checkpoint(found, self.reader, comm, OutputSettings(), host=lambda: "",
                                          sharing=ANY_RANK, together=self._together)
        self.model = model_of([t for u in self.merge_plan.units for t in u.targets], found.config,
                              input_source.name_of(self.location))
        return self.model

    def writer(self, plan: ImportPlan, comm: Comm) -> Callable[[Output], None]:
        """The engine's rounds into the import's chunks, torch on one thread: the units are assembled by copies
        (the tensor path), where a second thread only waits beside other busy processes (threads.py)."""
        merge_plan, reader = self.merge_plan, self.reader

        def rounds(out: Output) -> None:
            with one_thread():
                run_rounds(merge_plan, comm, reader, ImportSink(merge_plan, plan, out), Progress(enabled=False))
        return rounds

    def close(self) -> None:
        if self.reader is not None:
            self.reader.close()

    def _discover(self) -> Discovery:
        self.refuse_early()
        return discover_inputs(check_inputs([self.location]), "auto", self.hf_config, {})

    def _together(self, units: list[Unit], config: dict[str, Any]) -> list[Unit]:
        targets = [t for u in units for t in u.targets]
        return together(units, self.plan_of(model_of(targets, config, input_source.name_of(self.location))))


def model_of(targets: list, config: dict[str, Any], root: str) -> Model:
    """The model the merge engine's targets make (the Hugging Face tensors it hands over whole: no file holds
    them, so no file or offset)."""
    tensors = {t.name: Tensor(name=t.name, file="", start=0, dtype=t.dtype, shape=t.shape) for t in targets
               if t.group == "model"}
    return Model(root=root, config=config, tensors=tensors)


def together(units: list[Unit], plan: ImportPlan) -> list[Unit]:
    """The units with those whose targets make one Megatron tensor joined into one (in the place of the first): a
    Megatron legacy save's linear_qkv is one unit already, an FSDP save's q, k and v are three (and a torchtitan
    stacked expert tensor's E experts, E units)."""
    unit_of = {t.name: i for i, u in enumerate(units) for t in u.targets}
    groups = DisjointSets(range(len(units)))
    for made in plan.tensors.values():
        for source in made.sources[1:]:  # a tensor of no source (a torchtitan buffer's init) joins nothing
            groups.join(unit_of[made.sources[0]], unit_of[source])
    joined = {min(g): join_units([units[i] for i in g]) for g in groups.groups() if len(g) > 1}
    apart = {i for g in groups.groups() if len(g) > 1 for i in g}
    return [joined.get(i, u) for i, u in enumerate(units) if i not in apart or i in joined]


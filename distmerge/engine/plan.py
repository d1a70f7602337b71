"""The plan: pure and deterministic, computed identically on every rank from the gathered inventories.

    inventories --merge--> source tensors (coverage checked, one replica chosen per block)
                --family--> units (source names -> target names + transform)
                --split --> output files by size, natural name order, one owner each (bytes balanced)
                --spread--> only when whole files cannot balance the writing: units over the ranks of a host
                            (spread.py), a file then written by several ranks
                --rounds--> per writer, batches of units under the byte budget; round k = every k-th batch;
                            a fold unit over the budget (an average's K inputs of one tensor) is carried over
                            several rounds, each bringing whole groups of its sources (the fold's steps): its
                            owner folds them as they come instead of receiving all K inputs in one round
"""

from __future__ import annotations

import heapq
import math
from collections import defaultdict
from dataclasses import dataclass, field, replace
from functools import cached_property
from operator import attrgetter

from distmerge import dtypes
from distmerge.engine import spread
from distmerge.engine.coverage import check_coverage, tiled_in_order
from distmerge.engine.placement import Placement, owners_near_reads, readers_on_holders
from distmerge.errors import LayoutError
from distmerge.families import transforms
from distmerge.families.base import SourceMeta, Target, Unit
from distmerge.formats.base import Fragment, InputFile
from distmerge.natural_order import natural_key
from distmerge.output.names import GROUP_FILES, model_file_names
from distmerge.output.store import Sharing


@dataclass(frozen=True, kw_only=True)
class SourceTensor:
    meta: SourceMeta
    fragments: tuple[Fragment, ...]  # one per block, replicas removed, covering the tensor exactly
    replicas: tuple[Fragment, ...] = ()  # the other copies of replicated blocks (never read for the output)


@dataclass(frozen=True, kw_only=True)
class OutputFile:
    name: str
    owner: int  # creates the file, renames it into place, records it; writes all of it unless shared
    units: tuple[int, ...]  # indices into Plan.units
    targets: tuple[Target, ...]  # in file order (natural name order)
    group: str = "model"
    writers: tuple[int, ...] = ()  # the ranks writing its units when several do (spread.py); () = the owner

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.targets)

    @property
    def shared(self) -> bool:
        return len(self.writers) > 1


@dataclass(frozen=True, kw_only=True)
class Plan:
    world: int
    readers: tuple[int, ...]  # input file index -> rank that reads it
    sources: dict[str, SourceTensor]
    units: tuple[Unit, ...]
    files: tuple[OutputFile, ...]
    rounds: tuple[tuple[int, ...], ...]  # round -> unit indices (all owners)
    owner_of_unit: tuple[int, ...]
    file_of_unit: tuple[int, ...]
    extra_files: dict[str, dict] = field(default_factory=dict)  # relative path -> JSON, written by finalize
    notes: tuple[str, ...] = ()  # what the family decided (e.g. where a LoRA adapter went)
    config_updates: dict = field(default_factory=dict)  # config.json keys the family sets (written by finalize)
    config_later: dict = field(default_factory=dict)  # config.json keys made as finalize writes it (base.Later)
    # unit -> the sources each of its rounds brings, in round order, for a unit carried over several rounds (rounds
    # lists it in each); any other unit brings all its sources in its one round
    carried: dict[int, tuple[tuple[str, ...], ...]] = field(default_factory=dict)

    def brings(self, k: int) -> tuple[tuple[int, tuple[str, ...]], ...]:
        """Round k's units, each with the sources whose fragments it brings in this round (none past the last)."""
        units = self.rounds[k] if k < len(self.rounds) else ()
        return tuple((i, self._portions.get((k, i), self.units[i].sources)) for i in units)

    def last_round_of(self, unit: int, k: int) -> bool:
        """Whether round k is the last that brings the unit's sources (so its targets are built in it)."""
        j = self._count.get((k, unit))
        return j is None or j == len(self.carried[unit]) - 1

    @cached_property
    def _count(self) -> dict[tuple[int, int], int]:
        """(round, carried unit) -> which of its rounds this is (0, 1, ...): rounds hold each in order."""
        seen: dict[int, int] = defaultdict(int)
        at = {}
        for k, units in enumerate(self.rounds):
            for i in units:
                if i in self.carried:
                    at[(k, i)] = seen[i]
                    seen[i] += 1
        return at

    @cached_property
    def _portions(self) -> dict[tuple[int, int], tuple[str, ...]]:
        return {(k, i): self.carried[i][j] for (k, i), j in self._count.items()}

    @property
    def total_bytes(self) -> int:
        return sum(f.nbytes for f in self.files)

    def written_by(self, rank: int) -> int:
        """Bytes of target this rank writes (its units, in whole or shared files)."""
        return sum(t.nbytes for i, u in enumerate(self.units) if self.owner_of_unit[i] == rank for t in u.targets)

    def crossing(self, placement: Placement, rank: int) -> int:
        """Bytes of source that reach `rank`'s units from readers on other nodes (what crosses the network)."""
        node = placement.node_of_rank[rank]
        return sum(frag.nbytes for i, unit in enumerate(self.units) if self.owner_of_unit[i] == rank
                   for name in unit.sources for frag in self.sources[name].fragments
                   if placement.node_of_rank[self.readers[frag.file_index]] != node)

    @property
    def model_files(self) -> tuple[OutputFile, ...]:
        """The files model.safetensors.index.json covers (not the LoRA adapter)."""
        return tuple(f for f in self.files if f.group == "model")


def assign_readers(files: tuple[InputFile, ...], world: int, placement: Placement | None = None) -> tuple[int, ...]:
    """Each input file is read by exactly one rank; the costliest to read first, onto the least-loaded rank that
    opens fewer than ceil(files / world) + 1 files. With a `placement`, only a rank of a node that holds it."""
    if placement is not None:
        return readers_on_holders(files, world, placement)
    readers = [0] * len(files)
    loads = [(0, r) for r in range(world)]  # a heap of (load, rank): the least-loaded, then lowest, rank first
    most = -(-len(files) // world) + 1  # files one rank may open: uneven weights must not pile small files on one
    count = [0] * world
    for f in sorted(files, key=lambda f: (-f.read_weight, f.index)):
        load, rank = heapq.heappop(loads)
        readers[f.index] = rank
        count[rank] += 1
        if count[rank] < most:  # a full rank leaves the heap
            heapq.heappush(loads, (load + f.read_weight, rank))
    return tuple(readers)


def merge_inventories(fragments: list[Fragment], files: tuple[InputFile, ...]) -> dict[str, SourceTensor]:
    by_name: dict[str, list[Fragment]] = defaultdict(list)
    for frag in fragments:
        by_name[frag.name].append(frag)
    return {name: _merge_one(name, frags, files) for name, frags in sorted(by_name.items())}


def _merge_one(name: str, frags: list[Fragment], files: tuple[InputFile, ...]) -> SourceTensor:
    ordered = sorted(frags, key=attrgetter("file_index"))  # stable: the first of the lowest file comes first
    first = ordered[0]
    if len({(f.global_shape, f.dtype) for f in frags}) > 1:  # one set lookup per fragment; the loop only to word it
        for f in frags:
            if (f.global_shape, f.dtype) != (first.global_shape, first.dtype):
                raise LayoutError(
                    f"{name}: {files[first.file_index].path} has shape {list(first.global_shape)} {first.dtype} but "
                    f"{files[f.file_index].path} has {list(f.global_shape)} {f.dtype}: rank files from different "
                    "models or runs; use one checkpoint's files only"
                )
    blocks: dict[tuple, Fragment] = {}
    replicas = []
    for f in ordered:
        if blocks.setdefault(f.region, f) is not f:  # replicas (HSDP, TP norms): lowest file wins
            replicas.append(f)
    chosen = tuple(blocks[k] for k in sorted(blocks))
    if not tiled_in_order(first.global_shape, chosen):  # the common layouts pass in one step per block
        check_coverage(name, first.global_shape, chosen)
    return SourceTensor(meta=SourceMeta(name=name, dtype=first.dtype, shape=first.global_shape), fragments=chosen,
                        replicas=tuple(replicas))


def split_files(units: list[Unit], max_bytes: int, members: list[int]) -> list[list[int]]:
    """Greedy split of units[members] in natural name order; a unit never straddles two files."""
    order = sorted(members, key=lambda i: natural_key(units[i].targets[0].name))
    groups: list[list[int]] = [[]]
    size = 0
    for i in order:
        nbytes = sum(t.nbytes for t in units[i].targets)
        if groups[-1] and size + nbytes > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(i)
        size += nbytes
    return groups


def assign_owners(sizes: list[int], world: int) -> list[int]:
    """Largest file first onto the rank with the fewest bytes to write."""
    owners = [0] * len(sizes)
    loads = [(0, r) for r in range(world)]  # as in assign_readers: O(files x log N), not O(files x N)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        load, rank = heapq.heappop(loads)
        owners[i] = rank
        heapq.heappush(loads, (load + sizes[i], rank))
    return owners


def make_plan(
    *,
    sources: dict[str, SourceTensor],
    units: list[Unit],
    files: tuple[InputFile, ...],
    world: int,
    max_shard_bytes: int,
    budget_bytes: int,
    extra_files: dict[str, dict] | None = None,
    notes: tuple[str, ...] = (),
    hosts: tuple[int, ...] | None = None,
    sharing: Sharing | None = None,
    placement: Placement | None = None,
) -> Plan:
    """`hosts[r]`: the host of rank r (ranks of one host may share a file); None: all on one host. `sharing`: what
    the output store lets several ranks do with one file (None: a local folder's rule). `placement`: the input on
    the nodes' own disks: each file read on a node that holds it, each output file owned near its reads."""
    model = [i for i, u in enumerate(units) if u.targets[0].group == "model"]
    groups = split_files(units, max_shard_bytes, model) if model else []  # only an adapter: no model files
    names = model_file_names(len(groups))
    for group, name in GROUP_FILES.items():  # each other group is one file of its own
        members = [i for i, u in enumerate(units) if u.targets[0].group == group]
        if members:
            groups.append(split_files(units, 2**62, members)[0])
            names.append(name)
    sizes = [sum(t.nbytes for i in g for t in units[i].targets) for g in groups]
    readers = assign_readers(files, world, placement)
    owners = assign_owners(sizes, world) if placement is None else owners_near_reads(
        sizes, [_node_bytes(g, units, sources, readers, placement) for g in groups], placement.node_of_rank,
        placement.may_own)
    owner_of = [0] * len(units)
    for f, group in enumerate(groups):
        for i in group:
            owner_of[i] = owners[f]
    sharing = sharing or Sharing(within="host")
    if world > 1 and sharing.within != "none" and not spread.balanced(_loads(sizes, owners, world)):
        # on the nodes' own disks, a file is shared only by ranks of its owner's node (the node of its reads)
        owner_of, owners = spread.spread(
            units, groups, [sum(t.nbytes for t in u.targets) for u in units], _local_bytes(units, sources, readers),
            (placement.node_of_rank if placement else hosts) or (0,) * world, min_run=sharing.min_run,
            key=natural_key, host_of_file=[placement.node_of_rank[o] for o in owners] if placement else None)
    out, file_of = [], [0] * len(units)
    for f, group in enumerate(groups):
        targets = sorted((t for i in group for t in units[i].targets), key=lambda t: natural_key(t.name))
        writers = sorted({owner_of[i] for i in group})
        out.append(OutputFile(name=names[f], owner=owners[f], units=tuple(group), targets=tuple(targets),
                              group=units[group[0]].targets[0].group,
                              writers=tuple(writers) if len(writers) > 1 else ()))
        for i in group:
            file_of[i] = f
    rounds, carried = _rounds(units, out, sources, owner_of, world, budget_bytes)
    return Plan(
        world=world,
        readers=readers,
        sources=sources,
        units=tuple(units),
        files=tuple(out),
        rounds=rounds,
        owner_of_unit=tuple(owner_of),
        file_of_unit=tuple(file_of),
        extra_files=extra_files or {},
        notes=notes,
        carried=carried,
    )


def _node_bytes(group: list[int], units: list[Unit], sources: dict[str, SourceTensor], readers: tuple[int, ...],
                placement: Placement) -> dict[int, int]:
    """Bytes of a file's sources each node reads."""
    out: dict[int, int] = defaultdict(int)
    for i in group:
        for name in units[i].sources:
            for frag in sources[name].fragments:
                out[placement.node_of_rank[readers[frag.file_index]]] += frag.nbytes
    return out


def _loads(sizes: list[int], owners: list[int], world: int) -> list[int]:
    loads = [0] * world
    for size, owner in zip(sizes, owners, strict=True):
        loads[owner] += size
    return loads


def _local_bytes(units: list[Unit], sources: dict[str, SourceTensor], readers: tuple[int, ...]) -> list[dict]:
    """Per unit: {rank: bytes of its sources that rank reads}."""
    out = []
    for u in units:
        local: dict[int, int] = defaultdict(int)
        for name in u.sources:
            for frag in sources[name].fragments:
                local[readers[frag.file_index]] += frag.nbytes
        out.append(local)
    return out


def _rounds(units, files, sources, owner_of, world, budget) -> tuple[tuple[tuple[int, ...], ...], dict]:
    """Each writer takes its units in file order in batches whose source bytes fit the budget; a fold unit over the
    budget comes in portions (`portions`), each a batch item of its own. Returns the rounds and the carried units."""
    batches: list[list[list[int]]] = [[] for _ in range(world)]
    filled = [0] * world
    carried: dict[int, tuple[tuple[str, ...], ...]] = {}
    for f in files:
        for i in f.units:
            need = sum(_source_bytes(sources[s].meta) for s in units[i].sources)
            parts = portions(units[i], sources, budget) if need > budget else None
            if parts is not None:
                carried[i] = parts
            owner = owner_of[i]
            mine = batches[owner]
            for part in parts or (units[i].sources,):
                need = sum(_source_bytes(sources[s].meta) for s in part)
                if not mine or filled[owner] + need > budget:
                    mine.append([])
                    filled[owner] = 0
                mine[-1].append(i)
                filled[owner] += need
    depth = max((len(b) for b in batches), default=0)
    return tuple(tuple(i for b in batches if k < len(b) for i in b[k]) for k in range(depth)), carried


def portions(unit: Unit, sources: dict[str, SourceTensor], budget: int) -> tuple[tuple[str, ...], ...] | None:
    """A fold unit's sources in portions of whole groups, in the fold's order, each under the budget but for a group
    over it alone (a source that several groups share comes with the first); None: not a fold, or one portion.
    Consecutive portions together exceed the budget, so no batch holds two of one unit."""
    folded = transforms.folded(unit.transform, unit.params)
    if folded is None:
        return None
    fold, params, _ = folded
    parts: list[list[str]] = [[]]
    brought: set[str] = set()
    size = 0
    for group in fold.groups(**params):
        new = list(dict.fromkeys(unit.sources[j] for j in group if unit.sources[j] not in brought))
        nbytes = sum(_source_bytes(sources[s].meta) for s in new)
        if parts[-1] and size + nbytes > budget:
            parts.append([])
            size = 0
        parts[-1] += new
        brought.update(new)
        size += nbytes
    return tuple(map(tuple, parts)) if len(parts) > 1 else None


def _source_bytes(meta: SourceMeta) -> int:
    return math.prod(meta.shape) * dtypes.itemsize(meta.dtype)


def without_files(plan: Plan, done: list[int]) -> Plan:
    """The same plan minus the work for files already complete (see resume.py)."""
    if not done:
        return plan
    skip = set(done)
    return only_units(plan, {i for i in range(len(plan.units)) if plan.file_of_unit[i] not in skip})


def only_units(plan: Plan, keep: set[int]) -> Plan:
    """The same plan doing the work of the units in `keep` only, in the same rounds (empty ones dropped)."""
    kept = (tuple(i for i in units if i in keep) for units in plan.rounds)
    return replace(plan, rounds=tuple(r for r in kept if r))

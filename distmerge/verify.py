"""`distmerge verify`: compare a merged model with a reference state dict, tensor by tensor.

Every rank makes the same calls in this order (with one process the collectives are no-ops):

    phase    who works                                                  collective
    list     rank 0 reads both sides' indexes and (validated) headers,  broadcast   (comm.root_only)
             pairs the names, settles missing / extra / shape
    compare  each rank reads both sides of the tensors in the merged    all_gather  (comm.gather)
             files it owns (plan.assign_owners over file sizes) and
             computes figures on comm.device; sends small records
    logits   --logits only: rank 0 loads both models with transformers  broadcast   (comm.root_only)
    report   rank 0 prints the table and the verdict, writes --json     broadcast   (comm.root_only)

Neither side is ever loaded whole by one process: safetensors files are opened with `safe_open` and
read one tensor at a time, pytorch_model*.bin with `torch.load(mmap=True, weights_only=True)`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from distmerge import dtypes
from distmerge import plan as planning
from distmerge.comm import Comm, process_group
from distmerge.errors import ConfigError, CorruptInputError, InputError
from distmerge.families.hf import TIED_HEADS, ties_embeddings
from distmerge.formats.safetensors_header import read_header
from distmerge.verify_report import Check, Criteria, Figures, LogitsCheck, judge, print_report, report_json, write_json

# Elements per step of the figures: bounds the float64 temporaries (about 6 x 8 bytes per element).
CHUNK = {"cpu": 2**22, "cuda": 2**26}
TORCH_SUFFIXES = (".bin", ".pt", ".pth")
# (kind, index file, single file), the order Hugging Face prefers them in.
LAYOUTS = (
    ("safetensors", planning.INDEX_NAME, "model.safetensors"),
    ("torch", "pytorch_model.bin.index.json", "pytorch_model.bin"),
)


@dataclass(frozen=True, kw_only=True)
class VerifyOptions:
    merged: Path
    reference: Path
    criteria: Criteria = field(default_factory=Criteria)
    logits: bool = False
    json: Path | None = None
    quiet: bool = False


@dataclass(frozen=True, kw_only=True)
class Loc:
    file: int  # index into Side.files
    dtype: str  # safetensors dtype code
    shape: tuple[int, ...]


@dataclass(frozen=True, kw_only=True)
class Side:
    path: str
    kind: str  # "safetensors" | "torch"
    files: tuple[str, ...]
    sizes: tuple[int, ...]
    tensors: dict[str, Loc]


@dataclass(frozen=True, kw_only=True)
class Pair:
    """Names on both sides with equal shapes: the tensors one rank reads and compares."""

    name: str
    merged_name: str  # differs from `name` only for a tied head: the embedding the model re-uses
    reference_name: str
    note: str = ""


@dataclass(frozen=True, kw_only=True)
class Listing:
    merged: Side
    reference: Side
    ties: bool
    pairs: tuple[Pair, ...]
    settled: tuple[Check, ...]  # decided from the headers alone (missing, extra, shape)


@dataclass(frozen=True, kw_only=True)
class VerifyResult:
    checks: list[Check]
    logits: LogitsCheck | None
    processes: int
    per_rank: list[int]  # tensors each rank compared
    device: str
    seconds: float

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks) and (self.logits is None or self.logits.passed)


# -- the sides -----------------------------------------------------------------------------------------
def open_side(path: Path, *, role: str, allow_torch: bool) -> Side:
    if not path.exists():
        raise InputError(f"{role} {path} does not exist: pass a model folder or a weights file")
    kind, files, weight_map = _folder_layout(path, role, allow_torch) if path.is_dir() else _one_file(path, role)
    if kind == "torch" and not allow_torch:
        raise InputError(f"{role} {path} is not safetensors: distmerge writes model.safetensors files")
    listed = [_list_safetensors(f) if kind == "safetensors" else _list_torch(f) for f in files]
    tensors: dict[str, Loc] = {}
    for i, (f, entries) in enumerate(zip(files, listed, strict=True)):
        for name, (dtype, shape) in entries.items():
            if name in tensors:
                raise CorruptInputError(f"{name} is in both {files[tensors[name].file]} and {f}: use one model's files")
            tensors[name] = Loc(file=i, dtype=dtype, shape=shape)
    if weight_map is not None:
        _check_index(path, files, weight_map, tensors)
    return Side(path=str(path), kind=kind, files=tuple(map(str, files)), sizes=tuple(f.stat().st_size for f in files),
                tensors=tensors)


def _folder_layout(folder: Path, role: str, allow_torch: bool) -> tuple[str, list[Path], dict[str, str] | None]:
    for kind, index, single in LAYOUTS if allow_torch else LAYOUTS[:1]:
        if (folder / index).is_file():
            weight_map = _read_index(folder / index)
            return kind, [folder / f for f in sorted(set(weight_map.values()))], weight_map
        if (folder / single).is_file():
            return kind, [folder / single], None
    if not allow_torch:  # the merged side: distmerge always writes the index, last
        raise InputError(f"{role} {folder} has no {planning.INDEX_NAME}: the merge did not finish; run it again")
    loose = sorted(folder.glob("*.safetensors"))
    if loose:  # sharded without an index: the files together are the model
        return "safetensors", loose, None
    raise InputError(f"{role} {folder} holds no model.safetensors, pytorch_model.bin or index of either: "
                     "pass the folder of a Hugging Face model or one weights file")


def _one_file(path: Path, role: str) -> tuple[str, list[Path], dict[str, str] | None]:
    if path.name.endswith(".index.json"):
        weight_map = _read_index(path)
        kind = "torch" if any(f.endswith(TORCH_SUFFIXES) for f in weight_map.values()) else "safetensors"
        return kind, [path.parent / f for f in sorted(set(weight_map.values()))], weight_map
    if path.suffix == ".safetensors":
        return "safetensors", [path], None
    if path.suffix in TORCH_SUFFIXES:
        return "torch", [path], None
    raise InputError(f"{role} {path}: not a .safetensors, .bin or .index.json file")


def _read_index(path: Path) -> dict[str, str]:
    try:
        weight_map = json.loads(path.read_text())["weight_map"]
    except (ValueError, KeyError, TypeError):
        raise CorruptInputError(f"{path} is not a weights index (JSON with a weight_map)") from None
    ok = isinstance(weight_map, dict) and all(isinstance(v, str) and Path(v).name == v for v in weight_map.values())
    if not ok:
        raise CorruptInputError(f"{path}: weight_map must map tensor names to file names in the same folder")
    missing = sorted({f for f in weight_map.values() if not (path.parent / f).is_file()})
    if missing:
        raise InputError(f"{path} names files that are not there: {', '.join(missing)}; copy them or fix the index")
    return weight_map


def _check_index(path: Path, files: list[Path], weight_map: dict[str, str], tensors: dict[str, Loc]) -> None:
    """The index and the files' own headers must tell the same story, else loaders disagree on the model."""
    for name, file in weight_map.items():
        if name not in tensors or files[tensors[name].file].name != file:
            raise CorruptInputError(f"{path} puts {name} in {file} but that file does not hold it: fix the index")
    unlisted = sorted(set(tensors) - set(weight_map))
    if unlisted:
        raise CorruptInputError(f"{path} does not list {', '.join(unlisted[:5])} that its files hold: fix the index")


def _list_safetensors(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    return {e.name: (e.dtype, e.shape) for e in read_header(path).entries.values()}


def _list_torch(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    return {name: (dtypes.code_of(t.dtype), tuple(t.shape)) for name, t in load_torch(path).items()}


def load_torch(path: Path) -> dict[str, torch.Tensor]:
    """A flat state dict, memory-mapped: a tensor's bytes are read only when it is used."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as err:  # unsafe pickle, legacy (non-zip) format, truncated file
        raise CorruptInputError(f"{path} cannot be loaded safely ({type(err).__name__}): save it with "
                                "torch.save(state_dict) or as safetensors") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise CorruptInputError(f"{path} is not a flat state dict of tensors (name -> tensor)")
    return state


class TensorFiles:
    """Reads one side's tensors by name, keeping each file open (memory-mapped) once it is used."""

    def __init__(self, side: Side) -> None:
        self.side = side
        self._open: dict[int, Any] = {}

    def get(self, name: str) -> torch.Tensor:
        loc = self.side.tensors[name]
        if loc.file not in self._open:
            path = Path(self.side.files[loc.file])
            if self.side.kind == "safetensors":
                from safetensors import safe_open

                self._open[loc.file] = safe_open(path, framework="pt", device="cpu")
            else:
                self._open[loc.file] = load_torch(path)
        handle = self._open[loc.file]
        return handle.get_tensor(name) if self.side.kind == "safetensors" else handle[name]

    def close(self) -> None:
        self._open.clear()  # safe_open handles and mmaps close when dropped


# -- pairing (rank 0, headers only) --------------------------------------------------------------------
def make_listing(opts: VerifyOptions) -> Listing:
    merged = open_side(opts.merged, role="merged model", allow_torch=False)
    reference = open_side(opts.reference, role="reference", allow_torch=True)
    ties = _merged_ties(opts.merged / "config.json" if opts.merged.is_dir() else opts.merged.parent / "config.json")
    pairs, settled = [], []
    for name in sorted(set(merged.tensors) | set(reference.tensors), key=planning.natural_key):
        pair = _pair(name, merged, reference, ties)
        if isinstance(pair, Check):
            settled.append(pair)
            continue
        m, r = merged.tensors[pair.merged_name], reference.tensors[pair.reference_name]
        if m.shape == r.shape:
            pairs.append(pair)
        else:
            settled.append(_settled(name, merged, reference, "shape", _shape_reason(m.shape, r.shape), pair))
    return Listing(merged=merged, reference=reference, ties=ties, pairs=tuple(pairs), settled=tuple(settled))


def _merged_ties(path: Path) -> bool:
    """No config.json: nothing says the head is tied, so a missing head is reported as missing."""
    if not path.is_file():
        return False
    try:
        config = json.loads(path.read_text())
    except ValueError:
        raise ConfigError(f"{path} is not valid JSON: fix it or copy the training run's config.json") from None
    return isinstance(config, dict) and ties_embeddings(config)


def _pair(name: str, merged: Side, reference: Side, ties: bool) -> Pair | Check:
    in_m, in_r = name in merged.tensors, name in reference.tensors
    if in_m and in_r:
        return Pair(name=name, merged_name=name, reference_name=name)
    embed = TIED_HEADS.get(name)
    why = "merged config.json ties embeddings; the model re-creates the head from"
    if ties and embed and in_r and embed in merged.tensors:
        return Pair(name=name, merged_name=embed, reference_name=name,
                    note=f"tied head: {why} {embed}; compared reference {name} with merged {embed}")
    if ties and embed and in_m and embed in reference.tensors:
        return Pair(name=name, merged_name=name, reference_name=embed,
                    note=f"tied head: {why} {embed}; compared merged {name} with reference {embed}")
    outcome = "missing in merged" if in_r else "extra in merged"
    return _settled(name, merged, reference, outcome, outcome, None)


def _settled(name: str, merged: Side, reference: Side, outcome: str, reason: str, pair: Pair | None) -> Check:
    m = merged.tensors.get(pair.merged_name if pair else name)
    r = reference.tensors.get(pair.reference_name if pair else name)
    return Check(
        name=name, passed=False, outcome=outcome, reason=reason,
        file=Path(merged.files[m.file]).name if m else None,
        shape=m.shape if m else None, reference_shape=r.shape if r else None,
        dtype=m.dtype if m else None, reference_dtype=r.dtype if r else None, note=pair.note if pair else "",
    )


def _shape_reason(shape: tuple[int, ...], ref: tuple[int, ...]) -> str:
    transposed = " (transposed)" if len(shape) == 2 and shape == ref[::-1] else ""
    return f"shape {list(shape)}, reference {list(ref)}{transposed}"


# -- comparing (each rank, the merged files it owns) ---------------------------------------------------
def check_mine(listing: Listing, crit: Criteria, comm: Comm) -> list[Check]:
    owners = planning.assign_owners(list(listing.merged.sizes), comm.world)
    mine = [p for p in listing.pairs if owners[listing.merged.tensors[p.merged_name].file] == comm.rank]
    merged, reference = TensorFiles(listing.merged), TensorFiles(listing.reference)
    try:
        return [compare(p, merged, reference, crit, comm.device) for p in mine]
    finally:
        merged.close()
        reference.close()


def compare(pair: Pair, merged: TensorFiles, reference: TensorFiles, crit: Criteria, device: torch.device) -> Check:
    m = merged.get(pair.merged_name).to(device)
    r = reference.get(pair.reference_name).to(device)
    dtype, ref_dtype = dtypes.code_of(m.dtype), dtypes.code_of(r.dtype)
    cast = None
    if m.dtype != r.dtype:  # explicit, and said in the report: compare what the merged dtype can hold
        r, cast = r.to(m.dtype), f"{ref_dtype}->{dtype}"
    exact = torch.equal(m, r)
    figs = figures(m, r, *crit.band())
    passed, outcome, reason = judge(dtype=dtype, ref_dtype=ref_dtype, exact=exact, figs=figs, crit=crit)
    if pair.note and not passed:
        reason += f" (the merged model's head is {pair.merged_name}, tied)"
    return Check(
        name=pair.name, passed=passed, outcome=outcome, reason=reason,
        file=Path(merged.side.files[merged.side.tensors[pair.merged_name].file]).name,
        shape=tuple(m.shape), reference_shape=tuple(r.shape), dtype=dtype, reference_dtype=ref_dtype,
        cast=cast, bit_exact=exact, note=pair.note, figures=figs,
    )


def figures(m: torch.Tensor, r: torch.Tensor, atol: float, rtol: float) -> Figures:
    """All figures in one pass over fixed-size chunks. Accumulates in float64 on the CPU; float32 on a
    GPU, where float64 is slow and the sums are tree reductions anyway."""
    on_cpu = m.device.type == "cpu"
    acc = torch.float64 if on_cpu else torch.float32
    step = CHUNK["cpu" if on_cpu else "cuda"]
    a_all, b_all = m.reshape(-1), r.reshape(-1)
    n = a_all.numel()
    # max abs diff, max rel diff, max |ref|  |  sum |diff|, sum a*b, sum a*a, sum b*b
    peaks = torch.zeros(3, dtype=acc, device=m.device)
    sums = torch.zeros(4, dtype=acc, device=m.device)
    outside = torch.zeros((), dtype=torch.int64, device=m.device)
    for start in range(0, n, step):
        a, b = a_all[start : start + step].to(acc), b_all[start : start + step].to(acc)
        diff, ref_abs = (a - b).abs(), b.abs()
        rel = torch.where(ref_abs > 0, diff / ref_abs, 0)  # where, not indexing: no device sync
        peaks = torch.maximum(peaks, torch.stack([diff.max(), rel.max(), ref_abs.max()]))  # NaN propagates
        sums += torch.stack([diff.sum(), (a * b).sum(), (a * a).sum(), (b * b).sum()])
        outside += (~torch.isclose(a, b, rtol=rtol, atol=atol, equal_nan=True)).sum()
    (max_abs, max_rel, max_ref), (sum_abs, dot, aa, bb) = peaks.tolist(), sums.tolist()
    return Figures(max_abs=max_abs, max_rel=max_rel, mean_abs=sum_abs / max(n, 1), cosine=_cosine(dot, aa, bb),
                   max_ref=max_ref, outside=int(outside.item()))


def _cosine(dot: float, aa: float, bb: float) -> float:
    if aa == 0 or bb == 0:
        return 1.0 if aa == bb else 0.0  # both all-zero (fresh biases): the same as far as a model cares
    return max(-1.0, min(1.0, dot / (aa**0.5 * bb**0.5)))  # rounding can step just past 1


# -- the run -------------------------------------------------------------------------------------------
def verify(opts: VerifyOptions, comm: Comm) -> VerifyResult:
    """Collective: every rank calls it and gets the same result."""
    start = time.perf_counter()
    listing = comm.root_only(lambda: make_listing(opts))
    per_rank = comm.gather(lambda: check_mine(listing, opts.criteria, comm))
    checks = sorted([*listing.settled, *(c for mine in per_rank for c in mine)],
                    key=lambda c: planning.natural_key(c.name))
    logits = None
    if opts.logits:
        from distmerge.verify_logits import compare_logits

        logits = comm.root_only(lambda: compare_logits(listing, opts, comm.device))
    return VerifyResult(checks=checks, logits=logits, processes=comm.world, per_rank=[len(c) for c in per_rank],
                        device=str(comm.device), seconds=time.perf_counter() - start)


def verify_and_report(opts: VerifyOptions, comm: Comm) -> int:
    """Collective: verify, then rank 0 prints and writes the report. Returns the exit status (same on all)."""
    result = verify(opts, comm)

    def report() -> None:
        print_report(result.checks, result.logits, quiet=opts.quiet)
        if opts.json is not None:
            run = {"processes": result.processes, "compared_per_rank": result.per_rank, "device": result.device,
                   "seconds": round(result.seconds, 3)}
            write_json(opts.json, report_json(merged=str(opts.merged), reference=str(opts.reference),
                                              crit=opts.criteria, checks=result.checks, logits=result.logits, run=run))
        sys.stdout.flush()  # before the other ranks go on: torchrun stops rank 0 when another rank exits 1

    comm.root_only(report)
    return 0 if result.passed else 1


def run_verify(args: argparse.Namespace) -> int:
    """`distmerge verify`: under torchrun or alone."""
    from distmerge.engine import resolve_device

    crit = Criteria(atol=args.atol, rtol=args.rtol, min_cosine=args.min_cosine)
    opts = VerifyOptions(merged=args.merged, reference=args.reference, criteria=crit, logits=args.logits,
                         json=args.json, quiet=args.quiet)
    with process_group(device=resolve_device(args.device), timeout_s=args.timeout) as comm:
        return verify_and_report(opts, comm)

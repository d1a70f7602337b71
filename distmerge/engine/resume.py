"""Resume: keep the output files an interrupted merge finished, redo only the rest, and say why.

Two kinds of record in OUT/.distmerge/:
    run.json    the owner of the first file a run finishes writes it, before that file's record: the plan's
                fingerprint and what it is made of (the options that shape the output, each input file's size
                and mtime), so that a later --resume can name what differs
    NAME.json   a file's owner writes it right after renaming the file into place: the fingerprint, the
                file's size, its tensors and, with --checksum, its sha256

Order of calls (`start`, every rank): each rank checks the files it owns in this run (so hashing is shared),
all_gather of the checks; rank 0 decides and prepares the output, broadcast of the decision.

A file is kept when its record carries the current fingerprint, its size and header bytes are the planned
ones and, if its record has a sha256, the file still hashes to it. If every file is kept, the index is
there and run.json has the current fingerprint, the merge is already complete and nothing is written.
Otherwise the index goes first, kept files' records are brought to this run's --checksum (a sha256 for every
file or for none) and the rest is merged again: output, records and manifest are byte-identical to an
uninterrupted run of the same command.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from typing import Any

from distmerge import output_options as declared
from distmerge.distributed.comm import Comm
from distmerge.engine.plan import OutputFile, Plan
from distmerge.engine.prepare import OutputSettings
from distmerge.errors import OutputError
from distmerge.formats import registry
from distmerge.formats.base import InputFile
from distmerge.output import read_json
from distmerge.output.names import INDEX_NAME, MANIFEST, RECORDS, RUN_RECORD, record_name
from distmerge.output.store import Store
from distmerge.output.writer import header_bytes

# Beside the index, what a finished merge has written (finalize writes them before the index).
FINISHED_MARKS = (INDEX_NAME, MANIFEST, "config.json")
NAMED_INPUTS = 3  # a message names at most this many changed input files


@dataclass(frozen=True, kw_only=True)
class RunRecord:
    """What shaped the output: saved as run.json so that --resume can say what changed."""

    fingerprint: str
    options: dict[str, Any]  # by the flag a user would change; config.json by a digest of its content
    inputs: dict[str, list[int]]  # input path -> [size, mtime_ns]


@dataclass(frozen=True, kw_only=True)
class FileCheck:
    """One planned file, as its owner found it in the output."""

    index: int
    record: dict[str, Any] | None = None  # kept: its record as this run writes it; None: redo the file
    rewrite: bool = False  # the record on disk differs from `record` (a sha256 to add or drop)
    stale: bool = False  # its record is of this run's fingerprint, but the file changed since


@dataclass(frozen=True, kw_only=True)
class Resumption:
    """Rank 0's decision, the same on every rank."""

    kept: tuple[int, ...] = ()  # planned files not to write again
    complete: bool = False  # nothing to do: the output is this very merge, finished
    line: str = ""  # what --resume found and does, in one line (empty without --resume)


def output_options(settings: OutputSettings, fmt: str, format_options: dict[str, Any], config: dict) -> dict:
    """What shapes the output besides the input files, named as the user would change it: the options declared in
    output_options.py, each as it records itself (aliases that give the same output alike: --dtype bf16 and
    bfloat16), the format (--format auto as what it found), config.json and the format's options. The options
    recorded only when given come last (--quantize: absent before it existed)."""
    flags = {opt.flag: format_options[opt.dest] for opt, _ in registry.options() if opt.dest in format_options}
    options = {
        "--format": fmt,
        **declared.recorded(settings, "always"),
        "config.json": hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest(),
        **flags,
        **declared.recorded(settings, "given"),
    }
    return json.loads(json.dumps(options, default=str))  # as run.json will read back


def fingerprint(plan: Plan, inputs: tuple[InputFile, ...], options: dict) -> str:
    digest = hashlib.sha256()
    digest.update(json.dumps([asdict(f) for f in inputs], sort_keys=True).encode())
    digest.update(json.dumps(options, sort_keys=True, default=str).encode())
    for f in plan.files:
        digest.update(f.name.encode())
        digest.update(header_bytes(f.targets)[0])
    return digest.hexdigest()


def describe(plan: Plan, inputs: tuple[InputFile, ...], options: dict) -> RunRecord:
    return RunRecord(fingerprint=fingerprint(plan, inputs, options), options=options,
                     inputs={_input_name(f): [f.size, f.mtime_ns] for f in inputs})


def _input_name(file: InputFile) -> str:
    """An input file as run.json names it: its path in the input, or in its own folder (--base-model, an
    average's other inputs: two inputs may hold files of one name)."""
    return f"{file.root}/{file.path}" if file.root else file.path


def record_done(store: Store, file: OutputFile, run: RunRecord, checksum: bool) -> None:
    """Called by the owner right after the file is committed. The first file this run finishes also brings
    run.json to this run, so a run that finished nothing leaves nothing behind."""
    size, planned = store.size(file.name), len(header_bytes(file.targets)[0]) + file.nbytes
    if size != planned:  # the store made something else of it (a part lost on the way): never recorded as done
        raise OutputError(f"{store.url}: {file.name} holds {size} bytes once committed, not the {planned} written: "
                          "the store lost part of it; run the same command with --resume")
    _record_run(store, file, run)
    record = {"fingerprint": run.fingerprint, "name": file.name, "bytes": size,
              "tensors": [t.name for t in file.targets]}
    if checksum:
        record["sha256"] = store.sha256(file.name)
    _write_record(store, file.name, record)


def _record_run(store: Store, file: OutputFile, run: RunRecord) -> None:
    """Owners race here with the same content: each writes from its own temporary name (one per file)."""
    if (read_json(store, RUN_RECORD) or {}).get("fingerprint") == run.fingerprint:
        return
    temp = record_name(file.name).removesuffix(".json") + ".run.partial"
    store.write_small(RUN_RECORD, (json.dumps(asdict(run), indent=1) + "\n").encode(), temp=temp)


def start(store: Store, plan: Plan, run: RunRecord, comm: Comm, *, resuming: bool, checksum: bool) -> Resumption:
    """Every rank, before any output file is written: which files to keep (only with --resume)."""
    checks = comm.gather(lambda: check_own_files(store, plan, run.fingerprint, comm.rank, checksum)
                         if resuming else [])
    found = sorted((c for part in checks for c in part), key=lambda c: c.index)
    return comm.root_only(lambda: _begin(store, plan, run, found, resuming, checksum))


def check_own_files(store: Store, plan: Plan, fp: str, rank: int, checksum: bool) -> list[FileCheck]:
    return [_check(store, i, f, fp, checksum) for i, f in enumerate(plan.files) if f.owner == rank]


def _check(store: Store, index: int, file: OutputFile, fp: str, checksum: bool) -> FileCheck:
    record = read_json(store, record_name(file.name))
    if record is None or record.get("fingerprint") != fp:
        return FileCheck(index=index)
    if not _intact(store, file, record):
        return FileCheck(index=index, stale=True)
    wanted = dict(record)
    if checksum and "sha256" not in wanted:  # hashed now: the manifest has a sha256 for every file or none
        wanted["sha256"] = store.sha256(file.name)
    elif not checksum:
        wanted.pop("sha256", None)
    return FileCheck(index=index, record=wanted, rewrite=wanted != record)


def _intact(store: Store, file: OutputFile, record: dict) -> bool:
    head = header_bytes(file.targets)[0]
    if store.size(file.name) != len(head) + file.nbytes:
        return False
    if store.read_range(file.name, 0, len(head)) != head:
        return False
    return "sha256" not in record or record["sha256"] == store.sha256(file.name)


def _begin(store: Store, plan: Plan, run: RunRecord, found: list[FileCheck], resuming: bool,
           checksum: bool) -> Resumption:
    """Rank 0: decide; unless the merge is already complete, mark the output unfinished (run.json is this run's
    once it finishes a file: until then it describes the run that wrote the kept files)."""
    kept = tuple(c.index for c in found if c.record is not None)
    earlier = _read_run(store)
    if resuming and _complete(store, plan, run, found, earlier, checksum):
        return Resumption(kept=kept, complete=True, line=f"resume: {store.url} is already complete (same input and "
                          f"options, all {len(plan.files)} file(s) checked): nothing to do, nothing rewritten")
    finished = store.size(INDEX_NAME) is not None
    store.remove(INDEX_NAME)  # from here on this output is unfinished
    for c in found:
        if c.record is not None and c.rewrite:
            _write_record(store, plan.files[c.index].name, c.record)
    before = "the finished run" if finished else "the interrupted run"
    return Resumption(kept=kept, line=explain(plan, run, earlier, found, before) if resuming else "")


def _complete(store: Store, plan: Plan, run: RunRecord, found: list[FileCheck], earlier: RunRecord | None,
              checksum: bool) -> bool:
    every_file = len(found) == len(plan.files) and all(c.record is not None for c in found)
    hashes_missing = checksum and any(c.rewrite for c in found)  # --checksum asks for more than is there
    return (every_file and not hashes_missing and earlier is not None and earlier.fingerprint == run.fingerprint
            and all(store.size(name) is not None for name in FINISHED_MARKS))


def explain(plan: Plan, run: RunRecord, earlier: RunRecord | None, found: list[FileCheck],
            before: str = "the interrupted run") -> str:
    """One line: what differs from the run `before`, what is kept, what is done again."""
    total, kept = len(plan.files), sum(c.record is not None for c in found)
    if earlier is not None and earlier.fingerprint != run.fingerprint:
        what = differences(earlier, run) or ["the planned output (another distmerge version?)"]
        verb = "differs" if len(what) == 1 else "differ"
        redo = f"redoing all {total} file(s)" if not kept else f"keeping {kept} that match, redoing {total - kept}"
        return f"resume: {', '.join(what)} {verb} from {before}: {redo}"
    if earlier is None and not kept:
        return f"resume: no record of an earlier merge in this output: merging all {total} file(s)"
    line = f"resume: kept {kept} of {total} file(s) {before} wrote, redoing {total - kept}"
    if stale := sum(c.stale for c in found):
        line += f" ({stale} of them changed or gone since written)"
    if hashed := sum(c.rewrite and "sha256" in c.record for c in found if c.record is not None):
        line += f"; hashed {hashed} kept file(s) for --checksum"
    return line


def differences(earlier: RunRecord, now: RunRecord) -> list[str]:
    """The options, then the input files, that differ: `--dtype (keep -> bfloat16)`, `input a.pt (changed)`."""
    said = []
    for key in dict.fromkeys([*now.options, *earlier.options]):
        was, is_ = earlier.options.get(key, "unset"), now.options.get(key, "unset")
        if was != is_:
            said.append(f"{key} ({_shown(was)} -> {_shown(is_)})" if key.startswith("--") else f"{key} (changed)")
    old, new = earlier.inputs, now.inputs
    for how, paths in (("changed", [p for p in new if p in old and old[p] != new[p]]),
                       ("new", [p for p in new if p not in old]), ("gone", [p for p in old if p not in new])):
        if paths:
            more = f" and {len(paths) - NAMED_INPUTS} more" if len(paths) > NAMED_INPUTS else ""
            said.append(f"input {', '.join(paths[:NAMED_INPUTS])}{more} ({how})")
    return said


def _shown(value: Any) -> str:
    return "unset" if value is None else str(value)


def write_manifest(store: Store, plan: Plan) -> None:
    """Per file: tensors, bytes and (with --checksum) sha256, from the owners' records. Records of files this
    merge does not have (an earlier, differently split run's, removed by finalize) go too."""
    planned = {record_name(f.name) for f in plan.files} | {RUN_RECORD}
    for name in store.list(f"{RECORDS}/*.json"):
        if name not in planned:
            store.remove(name)
    files = []
    for f in plan.files:
        record = json.loads(store.read(record_name(f.name)) or b"")
        record.pop("fingerprint", None)
        files.append(record)
    store.write_small(MANIFEST, (json.dumps({"files": files}, indent=1) + "\n").encode())


def _write_record(store: Store, name: str, record: dict) -> None:
    store.write_small(record_name(name), (json.dumps(record, indent=1) + "\n").encode())


def _read_run(store: Store) -> RunRecord | None:
    data = read_json(store, RUN_RECORD)
    try:
        return RunRecord(**data) if data is not None else None
    except TypeError:  # another distmerge version's run.json
        return None


"""Hostile pickles and zips in every place distmerge reads a pickle: refused by budget, never run, never
expanded (issue #17's pickle/zip part; #16's "never runs code" for every reader).

Each payload of tests/hostile_pickles.py is planted into a copy of a real fixture file in each reader's
place and the reader is called in a forked child under a 10 s CPU limit and an address-space limit, so a
payload that still works shows up as a crash, a timeout or a memory blow-up of that child, not of pytest.
A representative subset runs the whole `python -m distmerge merge` (or verify) in a subprocess with
RLIMIT_CPU 10 s and RLIMIT_AS 2 GiB.

Shown to fail (each by a pytest plugin or a temporary edit, then restored):
- `pickle_scan.check` made a no-op: 48 reader cases fail (deep nesting, huge memo, shared tuples in every
  place; bytearray, storages cut short or offset past their record under torch.load; every payload in the
  verify reference, whose torch.load message names no limit);
- zip_records.records without its stored-only and disjointness checks: the 10 deflate-bomb and
  overlapping-records cases of the zip places fail;
- Restricted.find_class probing `getattr(torch, name)` again, with the scan off:
  test_refusing_a_torch_name_imports_nothing fails ("inductor imported: True").
"""

from __future__ import annotations

import hashlib
import json
import os
import resource
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from distmerge.errors import CorruptInputError
from distmerge.formats.deepspeed import folder as deepspeed
from distmerge.formats.torch_private import dcp, restricted, state_dicts, torch_save
from distmerge.input import source
from distmerge.verifier import sides
from tests import hostile_pickles as hp
from tests.conftest import REPO, assert_exact, load_merged, merge_inproc, reference_dir
from tests.helpers.child import CPU_LIMIT_S, EXPECTED, MEMORY_LIMIT, RSS_LIMIT, in_child


@dataclass(frozen=True)
class Place:
    """Where a reader finds a pickle: the fixture family, the file inside the case, how it is read."""

    family: str
    case: str
    file: str  # glob inside the case folder
    read: Callable[[Path], object]
    zip: bool = True  # a torch.save archive (else a bare pickle: DCP .metadata)


def _read_ds(path: Path) -> object:
    return torch_save.read(source.of(path), path, deepspeed.INERT)


def _by_path(read: Callable[..., object]) -> Callable[[Path], object]:
    """A reader of the formats (which read through the input's source) called with a path alone."""
    return lambda path: read(source.of(path), path)


_BLOB: dict[str, dcp.Chunk] = {}  # the real chunk whose blob the "dcp chunk blob" place rewrites


def _read_blob(path: Path) -> object:
    """The rewritten blob placed inside a .distcp, located as DcpFormat.open locates a chunk's bytes."""
    real = _BLOB["chunk"]
    blob = path.read_bytes()
    distcp = path.with_suffix(".distcp")
    distcp.write_bytes(bytes(100) + blob)
    chunk = dcp.Chunk(fqn=real.fqn, dtype=real.dtype, global_shape=real.global_shape, offsets=real.offsets,
                      lengths=real.lengths, file=str(path), offset=100, length=len(blob))
    fd = os.open(distcp, os.O_RDONLY)
    try:
        return dcp.chunk_data_offset(fd, chunk, real.dtype.itemsize)
    finally:
        os.close(fd)


PLACES = {
    "fsdp rank file": Place("fsdp", "fsdp2_llama_w2", "model_world_size_2_rank_1.pt",
                                _by_path(state_dicts.read_rank_file)),
    "megatron legacy": Place("megatron", "megatron_tp2", "iter_*/mp_rank_01/model_optim_rng.pt",
                                 _by_path(torch_save.read)),
    "deepspeed model states": Place("deepspeed", "ds_z2_fp32_w2", "global_step*/*model_states.pt",
                                    _read_ds),
    "deepspeed optim states": Place("deepspeed", "ds_z2_fp32_w2", "global_step*/*rank_1_*optim_states.pt", _read_ds),
    "dcp .metadata": Place("dcp", "dcp_llama_w2", ".metadata", _by_path(dcp.read_metadata), zip=False),
    "torch_dist .metadata": Place("megatron", "megatron_dist_tp2", "iter_*/.metadata", _by_path(dcp.read_metadata),
                                  zip=False),
    "torchtitan .metadata": Place("torchtitan", "tt_llama3_mha_w2", "checkpoint/step-*/.metadata",
                                  _by_path(dcp.read_metadata), zip=False),
    "verify .bin reference": Place("fsdp", "fsdp2_llama_w2", "pytorch_model.bin", sides.load_torch),
    "dcp chunk blob": Place("dcp", "dcp_llama_w2", "chunk.pt", _read_blob),
}
# A chunk blob is located by walking its local headers in order (records cannot overlap there), and its
# pickle must hold a tensor of the chunk's shape (a hand-made one is refused for that first).
BLOB_SKIPS = {"overlapping records", "storage offset past its record"}
CASES = [(place, payload) for place in PLACES for payload in hp.PICKLES] + [
    (place, payload) for place, p in PLACES.items() if p.zip for payload in hp.ZIPS
    if not (place == "dcp chunk blob" and payload in BLOB_SKIPS)]


@pytest.fixture(scope="module")
def sources(request, tmp_path_factory) -> dict[str, Path]:
    """The real file in each place (verify's reference: the fixture's reference saved as pytorch_model.bin)."""
    out = {}
    for name, place in PLACES.items():
        case = request.getfixturevalue(f"{_FIXTURES[place.family]}")[place.case]
        if name == "verify .bin reference":
            path = tmp_path_factory.mktemp("bin") / "pytorch_model.bin"
            torch.save(load_file(reference_dir(case) / "model.safetensors"), path)
            out[name] = path
        elif name == "dcp chunk blob":
            _BLOB["chunk"] = chunk = max(_by_path(dcp.read_metadata)(case / ".metadata").chunks,
                                         key=lambda c: c.length)
            out[name] = tmp_path_factory.mktemp("blob") / "chunk.pt"
            with open(case / chunk.file, "rb") as f:
                f.seek(chunk.offset)
                out[name].write_bytes(f.read(chunk.length))
        else:
            out[name] = max(case.glob(place.file))
    return out


_FIXTURES = {"fsdp": "fsdp_ckpts", "megatron": "megatron_ckpts", "deepspeed": "ds_ckpts", "dcp": "dcp_ckpts",
             "torchtitan": "tt_ckpts"}


def plant(payload: str, source: Path, dst: Path, marker: Path, is_zip: bool) -> None:
    if payload in hp.ZIPS:
        hp.ZIPS[payload](source, dst)
    elif is_zip:
        hp.with_pickle(source, dst, hp.PICKLES[payload](marker))
    else:
        dst.write_bytes(hp.PICKLES[payload](marker))


@pytest.mark.parametrize(("place", "payload"), CASES, ids=[f"{p}-{q}" for p, q in CASES])
def test_reader_refuses(place, payload, sources, tmp_path):
    """Every reader refuses every hostile payload in its place: one CorruptInputError line that names the
    file and the limit or global; nothing ran (no marker), within the CPU and memory limits."""
    marker = tmp_path / "distmerge-was-here"
    target = tmp_path / "input" / sources[place].name
    target.parent.mkdir()
    plant(payload, sources[place], target, marker, PLACES[place].zip)
    result = in_child(lambda: PLACES[place].read(target))
    assert result["signal"] == 0, result
    assert result["raised"] == CorruptInputError.__name__, result
    message = result["message"]
    assert "\n" not in message and str(target) in message, message
    assert any(words in message for words in EXPECTED[payload]), message
    assert result["cpu_s"] < CPU_LIMIT_S and result["rss_above"] < RSS_LIMIT, result
    assert not marker.exists()


def test_rewritten_archives_still_read(sources, tmp_path):
    """The generator's zip writer makes archives the readers accept when nothing hostile is in them, so each
    refusal above is about the payload, not about the writer."""
    for name, place in PLACES.items():
        if place.zip:
            hp.write_zip(tmp_path / sources[name].name, hp.records_of(sources[name]))
            place.read(tmp_path / sources[name].name)
    assert _read_blob(sources["dcp chunk blob"]) >= 100


def test_refusing_a_torch_name_imports_nothing(sources, tmp_path):
    """GLOBAL torch._inductor is refused by name in every reader: torch's lazy __getattr__ never runs, so
    torch._inductor is not imported (checked in a fresh interpreter, where nothing else imported it)."""
    files = {}
    for name in ("fsdp rank file", "megatron legacy", "dcp .metadata"):
        files[name] = tmp_path / name.replace(" ", "_") / sources[name].name
        files[name].parent.mkdir()
        plant("torch lazy attribute", sources[name], files[name], tmp_path / "m", PLACES[name].zip)
    script = (
        "import sys\n"
        "from pathlib import Path\n"
        "from distmerge.formats.torch_private import dcp, state_dicts, torch_save\n"
        "from distmerge.input import source\n"
        f"files = {{k: Path(v) for k, v in {json.dumps({k: str(v) for k, v in files.items()})}.items()}}\n"
        "for read, key in ((state_dicts.read_rank_file, 'fsdp rank file'), (torch_save.read, 'megatron legacy'),\n"
        "                  (dcp.read_metadata, 'dcp .metadata')):\n"
        "    try:\n"
        "        read(source.of(files[key]), files[key])\n"
        "    except Exception as err:\n"
        "        print(type(err).__name__, err)\n"
        "print('inductor imported:', 'torch._inductor' in sys.modules)\n"
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, timeout=120)
    lines = run.stdout.splitlines()
    assert run.returncode == 0, run.stderr[-2000:]
    assert sum("torch._inductor is not allowed" in line for line in lines) == 3, lines
    assert lines[-1] == "inductor imported: False", lines


def test_inert_text_takes_only_scalars():
    """A device or path rebuilt from anything but strings and ints is refused, not str()-ed (the str of a
    shared tuple is exponential)."""
    assert restricted.as_text("cuda", 0) == "cuda/0"
    with pytest.raises(Exception, match="strings and ints"):
        restricted.as_text(((), ()))


# -- whole runs: python -m distmerge in a subprocess ---------------------------------------------------------
RUNS = [  # (place, payload): a representative subset (each run imports torch: ~3 s of CPU)
    ("fsdp rank file", "os.system"), ("megatron legacy", "deep nesting"), ("dcp .metadata", "shared tuple key"),
    ("verify .bin reference", "bytearray 2 GiB"),
]


def _hf_config(family: str, case: Path) -> tuple[str, ...]:
    """Megatron saves carry no config.json: the fixtures keep it beside the reference."""
    return ("--hf-config", str(reference_dir(case) / "huggingface")) if family == "megatron" else ()


def tree_digest(root: Path) -> dict[str, str]:
    """Every file, folder and link under root (lstat, never followed) with its content hash or target."""
    out = {}
    for path in sorted(root.rglob("*")):
        rel = str(path.relative_to(root))
        if path.is_symlink():
            out[rel] = "link:" + os.readlink(path)
        elif path.is_dir():
            out[rel] = "dir"
        else:
            out[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def run_limited(*args: str, wall_s: float = 180) -> tuple[int, str, float, int]:
    """`python -m distmerge ARGS` under RLIMIT_CPU 10 s and RLIMIT_AS 2 GiB: exit code, stderr, CPU seconds
    and peak RSS of that process (os.wait4: its own rusage, not all children's)."""

    def limits() -> None:
        resource.setrlimit(resource.RLIMIT_CPU, (CPU_LIMIT_S, CPU_LIMIT_S))
        resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen([sys.executable, "-m", "distmerge", *args], stdout=subprocess.DEVNULL, stderr=err,
                                text=True, cwd=REPO, env=env, preexec_fn=limits)
        deadline = time.monotonic() + wall_s  # wall time on a shared machine; the CPU limit is the real one
        while (waited := os.wait4(proc.pid, os.WNOHANG))[0] == 0:
            if time.monotonic() > deadline:
                proc.kill()
                waited = os.wait4(proc.pid, 0)
                break
            time.sleep(0.05)
        proc.returncode = os.waitstatus_to_exitcode(waited[1])
        err.seek(0)
        usage = waited[2]
        return proc.returncode, err.read(), usage.ru_utime + usage.ru_stime, usage.ru_maxrss * 1024


@pytest.mark.parametrize(("place", "payload"), RUNS, ids=[f"{p}-{q}" for p, q in RUNS])
def test_whole_run_refuses(place, payload, sources, request, tmp_path):
    """A merge (or verify) of a copy of the real fixture with the payload planted: exit 1, one
    `distmerge: error:` line naming the file, no traceback, no marker, the input tree unchanged, no index."""
    spec = PLACES[place]
    marker = tmp_path / "distmerge-was-here"
    if place == "verify .bin reference":
        ckpt = tmp_path / "reference"
        ckpt.mkdir()
        target = ckpt / "pytorch_model.bin"
        merged = reference_dir(request.getfixturevalue("fsdp_ckpts")[spec.case])
        args = ("verify", "--merged", str(merged), "--reference", str(target))
    else:
        case = request.getfixturevalue(_FIXTURES[spec.family])[spec.case]
        ckpt = tmp_path / "input"
        shutil.copytree(case, ckpt, symlinks=True)
        target = ckpt / sources[place].relative_to(case)
        args = ("merge", "--input", str(ckpt), "--output", str(tmp_path / "out"), *_hf_config(spec.family, case))
    plant(payload, sources[place], target, marker, spec.zip)
    before = tree_digest(ckpt)
    rc, stderr, cpu_s, rss = run_limited(*args)
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert rc == 1, (rc, stderr[-3000:])
    assert len(lines) == 1 and lines[0].startswith("distmerge: error: "), lines
    assert str(target) in lines[0] and "Traceback" not in stderr, lines
    assert any(words in lines[0] for words in EXPECTED[payload]), lines
    assert not marker.exists() and tree_digest(ckpt) == before
    assert not (tmp_path / "out" / "model.safetensors.index.json").exists()
    assert cpu_s < CPU_LIMIT_S and rss < RSS_LIMIT, (cpu_s, rss)


def test_torch_dist_common_pt_is_never_unpickled(megatron_ckpts, tmp_path):
    """torch_dist's common.pt (args, iteration) is not read: code planted in it never runs and the merge of
    the copy succeeds with the tensors of the untouched save."""
    ckpt = tmp_path / "input"
    shutil.copytree(megatron_ckpts["megatron_dist_tp2"], ckpt, symlinks=True)
    marker = tmp_path / "distmerge-was-here"
    common = max(ckpt.glob("iter_*/common.pt"))
    hp.with_pickle(common, common, hp.os_system(marker))
    config = _hf_config("megatron", megatron_ckpts["megatron_dist_tp2"])
    assert merge_inproc("--input", ckpt, "--output", tmp_path / "out", *config) == 0
    assert not marker.exists()
    expected = load_merged(tmp_path / "out")
    assert merge_inproc("--input", megatron_ckpts["megatron_dist_tp2"], "--output", tmp_path / "clean", *config) == 0
    assert_exact(expected, load_merged(tmp_path / "clean"))


def test_huge_metadata_is_refused_unread(tmp_path):
    """A 3 GB `.metadata` (sparse: no disk used) beside no data is refused from its size alone, before a byte
    of it is read. Shown to fail with METADATA_FLOOR raised to 4 GB (the child then tries to read 3 GB: MemoryError)."""
    folder = tmp_path / "ckpt"
    folder.mkdir()
    with open(folder / ".metadata", "wb") as f:
        f.truncate(3 * 10**9)
    (folder / "__0_0.distcp").write_bytes(bytes(1000))
    result = in_child(lambda: _by_path(dcp.read_metadata)(folder / ".metadata"))
    assert result["raised"] == CorruptInputError.__name__ and "max_bytes" in result["message"], result
    assert result["cpu_s"] < 1 and result["rss_above"] < RSS_LIMIT, result


def test_oversized_safetensors_header_is_refused(tmp_path):
    """A safetensors header of 50 MB in a 60 MB file (sparse) is past 1 MiB + a quarter of the file: refused
    before it is read or parsed. Shown to fail with header_limit returning MAX_HEADER."""
    from distmerge.formats.safetensors_header import read_header

    path = tmp_path / "model.safetensors"
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", 50 * 10**6))
        f.truncate(60 * 10**6)
    with pytest.raises(CorruptInputError, match="over the limit"):
        read_header(source.of(path), path)

"""The README's reliability promises, each checked from outside distmerge's own bookkeeping (see the
Guarantees table in docs/guarantees.md). Every test here was seen to fail against a deliberately broken copy of the
tree (how: in each docstring), then pass against the real one."""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, free_port, input_untouched, load_merged, reference_dir, torchrun

# inotify(7): the kernel's own record of when each file appeared in the output folder, in order.
IN_CLOSE_WRITE, IN_MOVED_TO = 0x8, 0x80
EVENT = struct.Struct("iIII")  # wd, mask, cookie, len; then len bytes of NUL-padded name


class FolderEvents:
    """Files closed after writing or renamed into one folder, in the order the kernel saw them."""

    def __init__(self, folder: Path) -> None:
        self._libc = ctypes.CDLL(None, use_errno=True)
        self.fd = self._libc.inotify_init1(os.O_NONBLOCK)
        if self.fd < 0 or self._libc.inotify_add_watch(self.fd, bytes(folder), IN_CLOSE_WRITE | IN_MOVED_TO) < 0:
            pytest.skip(f"inotify unavailable (errno {ctypes.get_errno()})")

    def names(self) -> list[str]:
        """Each name once, at the place of its last event."""
        seen: list[str] = []
        while True:
            try:
                data = os.read(self.fd, 1 << 16)
            except BlockingIOError:
                break
            at = 0
            while at < len(data):
                _, _, _, size = EVENT.unpack_from(data, at)
                name = data[at + EVENT.size : at + EVENT.size + size].rstrip(b"\0").decode()
                at += EVENT.size + size
                if name in seen:
                    seen.remove(name)
                seen.append(name)
        os.close(self.fd)
        return seen


@pytest.mark.torchrun
def test_the_index_is_written_last(fsdp_ckpts, tmp_path):
    """Promise: an index on disk means a finished model. In a real 2-process merge split into several files
    (both ranks write some), the index is the last file to appear (inotify order, the kernel's record) and its
    mtime_ns is not older than any model file's or config.json's.

    Seen to fail: with `write_index` moved before `write_config` in distmerge/engine/finalize.py (in a copy of the
    tree), the order check failed: config.json and distmerge.manifest.json appeared after the index."""
    out = tmp_path / "out"
    out.mkdir()
    events = FolderEvents(out)
    run = torchrun(2, "merge", "--input", fsdp_ckpts["fsdp2_llama_w4"], "--output", out, "--quiet",
                   "--max-shard-size", "200KB")
    assert run.returncode == 0, run.stderr[-3000:]
    order = [n for n in events.names() if not n.startswith(".")]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    model_files = sorted(set(index["weight_map"].values()))
    assert len(model_files) >= 3  # several files, so both ranks wrote some
    assert set(model_files) | {"config.json"} <= set(order), order
    assert order[-1] == "model.safetensors.index.json", order
    last = (out / "model.safetensors.index.json").stat().st_mtime_ns
    assert all((out / name).stat().st_mtime_ns <= last for name in [*model_files, "config.json"])
    assert load_merged(out)  # and the index describes what is there


@pytest.mark.torchrun
def test_an_error_on_rank_1_in_a_later_round_is_raised_by_every_rank(fsdp_ckpts, tmp_path):
    """Promise: errors reach every rank. Rank 1 (not rank 0) fails in round 2 of the exchange, after discovery,
    the plan and two rounds of writing (DISTMERGE_TEST_FAIL_AT=1:2, the engine's one test hook: no real input
    can fail there, since a damaged file is found when it is opened). Each rank records what it raised in the
    error file torchrun gives it (TORCHELASTIC_ERROR_FILE, under --log-dir); both must hold the same line.

    Seen to fail: with `Comm._unwrap` raising only this rank's own failure (error sharing broken, in a copy of
    the tree), rank 1 raised the fault and rank 0 went on with the failure as if it were a result and raised
    its own, different error ("rank 0: TypeError: unsupported operand ...")."""
    logs = tmp_path / "logs"
    env = {"DISTMERGE_TEST_FAIL_AT": "1:2"}
    run = torchrun(2, "merge", "--input", fsdp_ckpts["fsdp2_llama_w4"], "--output", tmp_path / "out",
                   "--budget", "16KiB", launcher=("--log-dir", str(logs)), env=env)
    assert run.returncode != 0
    raised = {int(p.parent.name): json.loads(p.read_text())["message"] for p in logs.glob("*/attempt_0/*/error.json")}
    line = "distmerge: error: test fault (DISTMERGE_TEST_FAIL_AT) on rank 1 in round 2"
    assert raised == {0: line, 1: line}, raised
    assert "merging " in run.stdout  # rank 0 had finished planning and started writing
    assert [s for s in run.stderr.splitlines() if s.startswith("distmerge: error:")] == [line]
    assert not (tmp_path / "out" / "model.safetensors.index.json").exists()


def test_tree_digest_sees_every_kind_of_change(fsdp_ckpts, tmp_path):
    """The input checks (conftest.merge_inproc and torchrun hash --input before and after every merge) see a
    change anywhere in the tree: a nested file's bytes, a rewrite of the same bytes, a mode, a link's target,
    a new empty folder, a folder removed. Seen to fail: with tree_digest walking the top level only (what the
    old tree_bytes did), the first change (huggingface/config.json edited) went unnoticed."""
    ckpt = Path(shutil.copytree(fsdp_ckpts["fsdp2_llama_w2"], tmp_path / "ckpt", symlinks=True))
    (ckpt / "link").symlink_to("huggingface/config.json")
    config = ckpt / "huggingface" / "config.json"
    changes = [
        lambda: config.write_text(config.read_text().replace("}", ' , "x": 1}', 1)),
        lambda: config.write_bytes(config.read_bytes()),  # same bytes, new mtime
        lambda: config.chmod(0o600),
        lambda: ((ckpt / "link").unlink(), (ckpt / "link").symlink_to("fsdp_config.json")),
        lambda: (ckpt / "huggingface" / "new").mkdir(),
        lambda: (ckpt / "huggingface" / "new").rmdir(),
    ]
    for change in changes:
        os.utime(config, ns=(1, 1))  # so that a rewrite within the same clock tick still shows
        with pytest.raises(AssertionError, match="modified its input"), input_untouched(ckpt):
            change()


# --- each input byte is read once --------------------------------------------------------------------------

SLACK_PER_PROCESS = 16 << 10  # reads that are not the input's: procfs/sysfs (torch reads /proc/cpuinfo), the
# output's own small JSON records read back; every case below asserts this is under a tenth of the smallest
# input file's tensor bytes, so a file read twice, or read by two ranks, cannot hide in it.

READ_CASES = {  # case: (fixture family, needs --hf-config from the reference folder)
    "fsdp2_llama_w4": ("fsdp_ckpts", False),
    "fsdp2_llama_hsdp_2x2": ("fsdp_ckpts", False),
    "dcp_llama_w2": ("dcp_ckpts", False),
    "megatron_tp2pp2": ("megatron_ckpts", True),
}


def rchar() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar:")).split()[1])


def discovery_reads(ckpts: list[Path], hf: Path | None, world: int) -> tuple[int, object, list]:
    """What discovery reads (measured: rchar of this process around it) and the plan it leads to (several
    checkpoints: their average's)."""
    from distmerge.average.units import AverageOptions
    from distmerge.engine.inputs import discover_inputs
    from distmerge.engine.prepare import OutputSettings, prepare_merge
    from distmerge.engine.reader import Reader
    from distmerge.formats import registry
    from distmerge.formats.dcp import folder as dcp
    from distmerge.formats.torch_private.dcp import blobs as dcp_blobs

    dcp._metadata.cache_clear()  # read it as a fresh process does
    dcp_blobs._LAYOUTS.clear()  # and check each chunk blob layout in full again, as a fresh process does
    before = rchar()
    found = discover_inputs(ckpts, "auto", hf, {})
    reader = Reader(found.scan, registry.get(found.scan.format))
    fragments = reader.open(list(range(len(found.scan.files))))
    reader.close()
    read = rchar() - before
    settings = OutputSettings(average=AverageOptions(on=len(ckpts) > 1))
    return read, prepare_merge(found, fragments, world, settings), found.scan.files


def checked_bytes(prepared) -> int:
    """Bytes the merge reads besides the output's: copies of small replicated blocks hashed for the replica
    check (replicas.py) and the sources compared or reported by unwritten.py."""
    from distmerge.engine import replicas

    plan = prepared.plan
    names = set(prepared.left_out) | {n for pair in prepared.must_equal for n in pair if n in plan.sources}
    return (sum(f.nbytes for f in replicas._checked(plan))
            + sum(f.nbytes for n in names for f in plan.sources[n].fragments))


@pytest.mark.torchrun
@pytest.mark.parametrize("case", READ_CASES)
def test_each_input_byte_is_read_once(case, request, tmp_path):
    """Promise: each input byte is read once, by one process. The kernel's count of bytes each rank read
    (/proc/self/io `rchar`, tests/io_probe.py, around the merge only) summed over a 2-process merge must lie
    between the output's bytes and the sum of: what discovery reads (measured in this process on the same
    files: zip directories, pickles, DCP .metadata, which the second rank reads too), each source tensor's
    chosen fragments once (replica copies excluded; Megatron's vocabulary padding included), the small copies
    the replica and tied-head checks hash, the huggingface/ files copied, and a small stated slack per process.

    Seen to fail: with Reader.copy_to and Reader.read_into reading each fragment once more (a checksum pass, in
    a copy of the tree), all four cases exceeded the bound (fsdp2_llama_w4: 3,148,166 read, 2,351,396 allowed)."""
    family, beside = READ_CASES[case]
    ckpt = request.getfixturevalue(family)[case]
    hf = reference_dir(ckpt) / "huggingface" if beside else None
    read_once(case, [ckpt], hf, tmp_path)


@pytest.mark.torchrun
def test_each_input_byte_of_an_average_is_read_once(fsdp_ckpts, dcp_ckpts, tmp_path):
    """The same promise for an average (docs/average.md) of an FSDP2 W=4 save and a DCP save of W=2: each byte of
    either input once, by one of the 2 processes."""
    read_once("average", [fsdp_ckpts["fsdp2_llama_w4"], dcp_ckpts["dcp_llama_w2"]], None, tmp_path, "--average")


def read_once(case: str, ckpts: list[Path], hf: Path | None, tmp_path: Path, *more: str) -> None:
    """A 2-process merge of `ckpts` (several: their average) reads what test_each_input_byte_is_read_once says."""
    discovery_reads(ckpts, hf, 2)  # this process's own first-time costs (imports) out of the measurement
    discovered, prepared, files = discovery_reads(ckpts, hf, 2)
    plan = prepared.plan
    used = {name for unit in plan.units for name in unit.sources}
    payload = sum(f.nbytes for name in used for f in plan.sources[name].fragments)
    per_file = [sum(f.nbytes for s in plan.sources.values() for f in s.fragments if f.file_index == i)
                for i in range(len(files))]
    assert min(p for p in per_file if p) > 10 * SLACK_PER_PROCESS, per_file

    record = tmp_path / "record"
    record.mkdir()
    out = tmp_path / "out"
    args = [*(a for c in ckpts for a in ("--input", c)), "--output", out, "--quiet", *more]
    args += ["--hf-config", hf] if hf else []
    with input_untouched(*ckpts):
        run = probe(2, record, *args)
    assert run.returncode == 0, run.stderr[-3000:]
    ranks = [json.loads(p.read_text()) for p in sorted(record.glob("rank*.json"))]
    assert [r["rank"] for r in ranks] == [0, 1] and all(r["rc"] == 0 for r in ranks)
    total = sum(r["rchar"] for r in ranks)

    hf_dir = hf or ckpts[0] / "huggingface"
    copied = sum(p.stat().st_size for p in hf_dir.iterdir() if p.is_file())
    own = sum(p.stat().st_size for p in out.rglob("*") if p.is_file() and not p.name.endswith(".safetensors"))
    # DCP: each rank reads the index of chunks to find its own
    shared = sum(m.stat().st_size for c in ckpts if (m := c / ".metadata").is_file())
    upper = discovered + shared + payload + checked_bytes(prepared) + copied + own + 2 * SLACK_PER_PROCESS
    written = json.loads((out / "model.safetensors.index.json").read_text())["metadata"]["total_size"]
    print(f"{case}: read {total:,} of {upper:,} allowed (output {written:,}, discovery {discovered:,})")  # -s shows
    assert written <= total <= upper, (f"{case}: ranks read {[r['rchar'] for r in ranks]} = {total:,} bytes; "
                                       f"allowed {upper:,} (discovery {discovered:,}, payload {payload:,})")


def probe(nproc: int, record: Path, *args) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--nnodes", "1",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(REPO / "tests" / "io_probe.py"),
           str(record), "merge", *map(str, args)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "PYTHONPATH": str(REPO)}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=REPO)

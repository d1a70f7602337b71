"""Checkpoints in object stores: `--input s3://...` and `--output s3://...` against a real S3 API server on
127.0.0.1 (moto's server mode, started here: tests/s3_server.py).

- FSDP, DCP and Megatron saves merged s3 -> s3, s3 -> disk and disk -> s3 give the disk merge's bytes (under
  torchrun with 2 processes: every s3 -> s3 merge and every FSDP one; the others in one process). The
  server's smallest part is cut to 64 KiB (and distmerge's parts with it, DISTMERGE_TEST_S3_PART, read by each
  store as it is made), so that the tiny models' files are multipart uploads of several parts, in this process as
  under torchrun, and a file the two ranks share is one upload whose parts both send.
  The s3 -> s3 merges run at a 64 KB budget: many rounds, each reading an object's fragments in merged GETs.
- A rank file is read in a few GETs, each byte once; a damaged local header is found by the read that reaches it.
- A rank killed mid-upload leaves no object that looks like a file (every object there is whole, no index), and
  `--resume` finishes the merge, aborting the uploads the killed run left.
- Bad locations and objects are one line naming the object: a missing prefix, an object gone or replaced after
  the listing, a scheme that is not s3:// (never a local folder named `gs:`).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

from distmerge.engine import spread
from distmerge.families.base import Target, Unit
from distmerge.input import tree as input_tree
from distmerge.output import s3 as object_store
from distmerge.output.store import FileLayout
from tests.conftest import REPO, free_port, merge_inproc, torchrun
from tests.helpers.s3 import PART, KiB, files_of, without_records
from tests.s3_server import download_tree, upload_tree

CASES = {"fsdp": ("fsdp_ckpts", "fsdp2_llama_w2"), "dcp": ("dcp_ckpts", "dcp_llama_w2"),
         "megatron": ("megatron_ckpts", "megatron_tp2pp2")}


def hf_args(case: str, ckpt: Path) -> list[str]:
    return ["--hf-config", str(ckpt.parent / f"{ckpt.name}_reference" / "huggingface")] if case == "megatron" else []


@pytest.fixture(scope="module")
def cases(request, s3, tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """Each case's checkpoint (also uploaded to s3://ckpt/CASE) and its merge from disk to disk."""
    _, s3c = s3
    found = {}
    for case, (fixture, name) in CASES.items():
        ckpt = request.getfixturevalue(fixture)[name]
        upload_tree(s3c, ckpt, "ckpt", case)
        out = tmp_path_factory.mktemp(case) / "disk"
        assert merge_inproc("--input", ckpt, "--output", out, *hf_args(case, ckpt)) == 0
        found[case] = (ckpt, out)
    return found


def walked(url: str):
    """The source of an object-store input, listed (an object opened by its placeholder: `open(root / name)`)."""
    from distmerge.input.s3 import S3Source

    listed = S3Source(url)
    listed.walk()
    return listed


@pytest.mark.torchrun
@pytest.mark.parametrize("route", ["s3-s3", "s3-disk", "disk-s3"])
@pytest.mark.parametrize("case", list(CASES))
def test_object_store_merge_equals_the_disk_merge(s3, cases, case, route, tmp_path):
    env, s3c = s3
    ckpt, disk = cases[case]
    source = f"s3://ckpt/{case}" if route.startswith("s3") else str(ckpt)
    prefix = f"{case}-{route}"
    target = f"s3://models/{prefix}" if route.endswith("s3") else str(tmp_path / "out")
    summary = tmp_path / "summary.json"
    args = ["--input", source, "--output", target, *hf_args(case, ckpt), "--json-summary", summary]
    if route == "s3-s3":  # many rounds: a rank's own fragments held with the packing, later ones kept (reads.py)
        args += ["--budget", "64KB"]
    if route == "s3-s3" or case == "fsdp":  # two processes; the rest in this one, to keep the tests short
        job = torchrun(2, "merge", "--quiet", *args, env={**env, "DISTMERGE_TEST_S3_PART": str(PART)})
        assert job.returncode == 0, job.stderr[-3000:]
    else:
        assert merge_inproc(*args) == 0
    if route.endswith("s3"):
        assert_multipart(s3c, prefix)
    if case == "fsdp" and route.endswith("s3"):  # one model.safetensors, both ranks writing it (spread.py): one
        ranks = json.loads(summary.read_text())["ranks"]  # upload of several parts, sent by both
        assert [r["files_written"] for r in ranks] == [1, 1] and all(r["bytes_written"] > PART for r in ranks)
        assert parts_of(s3c, prefix)["model.safetensors"] > 2
    got = download_tree(s3c, "models", prefix) if route.endswith("s3") else files_of(tmp_path / "out")
    want = files_of(disk)
    if route.startswith("s3"):
        got, want = without_records(got), without_records(want)
    assert got.keys() == want.keys()
    assert [n for n in got if got[n] != want[n]] == []
    assert s3c.list_multipart_uploads(Bucket="models").get("Uploads") is None  # every upload completed
    assert not (REPO / "s3:").exists()  # the old Path("s3://...") folder, never again


def test_an_average_reads_its_inputs_from_a_bucket(s3, cases, tmp_path):
    """--average (docs/average.md) of two inputs in a bucket, and of one there beside one on disk (each opened by
    its own source): the bytes of the average of the same saves on disk."""
    (fsdp, _), (dcp, _) = cases["fsdp"], cases["dcp"]
    assert merge_inproc("--input", fsdp, "--input", dcp, "--output", tmp_path / "disk", "--average") == 0
    want = without_records(files_of(tmp_path / "disk"))
    for name, (first, second) in {"s3": ("s3://ckpt/fsdp", "s3://ckpt/dcp"), "mixed": (str(fsdp), "s3://ckpt/dcp"),
                                  "mixed-s3-first": ("s3://ckpt/fsdp", str(dcp))}.items():
        assert merge_inproc("--input", first, "--input", second, "--output", tmp_path / name, "--average") == 0, name
        assert without_records(files_of(tmp_path / name)) == want, name


def parts_of(s3c, prefix: str) -> dict[str, int]:
    """Each model file under s3://models/prefix and the parts it was uploaded in, read from its ETag: a multipart
    upload's is `"<md5 of the parts' md5s>-N"`, a single PUT's has no `-N`."""
    listed = s3c.list_objects_v2(Bucket="models", Prefix=f"{prefix}/").get("Contents", [])
    return {o["Key"].removeprefix(f"{prefix}/"): int(o["ETag"].strip('"').partition("-")[2] or 1) for o in listed
            if o["Key"].endswith(".safetensors")}


def assert_multipart(s3c, prefix: str) -> None:
    """Every model file (each over 64 KiB) went up in several parts: the multipart path was taken, in this process
    too (the part size once read at import, before the s3 fixture set it, made in-process merges single PUTs)."""
    counts = parts_of(s3c, prefix)
    assert counts and all(n > 1 for n in counts.values()), counts


@pytest.mark.torchrun
def test_a_rank_killed_mid_upload_leaves_no_object_and_resume_finishes(s3, fsdp_ckpts, tmp_path):
    env, s3c = s3
    ckpt = fsdp_ckpts["fsdp2_llama_w4"]
    split = ["--max-shard-size", "200KB"]
    clean = tmp_path / "clean"
    assert merge_inproc("--input", ckpt, "--output", clean, *split) == 0
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--nnodes", "1",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "-m", "distmerge", "merge", "--quiet",
           "--input", str(ckpt), "--output", "s3://models/killed", *split, "--budget", "16KB"]
    job = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           env={**os.environ, **env, "DISTMERGE_TEST_ROUND_DELAY": "0.3", "OMP_NUM_THREADS": "1"})
    deadline = time.monotonic() + 120
    while not model_objects(s3c) and time.monotonic() < deadline and job.poll() is None:
        time.sleep(0.05)
    assert model_objects(s3c), "the merge finished no file before the deadline"
    os.kill(rank_pid(job.pid, rank=1), signal.SIGKILL)
    job.communicate(timeout=60)
    assert job.returncode != 0
    left = download_tree(s3c, "models", "killed")
    assert "model.safetensors.index.json" not in left
    finished = files_of(clean)
    assert [n for n in left if n.endswith(".safetensors") and left[n] != finished[n]] == []  # whole, or absent
    assert merge_inproc("--input", ckpt, "--output", "s3://models/killed", *split, "--resume") == 0
    assert download_tree(s3c, "models", "killed") == finished
    assert s3c.list_multipart_uploads(Bucket="models").get("Uploads") is None  # the killed run's, aborted


def model_objects(s3c) -> list[str]:
    listed = s3c.list_objects_v2(Bucket="models", Prefix="killed/model-")
    return [o["Key"] for o in listed.get("Contents", [])]


def rank_pid(torchrun_pid: int, rank: int) -> int:
    for child in Path(f"/proc/{torchrun_pid}/task/{torchrun_pid}/children").read_text().split():
        if f"RANK={rank}".encode() in Path(f"/proc/{child}/environ").read_bytes().split(b"\0"):
            return int(child)
    raise AssertionError(f"no worker with RANK={rank} under torchrun {torchrun_pid}")


def test_the_api_takes_urls_as_the_command_line_does(s3, cases):
    """distmerge.merge(input, output) with s3:// URLs (the options table's `location` kind: a URL kept as typed,
    never folded into the folder `s3:/b/p`), in this process; a path-like object stays a folder."""
    import distmerge
    from distmerge import options

    values = options.from_keywords("merge", {"input": "s3://ckpt/dcp", "output": Path("s3://models/x")})
    assert values["input"] == "s3://ckpt/dcp" and values["output"] == Path("s3:/models/x")
    _, s3c = s3
    result = distmerge.merge("s3://ckpt/dcp", "s3://models/dcp-api")
    assert result.output == "s3://models/dcp-api"
    assert_multipart(s3c, "dcp-api")
    got, want = download_tree(s3c, "models", "dcp-api"), files_of(cases["dcp"][1])
    assert without_records(got) == without_records(want)
    assert not (REPO / "s3:").exists()


# --- one line for what cannot be read or written -------------------------------------------------------------

@pytest.mark.parametrize("layout", ["beside", "above"])
def test_the_config_near_a_save_is_found_in_a_bucket_as_on_disk(s3, megatron_ckpts, ds_ckpts, layout, tmp_path):
    """A config folder outside the prefix passed is found in a bucket as on disk, and the merges agree (#35):
    `beside`: verl's actor/dist_ckpt/ + actor/huggingface/, the input naming dist_ckpt (the bucket once said `no
    config.json: ... has no huggingface/ folder`); `above`: the HF Trainer's run/config.json over run/ckpt/. Its
    tokenizer and generation config are copied from the bucket too (the folder is the source's, listed from memory:
    shown to fail, exit 1, with S3Source.holds not owning the folder, so that finalize looks for it on disk)."""
    _, s3c = s3
    run = tmp_path / layout
    if layout == "beside":
        ckpt = megatron_ckpts["megatron_dist_tp2pp2"]
        shutil.copytree(ckpt / "iter_0000001", run / "dist_ckpt")
        shutil.copytree(ckpt.parent / f"{ckpt.name}_reference" / "huggingface", run / "huggingface")
        (run / "huggingface" / "tokenizer_config.json").write_text('{"model_max_length": 128}\n')
        (run / "huggingface" / "generation_config.json").write_text('{"do_sample": false}\n')
        inside = "dist_ckpt"
    else:
        ckpt = ds_ckpts["ds_z0_bf16_w2"]
        shutil.copytree(ckpt, run / "ckpt", ignore=shutil.ignore_patterns("huggingface"))
        shutil.copytree(ckpt / "huggingface", run, dirs_exist_ok=True)
        inside = "ckpt"
    upload_tree(s3c, run, "ckpt", f"near-{layout}")
    assert merge_inproc("--input", run / inside, "--output", tmp_path / "disk") == 0
    assert merge_inproc("--input", f"s3://ckpt/near-{layout}/{inside}", "--output", tmp_path / "bucket") == 0
    got, want = without_records(files_of(tmp_path / "bucket")), without_records(files_of(tmp_path / "disk"))
    assert got.keys() == want.keys()
    assert {"config.json", "tokenizer_config.json", "generation_config.json"} <= got.keys()
    assert [n for n in got if got[n] != want[n]] == []


def test_a_missing_prefix_is_one_line(s3, tmp_path, capsys):
    assert merge_inproc("--input", "s3://ckpt/no-such-run", "--output", tmp_path / "o") == 1
    assert "input s3://ckpt/no-such-run does not exist (no object under it)" in capsys.readouterr().err


def test_another_scheme_is_refused_not_taken_for_a_folder(s3, cases, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert merge_inproc("--input", cases["fsdp"][0], "--output", "gs://models/m") == 1
    assert "not gs://" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("change", ["removed", "replaced"])
def test_an_object_changed_after_the_listing_is_named(s3, cases, change):
    from distmerge.errors import CorruptInputError

    _, s3c = s3
    upload_tree(s3c, cases["fsdp"][0], "ckpt", f"changing-{change}")
    listed = walked(f"s3://ckpt/changing-{change}")
    name = next(n for n in listed.listing.objects if n.endswith(".pt"))
    if change == "removed":
        s3c.delete_object(Bucket="ckpt", Key=f"changing-{change}/{name}")
    else:
        s3c.put_object(Bucket="ckpt", Key=f"changing-{change}/{name}", Body=b"x" * listed.listing.objects[name][0])
    with pytest.raises(CorruptInputError) as err:
        listed.open(listed.root / name).pread(16, 0)
    words = "it does not exist" if change == "removed" else "it changed after distmerge listed it"
    assert str(err.value) == f"cannot read s3://ckpt/changing-{change}/{name}: {words}" + (
        ": merge a checkpoint nothing else is writing" if change == "replaced" else "")


# --- the plan's parts: pure -------------------------------------------------------------------------------------

def test_parts_are_numbered_in_file_order_and_large_enough():
    """Runs of 40, 1 and 59 smallest parts (the middle one another writer's): parts numbered 1.. in file order,
    each inside one run, none but the last under the smallest part S3 takes."""
    small = object_store.MIN_PART
    runs = ((0, 40 * small, 1), (40 * small, 41 * small, 0), (41 * small, 100 * small + 7, 1))
    layout = FileLayout(name="m", header=b"", size=100 * small + 7, shared=True, runs=runs)
    cut = object_store.parts(layout, object_store.PART)
    assert [number for number, *_ in cut] == list(range(1, len(cut) + 1))
    assert cut[0][1] == 0 and cut[-1][2] == 100 * small + 7
    assert all(a[2] == b[1] for a, b in zip(cut, cut[1:], strict=False))  # contiguous, in order
    assert all(end - start >= small for _, start, end, _ in cut[:-1])
    assert all(any(s <= start and end <= e and w == writer for s, e, w in runs) for _, start, end, writer in cut)
    assert (41, 40 * small, 41 * small, 0) in cut or any(p[3] == 0 and p[2] - p[1] == small for p in cut)


def test_spread_leaves_no_short_run_but_the_last():
    """Units of 1 KiB and 3 KiB alternating, each read by another rank, spread over 2 ranks: without a minimum,
    runs are as short as a unit; with a 16 KiB minimum every writer's run but the last is at least that long, and
    both ranks still write about half."""
    units = [Unit(sources=(f"s{i}",), targets=(Target(name=f"t{i:03d}", dtype="U8", shape=((1 + 2 * (i % 2)) * KiB,)),))
             for i in range(64)]
    sizes = [u.targets[0].nbytes for u in units]
    local = [{i % 2: sizes[i]} for i in range(64)]
    for min_run in (0, 16 * KiB):
        owners, _ = spread.spread(units, [list(range(64))], sizes, local, [0, 0], min_run=min_run)
        runs = spread.writer_runs([(sizes[i], owners[i]) for i in range(64)])
        shortest = min(e - s for s, e, _ in runs[:-1])
        assert shortest == KiB if not min_run else shortest >= min_run
        written = [sum(e - s for s, e, w in runs if w == rank) for rank in (0, 1)]
        assert abs(written[0] - written[1]) <= 16 * KiB, written


# --- requests: a rank file in a few GETs, each byte once ----------------------------------------------------------

def spy_gets(monkeypatch) -> list[tuple[str, int, int]]:
    """Every ranged GET this process makes from now on: (object name, first byte, bytes)."""
    from distmerge import s3_client

    made, real = [], s3_client.stream_range

    def counted(bucket, key, offset, nbytes, *args, **kwargs):
        made.append((key.rsplit("/", 1)[-1], offset, nbytes))
        yield from real(bucket, key, offset, nbytes, *args, **kwargs)
    monkeypatch.setattr(s3_client, "stream_range", counted)
    return made


@pytest.mark.parametrize("budget", ["128MiB", "24KB"])  # one round; many, a rank file read across them
def test_a_rank_file_is_read_in_a_few_gets_each_byte_once(s3, cases, monkeypatch, tmp_path, budget):
    """Read with one GET per record header and one per fragment, the FSDP rank files cost about 2 x 28 GETs each;
    now the directory and the head are one GET each (the local headers checked by the reads that reach them), and
    a round's fragments of one object one GET (another round's in the way read in passing and kept): the data is
    read once, the ends (64 KiB each) at most twice. At a 24 KB budget a round holds about one tensor."""
    ckpt, disk = cases["fsdp"]
    made = spy_gets(monkeypatch)
    assert merge_inproc("--input", "s3://ckpt/fsdp", "--output", tmp_path / "out", "--budget", budget) == 0
    assert without_records(files_of(tmp_path / "out")) == without_records(files_of(disk))
    for rank_file in sorted(p.name for p in ckpt.glob("model_world_size_2_rank_*.pt")):
        gets = [(offset, n) for name, offset, n in made if name == rank_file]
        size = (ckpt / rank_file).stat().st_size
        with zipfile.ZipFile(ckpt / rank_file) as archive:
            records = len(archive.infolist())
        assert len(gets) <= (6 if budget == "128MiB" else records - 4), (records, gets)  # 24KB: ~1 tensor a round
        assert sum(n for _, n in gets) <= size + 3 * 65536, gets
    monkeypatch.undo()


def test_a_damaged_local_header_is_found_by_the_read_that_reaches_it(s3, cases, tmp_path, capsys):
    """The records' local headers are not read one by one from an object store: each is checked by the GET that
    reaches its record. One in the middle of a rank file names another record: the merge from the bucket stops
    with the line the disk merge gives, and writes no model."""
    _, s3c = s3
    ckpt = cases["fsdp"][0]
    bad = tmp_path / "bad"
    shutil.copytree(ckpt, bad)
    path = bad / "model_world_size_2_rank_1.pt"
    with zipfile.ZipFile(path) as archive:
        info = sorted(archive.infolist(), key=lambda i: i.header_offset)[len(archive.infolist()) // 2]
    data = bytearray(path.read_bytes())
    data[info.header_offset + 30 + len(info.filename) - 1] ^= 1  # the last letter of the name it gives
    path.write_bytes(bytes(data))
    upload_tree(s3c, bad, "ckpt", "damaged")
    line = f"record {info.filename}'s local header names another record"
    assert merge_inproc("--input", bad, "--output", tmp_path / "from-disk") == 1
    assert line in capsys.readouterr().err
    assert merge_inproc("--input", "s3://ckpt/damaged", "--output", tmp_path / "from-s3") == 1
    err = capsys.readouterr().err
    assert line in err and "s3://ckpt/damaged/model_world_size_2_rank_1.pt" in err, err
    assert not (tmp_path / "from-s3" / "model.safetensors.index.json").exists()


def test_records_of_an_object_are_those_of_the_file(s3, cases, tmp_path):
    """zip_records on an object (data starts from the zip directory, headers checked in passing) finds what it
    finds on the file, for torch.save's layout and for another writer's (records apart, no data descriptors:
    the head disagrees with the prediction, and every local header is read instead)."""
    from distmerge.formats.torch_private import zip_records

    _, s3c = s3
    saved = cases["fsdp"][0] / "model_world_size_2_rank_0.pt"
    spaced = tmp_path / "spaced.pt"
    with zipfile.ZipFile(saved) as src, open(spaced, "wb") as raw, zipfile.ZipFile(raw, "w") as out:
        for info in sorted(src.infolist(), key=lambda i: i.header_offset):
            out.writestr(info.filename, src.read(info))
            raw.write(b"\0" * 100)  # bytes between records, which torch.save never leaves
    for path in (saved, spaced):
        s3c.upload_file(str(path), "ckpt", f"records/{path.name}")
    listed = walked("s3://ckpt/records")
    for path in (saved, spaced):
        with input_tree.open_input(path) as f:
            want = zip_records.records(f, str(path))
        with listed.open(listed.root / path.name) as obj:
            got = zip_records.records(obj, str(path))
            assert got == want
            for record in want.values():  # each record's bytes, its local header checked on the way
                with input_tree.open_input(path) as f:
                    assert zip_records.read(obj, record) == zip_records.read(f, record)


def test_a_read_inside_a_large_record_checks_its_header_apart(s3, monkeypatch, tmp_path):
    """A read from the middle of a large record, whose local header is not yet checked, checks it with a GET of its
    own few bytes rather than starting the read at the header (up to the whole record early)."""
    import torch

    from distmerge.formats.torch_private import zip_records

    _, s3c = s3
    path = tmp_path / "three.pt"
    torch.save({"a": torch.zeros(100_000), "b": torch.arange(200_000, dtype=torch.float32),
                "c": torch.zeros(100_000)}, path)
    s3c.upload_file(str(path), "ckpt", "inside/three.pt")
    listed = walked("s3://ckpt/inside")
    with listed.open(listed.root / "three.pt") as obj:
        middle = max(zip_records.records(obj, str(path)).values(), key=lambda r: r.size)  # data/1, 800 KB
    at = middle.start + 300_000
    made = spy_gets(monkeypatch)
    with listed.open(listed.root / "three.pt") as obj:
        assert obj.pread(1024, at) == path.read_bytes()[at : at + 1024]
    assert len(made) == 2 and sum(n for *_, n in made) < 1024 + 100, made  # the header, then the bytes asked
    monkeypatch.undo()


def test_an_object_the_store_completed_short_is_never_recorded_as_done(s3, fsdp_ckpts, monkeypatch, capsys):
    """A store that loses a part on completion (here: the completion names every part but the last, as a store
    that dropped one would leave it): the owner finds the object's size is not the planned one, the merge fails
    with one line, writes no index and no record of that file."""
    _, s3c = s3

    def complete_short(self, **kwargs):
        kwargs["MultipartUpload"] = {"Parts": kwargs["MultipartUpload"]["Parts"][:-1]}
        return self._make_api_call("CompleteMultipartUpload", kwargs)

    from distmerge import s3_client

    client = s3_client.client()
    monkeypatch.setattr(client, "complete_multipart_upload", complete_short.__get__(client))
    assert merge_inproc("--input", fsdp_ckpts["fsdp2_llama_w4"], "--output", "s3://models/short") == 1
    line = capsys.readouterr().err.strip()
    assert line.startswith("distmerge: error: s3://models/short: model.safetensors holds ") and line.endswith(
        "the store lost part of it; run the same command with --resume"), line
    keys = [o["Key"] for o in s3c.list_objects_v2(Bucket="models", Prefix="short/").get("Contents", [])]
    assert "short/model.safetensors.index.json" not in keys and not [k for k in keys if ".distmerge/model" in k]

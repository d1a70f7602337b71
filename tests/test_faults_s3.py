"""What a cluster's object store does to a merge, injected by a proxy in front of the S3 test server
(tests/fault_proxy.py): each fault transient unless said otherwise, each test checking that its faults happened.

- Input bodies cut midway are continued from the byte where they broke: the merge is the disk merge's bytes.
- 503 SlowDown answers and dropped connections on the output's requests (multipart uploads) are retried.
- Under torchrun (2 processes, bucket to bucket) every transient fault at once: the disk merge's bytes.
- Slow bodies are read exactly.
- `--resume --checksum` on an object-store output reads records, heads and whole files through cut bodies.
- A body cut on every try is one line naming the object and how much of it was read; no index.
"""

from __future__ import annotations

import json
import os
import re
from contextlib import contextmanager
from pathlib import Path

import pytest

from distmerge import s3_client
from distmerge.errors import OutputError
from distmerge.output import s3 as object_store
from tests.conftest import merge_inproc, torchrun
from tests.fault_proxy import FaultPlan, fault_proxy
from tests.helpers.s3 import PART, files_of, without_records
from tests.s3_server import download_tree, upload_tree

CASE = "fsdp2_llama_w2"
SPLIT = ["--max-shard-size", "200KB"]  # several output files: a resume keeps some, redoes others


@pytest.fixture(scope="module")
def fsdp(s3, fsdp_ckpts, tmp_path_factory) -> tuple[Path, Path]:  # noqa: F811
    """The checkpoint (also at s3://ckpt/faults) and its merge from disk to disk."""
    _, s3c = s3
    ckpt = fsdp_ckpts[CASE]
    upload_tree(s3c, ckpt, "ckpt", "faults")
    out = tmp_path_factory.mktemp("faults") / "disk"
    assert merge_inproc("--input", ckpt, "--output", out, *SPLIT) == 0
    return ckpt, out


@contextmanager
def proxied(s3, plan: FaultPlan):  # noqa: F811
    """This process's S3 client goes through the proxy for the block (a client per endpoint: s3_client.client)."""
    env, _ = s3
    saved = os.environ["AWS_ENDPOINT_URL_S3"]
    with fault_proxy(env["AWS_ENDPOINT_URL_S3"], plan) as (url, proxy):
        os.environ["AWS_ENDPOINT_URL_S3"] = url
        try:
            yield proxy
        finally:
            os.environ["AWS_ENDPOINT_URL_S3"] = saved


QUICK_BODY_BACKOFF = 0.01


@pytest.fixture
def quick_retries(monkeypatch):
    """The waits between a broken body's tries shortened (their number is what the tests check)."""
    monkeypatch.setattr(s3_client, "BODY_BACKOFF", QUICK_BODY_BACKOFF)


@pytest.fixture
def quick_sdk_retries(monkeypatch):
    """The SDK's own waits before it retries a 503 SlowDown (1 s, doubling, times a random fraction) or a dropped
    connection (50 ms, doubling) shortened a hundredfold in this process: each request is still retried, as many
    times (the counts of faults are what the tests check)."""
    from botocore.retries.standard import ExponentialBackoff

    scales = {name: scale / 100 for name, scale in ExponentialBackoff._DEFAULT_BACKOFF_CONFIG.items()}
    monkeypatch.setattr(ExponentialBackoff, "_DEFAULT_BACKOFF_CONFIG", scales)


def test_input_bodies_cut_midway_are_continued(s3, fsdp, tmp_path, quick_retries):  # noqa: F811
    _, disk = fsdp
    with proxied(s3, FaultPlan(cut_body_every=3, only="/ckpt/")) as proxy:
        assert merge_inproc("--input", "s3://ckpt/faults", "--output", tmp_path / "out", *SPLIT) == 0
    assert proxy.faults["cut"] >= 3, proxy.faults
    assert without_records(files_of(tmp_path / "out")) == without_records(files_of(disk))


@pytest.mark.torchrun
def test_two_ranks_merge_bucket_to_bucket_through_every_transient_fault(s3, fsdp):  # noqa: F811
    """torchrun, 2 processes, s3 -> s3 at a 64 KB budget (many rounds of ranged GETs; output files shared by both
    ranks' parts): input bodies cut, slowed, answered 503 or dropped; the merge is the disk merge's bytes."""
    _, s3c = s3
    _, disk = fsdp
    plan = FaultPlan(cut_body_every=3, slow_body_every=5, fail_503_every=6, drop_every=11)
    with proxied(s3, plan) as proxy:
        job = torchrun(2, "merge", "--quiet", "--input", "s3://ckpt/faults", "--output", "s3://models/faults-2",
                       *SPLIT, "--budget", "64KB", env={"DISTMERGE_TEST_S3_PART": str(PART),
                                                        "DISTMERGE_TEST_S3_BODY_BACKOFF": str(QUICK_BODY_BACKOFF)})
    assert job.returncode == 0, job.stderr[-3000:]
    assert all(proxy.faults[kind] >= 2 for kind in ("cut", "slow", "slowdown", "dropped")), proxy.faults
    got = without_records(download_tree(s3c, "models", "faults-2"))
    assert got == without_records(files_of(disk))
    assert s3c.list_multipart_uploads(Bucket="models").get("Uploads") is None


def test_output_slowdowns_and_dropped_connections_are_retried(s3, fsdp, monkeypatch, quick_sdk_retries):  # noqa: F811
    """Multipart uploads (parts of 64 KiB), config, records and index, some answered 503 SlowDown and some with
    the connection closed: every one retried, every object whole."""
    _, s3c = s3
    ckpt, disk = fsdp
    monkeypatch.setattr(object_store, "PART", PART)
    with proxied(s3, FaultPlan(fail_503_every=4, drop_every=7, only="/models/")) as proxy:
        assert merge_inproc("--input", ckpt, "--output", "s3://models/faults-out", *SPLIT) == 0
    assert proxy.faults["slowdown"] >= 3 and proxy.faults["dropped"] >= 2, proxy.faults
    assert download_tree(s3c, "models", "faults-out") == files_of(disk)
    assert s3c.list_multipart_uploads(Bucket="models").get("Uploads") is None


def test_slow_bodies_are_read_exactly(s3, fsdp, tmp_path):  # noqa: F811
    _, disk = fsdp
    with proxied(s3, FaultPlan(slow_body_every=1, only="/ckpt/")) as proxy:
        assert merge_inproc("--input", "s3://ckpt/faults", "--output", tmp_path / "out", *SPLIT) == 0
    assert proxy.faults["slow"] >= 4, proxy.faults
    assert without_records(files_of(tmp_path / "out")) == without_records(files_of(disk))


def test_resume_reads_the_output_through_cut_bodies(s3, fsdp, tmp_path, quick_retries):  # noqa: F811
    """An interrupted merge (one model file and the index gone) resumed with --checksum, every first GET of the
    output cut midway: records (read), headers (read_range) and whole files (sha256) are read whole, so the files
    written are kept and the one missing is redone."""
    _, s3c = s3
    ckpt, disk = fsdp
    args = ["--input", ckpt, "--output", "s3://models/faults-resume", *SPLIT, "--checksum"]
    assert merge_inproc(*args) == 0
    names = sorted(n for n in download_tree(s3c, "models", "faults-resume") if n.startswith("model-"))
    for gone in ("model.safetensors.index.json", names[0]):
        s3c.delete_object(Bucket="models", Key=f"faults-resume/{gone}")
    summary = tmp_path / "summary.json"
    with proxied(s3, FaultPlan(cut_body_every=1, only="/models/")) as proxy:
        assert merge_inproc(*args, "--resume", "--json-summary", summary) == 0
    cut = [(path, span) for kind, path, span in proxy.injected if kind == "cut"]
    assert any(".distmerge/" in path for path, _ in cut), cut  # a record (read)
    assert any(path.endswith(".safetensors") and span.startswith("bytes=0-") for path, span in cut), cut  # read_range
    assert any(path.endswith(".safetensors") and not span for path, span in cut), cut  # sha256, whole
    assert json.loads(summary.read_text())["resumed_files"] == len(names) - 1
    clean = tmp_path / "clean"
    assert merge_inproc("--input", ckpt, "--output", clean, *SPLIT, "--checksum") == 0
    assert download_tree(s3c, "models", "faults-resume") == files_of(clean)


def test_a_body_cut_on_every_try_is_one_line(s3, fsdp, tmp_path, capsys, quick_retries):  # noqa: F811
    name = "model_world_size_2_rank_1.pt"
    with proxied(s3, FaultPlan(cut_always=name)) as proxy:
        assert merge_inproc("--input", "s3://ckpt/faults", "--output", tmp_path / "out") == 1
    assert proxy.faults["cut"] == 1 + s3_client.BODY_RETRIES, proxy.faults
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1, lines
    said = re.fullmatch(rf"distmerge: error: cannot read s3://ckpt/faults/{name}: the body broke off "
                        rf"{1 + s3_client.BODY_RETRIES} times; ([\d,]+) of ([\d,]+) bytes read", lines[0])
    assert said, lines[0]
    read, asked = (int(n.replace(",", "")) for n in said.groups())
    assert 0 < read < asked
    assert not (tmp_path / "out" / "model.safetensors.index.json").exists()


def test_the_proxy_relays_chunked_request_bodies(s3):  # noqa: F811
    """A request body in chunks (as an SDK streams one of unknown length) reaches the server as sent."""
    import http.client

    _, s3c = s3
    with proxied(s3, FaultPlan()) as proxy:
        host, port = os.environ["AWS_ENDPOINT_URL_S3"].removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        conn.request("PUT", "/models/chunked/x", body=iter([b"a" * 1000, b"b" * 3000]), encode_chunked=True)
        assert conn.getresponse().status == 200
        conn.close()
    assert proxy.requests == 1
    assert s3c.get_object(Bucket="models", Key="chunked/x")["Body"].read() == b"a" * 1000 + b"b" * 3000


@pytest.mark.parametrize("how", ["read", "read_range", "sha256"])
def test_an_object_replaced_between_a_cut_and_its_continuation_is_not_joined(s3, how, monkeypatch,  # noqa: F811
                                                                              quick_retries):
    """The output store's reads (what --resume checks finished files by: records, headers, checksums) continue a
    cut body with a GET pinned to the first answer's ETag: when the object was replaced between the cut and the
    continuation, the read fails in one line instead of joining the old object's first half to the new one's
    second. Seen failing with the continuation unpinned: the bytes came back, half old and half new."""
    env, s3c = s3
    key = f"swapped/{how}.bin"
    old, new = bytes(range(256)) * 512, bytes(255 - b for b in range(256)) * 512  # 128 KiB each, no byte alike
    s3c.put_object(Bucket="models", Key=key, Body=old)
    gets = []
    get = s3_client._get

    def replaced_after_the_first_answer(*args, **kwargs):
        if gets:  # the continuation of the cut body: the object was replaced meanwhile
            s3c.put_object(Bucket="models", Key=key, Body=new)
        gets.append(args)
        return get(*args, **kwargs)

    monkeypatch.setattr(s3_client, "_get", replaced_after_the_first_answer)
    store = object_store.ObjectStore("s3://models/swapped")
    read = {"read": lambda: store.read(f"{how}.bin"), "sha256": lambda: store.sha256(f"{how}.bin"),
            "read_range": lambda: store.read_range(f"{how}.bin", 0, len(old))}[how]
    with proxied(s3, FaultPlan(cut_body_every=1, only="/models/swapped/")) as proxy, \
            pytest.raises(OutputError) as refused:
        got = read()
        pytest.fail(f"read {len(got)} bytes: {'old' if got in (old, sha(old)) else 'a mix of old and new'}")
    assert proxy.faults["cut"] == 1 and len(gets) == 2, (proxy.faults, gets)
    assert str(refused.value).startswith(f"cannot read s3://models/swapped/{how}.bin: "), refused.value
    assert "\n" not in str(refused.value)


def sha(data: bytes) -> str:
    import hashlib

    return hashlib.sha256(data).hexdigest()

"""The S3 test server as a module fixture, and the files of a folder or bucket compared without distmerge's records
(test_s3.py, test_faults_s3.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.s3_server import client, s3_server

KiB = 1 << 10


PART = 64 * KiB


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """The server, a bucket of inputs and one of outputs; this process's environment points at it."""
    with s3_server(min_part=PART, log=tmp_path_factory.mktemp("moto") / "server.log") as env:
        saved = {k: os.environ.get(k) for k in (*env, "DISTMERGE_TEST_S3_PART")}
        os.environ.update({**env, "DISTMERGE_TEST_S3_PART": str(PART)})
        s3c = client(env)
        s3c.create_bucket(Bucket="ckpt")
        s3c.create_bucket(Bucket="models")
        yield env, s3c
        for key, value in saved.items():
            os.environ.pop(key) if value is None else os.environ.__setitem__(key, value)


def files_of(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def without_records(files: dict[str, bytes]) -> dict[str, bytes]:
    """Records carry the input files' times (S3's LastModified is not the file's mtime): the rest is compared."""
    return {name: data for name, data in files.items() if not name.startswith(".distmerge/")}

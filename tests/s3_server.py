"""A real S3 API server on 127.0.0.1 for the object-store tests and benchmarks: moto's server mode (`moto[server]`,
installed by launch/setup.sh), as the S3 client libraries' own test suites run it. Started by the test session,
stopped at its end; nothing leaves the machine."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.helpers.ports import free_port

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "distmerge-test", "AWS_SECRET_ACCESS_KEY": "distmerge-test",
               "AWS_REGION": "us-east-1"}




@contextmanager
def s3_server(min_part: int | None = None, log: Path | None = None) -> Iterator[dict[str, str]]:
    """Run the server; yields the environment a client needs (endpoint and credentials). `min_part`: the
    server's smallest multipart part (S3's is 5 MiB), for tests that cut tiny models into several parts."""
    port = free_port()
    env = {**os.environ, **CREDENTIALS}
    if min_part is not None:
        env["S3_UPLOAD_PART_MIN_SIZE"] = str(min_part)
    out = open(log, "w") if log else subprocess.DEVNULL  # noqa: SIM115  (closed below)
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the S3 test server (moto) did not start (exit {server.poll()})") from None
                time.sleep(0.1)
        yield {**CREDENTIALS, "AWS_ENDPOINT_URL_S3": f"http://127.0.0.1:{port}"}
    finally:
        server.terminate()
        server.wait(timeout=30)
        if log:
            out.close()


def client(env: dict[str, str]):
    import boto3

    return boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL_S3"], aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
                        aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"], region_name=env["AWS_REGION"])


def upload_tree(s3, folder: Path, bucket: str, prefix: str) -> None:
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        s3.upload_file(str(path), bucket, f"{prefix}/{path.relative_to(folder).as_posix()}")


def download_tree(s3, bucket: str, prefix: str) -> dict[str, bytes]:
    """Every object under prefix/, by its name below it."""
    found = {}
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=f"{prefix}/"):
        for obj in page.get("Contents", []):
            found[obj["Key"][len(prefix) + 1 :]] = s3.get_object(Bucket=bucket, Key=obj["Key"])["Body"].read()
    return found

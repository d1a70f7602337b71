"""Which S3 client library distmerge uses, by measurement: boto3, obstore and s3fs on one moto server (127.0.0.1).

    python tests/bench/bench_s3_clients.py [--size 400MB] [--s3fs-python PATH]

Each client, in a process of its own (peak RSS from wait4), does what a merge does with an object store:
    upload   one object of --size as a multipart upload of 16 MiB parts sent by 4 threads (obstore: its own
             put, which cuts and sends the parts itself: it has no API to send numbered parts of one upload from
             several processes, which a shared output file needs)
    read     the object back as 16 MiB ranged GETs, 4 threads
s3fs may need a different botocore than boto3 (aiobotocore pins it): --s3fs-python runs it from another venv.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.s3_server import client, s3_server  # noqa: E402

PART = 16 << 20
WORKER = r'''
import json, os, sys, time
from concurrent.futures import ThreadPoolExecutor
lib, size, endpoint, key_id, secret = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
PART = 16 << 20
data = os.urandom(PART)  # one part's bytes, sent again for every part: no model held in memory
parts = [(k + 1, min(PART, size - k * PART)) for k in range(-(-size // PART))]
key = f"{lib}.bin"
out = {}
if lib == "boto3":
    import boto3
    from botocore.config import Config
    c = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=key_id, aws_secret_access_key=secret,
                     region_name="us-east-1", config=Config(max_pool_connections=16))
    t = time.perf_counter()
    up = c.create_multipart_upload(Bucket="bench", Key=key)["UploadId"]
    with ThreadPoolExecutor(4) as pool:
        tags = list(pool.map(lambda p: c.upload_part(Bucket="bench", Key=key, UploadId=up, PartNumber=p[0],
                                                         Body=data[: p[1]])["ETag"], parts))
    c.complete_multipart_upload(Bucket="bench", Key=key, UploadId=up, MultipartUpload={"Parts": [
        {"PartNumber": p[0], "ETag": e} for p, e in zip(parts, tags)]})
    out["upload"] = time.perf_counter() - t
    t = time.perf_counter()
    def get(p):
        start = (p[0] - 1) * PART
        return len(c.get_object(Bucket="bench", Key=key, Range=f"bytes={start}-{start + p[1] - 1}")["Body"].read())
    with ThreadPoolExecutor(4) as pool:
        got = sum(pool.map(get, parts))
    out["read"] = time.perf_counter() - t
elif lib == "obstore":
    import obstore
    from obstore.store import S3Store
    s = S3Store("bench", endpoint=endpoint, access_key_id=key_id, secret_access_key=secret, region="us-east-1",
                client_options={"allow_http": True}, virtual_hosted_style_request=False)
    t = time.perf_counter()
    obstore.put(s, key, (data[: n] for _, n in parts), chunk_size=PART, max_concurrency=4)
    out["upload"] = time.perf_counter() - t
    t = time.perf_counter()
    def get(p):
        start = (p[0] - 1) * PART
        return len(obstore.get_range(s, key, start=start, length=p[1]))
    with ThreadPoolExecutor(4) as pool:
        got = sum(pool.map(get, parts))
    out["read"] = time.perf_counter() - t
else:
    import s3fs
    fs = s3fs.S3FileSystem(key=key_id, secret=secret, endpoint_url=endpoint)
    t = time.perf_counter()
    up = fs.call_s3("create_multipart_upload", Bucket="bench", Key=key)["UploadId"]
    with ThreadPoolExecutor(4) as pool:
        tags = list(pool.map(lambda p: fs.call_s3("upload_part", Bucket="bench", Key=key, UploadId=up,
                                                      PartNumber=p[0], Body=data[: p[1]])["ETag"], parts))
    fs.call_s3("complete_multipart_upload", Bucket="bench", Key=key, UploadId=up, MultipartUpload={"Parts": [
        {"PartNumber": p[0], "ETag": e} for p, e in zip(parts, tags)]})
    out["upload"] = time.perf_counter() - t
    t = time.perf_counter()
    def get(p):
        start = (p[0] - 1) * PART
        return len(fs.cat_file(f"bench/{key}", start=start, end=start + p[1]))
    with ThreadPoolExecutor(4) as pool:
        got = sum(pool.map(get, parts))
    out["read"] = time.perf_counter() - t
assert got == size, (got, size)
print(json.dumps(out))
'''


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=400 * 10**6)
    parser.add_argument("--s3fs-python", default=sys.executable)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with s3_server() as env:
        client(env).create_bucket(Bucket="bench")
        results: dict[str, list] = {}
        for repeat in range(args.repeats):
            for lib in ("boto3", "obstore", "s3fs")[repeat % 3:] + ("boto3", "obstore", "s3fs")[: repeat % 3]:
                python = args.s3fs_python if lib == "s3fs" else sys.executable
                cmd = [python, "-c", WORKER, lib, str(args.size), env["AWS_ENDPOINT_URL_S3"],
                       env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"]]
                proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
                _, status, usage = os.wait4(proc.pid, 0)
                line = proc.stdout.read().strip().splitlines()[-1]
                figures = json.loads(line)
                results.setdefault(lib, []).append((figures["upload"], figures["read"], usage.ru_maxrss * 1024,
                                                    usage.ru_utime + usage.ru_stime))
                print(f"  {lib:8} upload {figures['upload']:6.2f} s  read {figures['read']:6.2f} s  peak RSS "
                      f"{usage.ru_maxrss * 1024 / 1e6:.0f} MB  CPU {usage.ru_utime + usage.ru_stime:.2f} s", flush=True)
    mb = args.size / 1e6
    print("\n| client | upload MB/s | ranged read MB/s | peak RSS | client CPU s |\n|---|---|---|---|---|")
    for lib, runs in results.items():
        up = sorted(r[0] for r in runs)[len(runs) // 2]
        rd = sorted(r[1] for r in runs)[len(runs) // 2]
        print(f"| {lib} | {mb / up:.0f} | {mb / rd:.0f} | {max(r[2] for r in runs) / 1e6:.0f} MB | "
              f"{sorted(r[3] for r in runs)[len(runs) // 2]:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

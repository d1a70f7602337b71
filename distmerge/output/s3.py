"""The object store: an output at `s3://bucket/prefix` on any S3-compatible store (AWS, MinIO, Ceph...).

Each output file is one multipart upload, visible only once completed: a failed or killed merge leaves no object
that looks like a file. A file is cut into parts from the plan (`parts`): each writer's run of bytes into parts of
about PART bytes, numbered in file order, so every writer knows its part numbers without asking. A part's bytes
are gathered in memory as they arrive (in any order), and the part is sent, by a few threads, once its last byte
is in; at most IN_FLIGHT parts per rank wait or travel (bounded memory). `finish` waits for this rank's parts and
returns their ETags; the owner completes the upload (`commit`) with every writer's ETags, after the last round for
a shared file. A file smaller than one part is one PUT at its commit. The owner aborts its uploads on failure;
uploads left by a killed merge are aborted by the next `--resume` or `--overwrite` (`prepare`).

Small files (config, records, manifest, index) are single PUTs, atomic by the store's own semantics; the index is
written last (finalize.py), so it is the commit marker here as on disk.
"""

from __future__ import annotations

import bisect
import fnmatch
import hashlib
import re
import threading
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from distmerge import s3_client
from distmerge import testing_seams as seams
from distmerge.errors import OutputError
from distmerge.output.names import FINISHED, INDEX_NAME, LOCK, RECORDS
from distmerge.output.s3_lock import ObjectLock
from distmerge.output.store import FileLayout, Sharing, not_empty

MIN_PART = 5 << 20  # S3's smallest part (all but the last)
MAX_PARTS = 10_000  # S3's most parts per upload
# Parts of 16 MiB: throughput and memory measured in docs/benchmarks.md ("Object stores"); tests shrink them
# (testing_seams.s3_part_size, with the test server's own minimum) so that tiny models exercise shared uploads.
PART = 16 << 20
IN_FLIGHT = 4  # parts per rank being sent or waiting for a thread: at most this x PART bytes held


def part_size() -> int:
    """PART, or the tests' smaller part (testing_seams.s3_part_size): asked when a store is made, as a test process
    imports this module before it shrinks the parts."""
    return seams.s3_part_size(PART)


class ObjectStore:
    def __init__(self, url: str) -> None:
        self.loc = s3_client.parse(url, "output", OutputError)
        self.url = self.loc.url()
        self.part = part_size()
        self.sharing = Sharing(within="any", min_run=min(MIN_PART, self.part), receipts=True)
        self.pool = ThreadPoolExecutor(max_workers=IN_FLIGHT, thread_name_prefix="distmerge-upload")
        self.slots = threading.BoundedSemaphore(IN_FLIGHT)

    def call(self, what: str, name: str, method: str, **kwargs: Any) -> Any:
        """One request; its failure as one line naming the object."""
        try:
            return getattr(s3_client.client(), method)(Bucket=self.loc.bucket, **kwargs)
        except ImportError as err:
            raise OutputError(f"output {self.url}: {err}") from None
        except s3_client.sdk_errors() as err:
            raise OutputError(f"cannot {what} {self.loc.url(name)}: {s3_client.describe(err)}") from None

    def check_place(self, input_root: str) -> None:
        """The bucket is there; the output is not inside the input (or the input inside it)."""
        if input_root.startswith(s3_client.SCHEME):
            src = s3_client.parse(input_root, "input", OutputError)
            if src.bucket == self.loc.bucket and _nested(src.prefix, self.loc.prefix):
                raise OutputError(f"output {self.url} and input {input_root} overlap: choose another prefix")
        self.call("reach the bucket of", "", "head_bucket")

    def lock(self) -> ObjectLock:
        return ObjectLock(self.loc)

    def check(self, input_root: str, overwrite: bool, *, resumable: bool = True) -> None:
        """check_place; and without --overwrite or --resume, nothing but the lock lies under the prefix."""
        self.check_place(input_root)
        listed = self.call("list", "", "list_objects_v2", Prefix=self.loc.key(""), MaxKeys=2).get("Contents", [])
        held = [o for o in listed if o["Key"] != self.loc.key(LOCK)]
        if held and not overwrite:
            raise not_empty(self.url, resumable)

    def prepare(self, keep_finished: bool) -> None:
        """Abort the uploads an interrupted merge left (invisible, but stored and billed); without --resume also
        remove the index, earlier model files and their records (--resume keeps them for resume.py to judge)."""
        prefix = self.loc.key("")
        listed = self.call("list the uploads of", "", "list_multipart_uploads", Prefix=prefix)
        for upload in listed.get("Uploads", []):
            self.call("abort the upload of", upload["Key"], "abort_multipart_upload", Key=upload["Key"],
                      UploadId=upload["UploadId"])
        if keep_finished:
            return
        self.remove(INDEX_NAME)
        for pattern in (*FINISHED, f"{RECORDS}/*"):
            for name in self.list(pattern):
                self.remove(name)

    def host(self) -> str:
        return "object store"  # any ranks may share a file: each sends whole parts of its own

    def create(self, layout: FileLayout, rank: int) -> Upload:
        return Upload(self, layout, rank, upload_id=None, create=True)

    def join(self, layout: FileLayout, rank: int, token: Any) -> Upload:
        return Upload(self, layout, rank, upload_id=token, create=False)

    def write_small(self, name: str, data: bytes, temp: str | None = None) -> None:
        self.call("write", name, "put_object", Key=self.loc.key(name), Body=data)

    def put_stream(self, name: str, chunks: Iterable[bytes]) -> None:
        self.write_small(name, b"".join(chunks))  # config-folder files, at most input/tree.py's COPY_CAP

    def read(self, name: str) -> bytes | None:
        try:
            return b"".join(s3_client.stream_range(self.loc.bucket, self.loc.key(name)))
        except s3_client.sdk_errors() as err:
            if s3_client.missing(err):
                return None
            raise OutputError(f"cannot read {self.loc.url(name)}: {s3_client.describe(err)}") from None

    def read_range(self, name: str, offset: int, nbytes: int) -> bytes:
        buf = bytearray(nbytes)
        try:
            got = s3_client.read_range(self.loc.bucket, self.loc.key(name), offset, memoryview(buf))
        except s3_client.sdk_errors() as err:
            raise OutputError(f"cannot read {self.loc.url(name)}: {s3_client.describe(err)}") from None
        return bytes(buf[:got])

    def size(self, name: str) -> int | None:
        try:
            return s3_client.client().head_object(Bucket=self.loc.bucket, Key=self.loc.key(name))["ContentLength"]
        except s3_client.sdk_errors() as err:
            if s3_client.missing(err):
                return None
            raise OutputError(f"cannot read {self.loc.url(name)}: {s3_client.describe(err)}") from None

    def sha256(self, name: str) -> str:
        digest = hashlib.sha256()
        try:
            for block in s3_client.stream_range(self.loc.bucket, self.loc.key(name)):
                digest.update(block)
        except s3_client.sdk_errors() as err:
            raise OutputError(f"cannot read {self.loc.url(name)}: {s3_client.describe(err)}") from None
        return digest.hexdigest()

    def list(self, pattern: str) -> list[str]:
        """Names under the prefix matching a glob pattern, '*' within one folder level (as Path.glob)."""
        folder = pattern.rpartition("/")[0]
        under = s3_client.Location(self.loc.bucket, self.loc.key(folder) if folder else self.loc.prefix)
        try:
            found = s3_client.list_objects(under, cap=1_000_000)
        except (s3_client.sdk_errors(), ValueError) as err:
            raise OutputError(f"cannot list {self.url}: {s3_client.describe(err)}") from None
        start = len(self.loc.prefix) + 1 if self.loc.prefix else 0
        match = re.compile(fnmatch.translate(pattern).replace(".*", "[^/]*")).match
        return sorted(name for o in found if match(name := o["Key"][start:]))

    def remove(self, name: str) -> None:
        self.call("remove", name, "delete_object", Key=self.loc.key(name))


def _nested(a: str, b: str) -> bool:
    """One prefix is the other or a folder inside it."""
    a, b = a.strip("/"), b.strip("/")
    return not a or not b or a == b or a.startswith(b + "/") or b.startswith(a + "/")


def parts(layout: FileLayout, part: int) -> list[tuple[int, int, int, int]]:
    """(number, start, end, writer) of the file's parts: each run cut into parts of at least `part` bytes (or one
    part, the run itself: spread.py keeps every run but the last at least sharing.min_run long), numbered from 1
    in file order; larger parts where the file would need more than MAX_PARTS."""
    target = max(part, -(-layout.size // (MAX_PARTS - len(layout.runs))))
    out = []
    for start, end, writer in layout.runs:
        count = max(1, (end - start) // target)
        cuts = [start + k * (end - start) // count for k in range(count + 1)]
        first = len(out) + 1
        out.extend((first + k, cuts[k], cuts[k + 1], writer) for k in range(count))
    return out


class Upload:
    """This rank's side of one output object: its parts, gathered and sent as they fill."""

    def __init__(self, store: ObjectStore, layout: FileLayout, rank: int, *, upload_id: str | None,
                 create: bool) -> None:
        self.store, self.layout, self.key = store, layout, store.loc.key(layout.name)
        self.url = store.loc.url(layout.name)
        self.parts = parts(layout, store.part)
        self.starts = [p[1] for p in self.parts]
        self.mine = {p[0] for p in self.parts if p[3] == rank}
        self.single = not layout.shared and len(self.parts) == 1  # one PUT at the commit
        self.creator = create
        self.buffers: dict[int, bytearray] = {}
        self.filled: dict[int, int] = {}
        self.sent: dict[int, Future] = {}
        self.token = upload_id
        if create and not self.single:
            self.token = store.call("start the upload of", layout.name, "create_multipart_upload",
                                    Key=self.key)["UploadId"]
        first = self.parts[0]
        if first[0] in self.mine:  # the header goes with the file's first part, whoever writes it
            self.pwrite(memoryview(layout.header), 0)

    def pwrite(self, buf: memoryview, offset: int) -> None:
        done = 0
        while done < len(buf):
            k = bisect.bisect_right(self.starts, offset + done) - 1
            number, start, end, _ = self.parts[k]
            assert number in self.mine, f"{self.url}: bytes at {offset + done} belong to another rank's part"
            n = min(len(buf) - done, end - (offset + done))
            part = self.buffers.get(number)
            if part is None:
                part = self.buffers[number] = bytearray(end - start)
            at = offset + done - start
            part[at : at + n] = buf[done : done + n]
            self.filled[number] = self.filled.get(number, 0) + n
            done += n
            if self.filled[number] == end - start and not self.single:
                self._send(number)

    def _send(self, number: int) -> None:
        data = self.buffers.pop(number)
        self.store.slots.acquire()  # back-pressure: at most IN_FLIGHT parts held beyond the ones being filled
        try:
            self.sent[number] = self.store.pool.submit(self._upload_part, number, data)
        except BaseException:
            self.store.slots.release()
            raise

    def _upload_part(self, number: int, data: bytearray) -> str:
        try:
            return self.store.call("write", self.layout.name, "upload_part", Key=self.key, UploadId=self.token,
                                   PartNumber=number, Body=data)["ETag"]  # no copy: the buffer is this part's alone
        finally:
            self.store.slots.release()

    def finish(self) -> list[tuple[int, str]]:
        """Wait for this rank's parts; their (number, ETag), for the owner's commit."""
        missing = [n for n in sorted(self.mine) if n not in self.sent and not self.single]
        assert not missing, f"{self.url}: parts {missing} never filled"
        return [(n, self.sent[n].result()) for n in sorted(self.sent)]

    def commit(self, receipts: list[Any]) -> None:
        """The object appears whole, at once: a PUT of the one part, or the upload's completion."""
        if self.single:
            data = self.buffers.pop(self.parts[0][0], bytearray())
            self.store.call("write", self.layout.name, "put_object", Key=self.key, Body=data)
            return
        done = sorted(part for receipt in receipts for part in receipt or ())
        if [n for n, _ in done] != [p[0] for p in self.parts]:
            raise OutputError(f"cannot complete {self.url}: parts {[n for n, _ in done]} of {len(self.parts)} sent")
        self.store.call("complete the upload of", self.layout.name, "complete_multipart_upload", Key=self.key,
                        UploadId=self.token, MultipartUpload={"Parts": [{"PartNumber": n, "ETag": e} for n, e in done]})
        self.token = None

    def abort(self) -> None:
        """Nothing becomes visible: the parts not yet sent are dropped, the upload aborted by its creator."""
        self.buffers.clear()
        for future in self.sent.values():
            future.cancel()
        if self.creator and self.token is not None:
            upload, self.token = self.token, None
            try:
                s3_client.client().abort_multipart_upload(Bucket=self.store.loc.bucket, Key=self.key, UploadId=upload)
            except s3_client.sdk_errors():
                pass  # the next --resume or --overwrite aborts what is left (ObjectStore.prepare)

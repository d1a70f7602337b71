"""The lock of an object-store output (lock.py says what it is for): the object `PREFIX/.distmerge.lock`.

Every step is one conditional request, so two merges never both believe they hold it: made with
`If-None-Match: *` (only if absent), renewed by writing it again with `If-Match: <its ETag>` (only if it is still
ours; the new ETag is kept), removed with `If-Match` too (a gone holder's lock only if it is still the one read; our
own only if it is still ours). Its Last-Modified is the lease's clock. AWS S3 has had these conditions since 2024
(conditional deletes: 2025), as have MinIO and moto's server; a store that lacks them is refused with one line
rather than locked unsafely.
"""

from __future__ import annotations

from typing import Any

from distmerge import s3_client
from distmerge.errors import OutputError
from distmerge.output.lock import Found
from distmerge.output.names import LOCK

# A condition that did not hold (412), or a concurrent conditional write on the same key (409: the loser of a race)
LOST = ("PreconditionFailed", "412", "ConditionalRequestConflict", "409")
UNSUPPORTED = ("NotImplemented", "501")


class ObjectLock:
    def __init__(self, loc: s3_client.Location) -> None:
        self.loc = loc
        self.key = loc.key(LOCK)
        self.where = loc.url(LOCK)
        self.etag: str | None = None
        self.data = b""

    def _call(self, method: str, **kwargs: Any) -> Any:
        return getattr(s3_client.client(), method)(Bucket=self.loc.bucket, Key=self.key, **kwargs)

    def _failed(self, err: BaseException, what: str) -> OutputError:
        if s3_client.code_of(err) in UNSUPPORTED:
            return OutputError(f"cannot lock {self.where}: the object store does not support conditional writes "
                               "(If-None-Match / If-Match), so distmerge cannot keep two merges apart there")
        return OutputError(f"cannot {what} the lock {self.where}: {s3_client.describe(err)}")

    def create(self, data: bytes) -> bool:
        try:
            self.etag = self._call("put_object", Body=data, IfNoneMatch="*")["ETag"]
        except s3_client.sdk_errors() as err:
            if s3_client.code_of(err) not in LOST:
                raise self._failed(err, "make") from None
            found = self.read()  # our own PUT, whose answer was lost and whose retry found it: ours (unique token)
            if found is None or found.data != data:
                return False
            self.etag = found.version
        self.data = data
        return True

    def read(self) -> Found | None:
        try:
            got = self._call("get_object")
            return Found(data=got["Body"].read(), version=got["ETag"], renewed=got["LastModified"].timestamp())
        except s3_client.sdk_errors() as err:
            if s3_client.missing(err):
                return None
            raise self._failed(err, "read") from None

    def remove_if(self, version: Any) -> bool:
        try:
            self._call("delete_object", IfMatch=version)
        except s3_client.sdk_errors() as err:
            if s3_client.missing(err):
                return True
            if s3_client.code_of(err) in LOST:
                return False
            raise self._failed(err, "remove") from None
        return True

    def holds(self) -> bool:
        if self.etag is None:
            return False
        try:
            return self._call("head_object")["ETag"] == self.etag
        except s3_client.sdk_errors() as err:
            if s3_client.missing(err):
                return False
            raise self._failed(err, "read") from None

    def renew(self) -> bool:
        if self.etag is None:
            return False
        try:
            self.etag = self._call("put_object", Body=self.data, IfMatch=self.etag)["ETag"]
        except s3_client.sdk_errors() as err:
            if s3_client.code_of(err) in LOST or s3_client.missing(err):
                self.etag = None
                return False
            raise
        return True

    def release(self) -> None:
        if self.etag is None:
            return
        etag, self.etag = self.etag, None
        try:
            self._call("delete_object", IfMatch=etag)
        except s3_client.sdk_errors():
            pass  # taken over meanwhile (412), or the store is unreachable: the lease frees it

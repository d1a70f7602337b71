"""S3-compatible object stores: the one client distmerge talks to them with, its retries, and its errors as one line.

The client is boto3's (the `s3` extra: `pip install 'distmerge[s3]'`), imported only for an `s3://` input or
output, never on the local path. Why boto3 (not obstore, not s3fs): docs/architecture.md, "Object stores". Its
settings are the AWS SDK's own, from the environment: AWS_ENDPOINT_URL_S3 (or AWS_ENDPOINT_URL) for a store that
is not AWS (MinIO, Ceph, a cluster's own), AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or AWS_PROFILE, AWS_REGION.

Retries: every request is retried by the SDK ("standard" mode: throttling, 5xx, dropped connections) up to
MAX_ATTEMPTS times. A body that breaks off midway (the headers promised N bytes, fewer came) is no request error
to the SDK: every read here (stream_range: the input's ranged GETs, the output store's reads) continues it from the
byte where it broke, BODY_RETRIES times, then says in one line how much was read.
Errors: `describe` turns the SDK's exceptions into what a user can act on (missing key, denied, unreachable).
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from distmerge import testing_seams as seams

SCHEME = "s3://"
MAX_ATTEMPTS = 8  # per request, by the SDK (its backoff grows to ~20 s between the last tries)
BODY_RETRIES = 4  # a body that breaks off is asked again for the rest this many times (5 breaks: an error)
# Seconds before the first such retry, doubling: 0.4 + 0.8 + 1.6 + 3.2 s in all (the fault tests' torchrun jobs
# shorten it through testing_seams.s3_body_backoff: their count of retries is what they check, not the waits).
BODY_BACKOFF = 0.4
READ_PIECE = 1 << 20
POOL = 32  # connections per process: part uploads and ranged reads run in a few threads each


@dataclass(frozen=True)
class Location:
    bucket: str
    prefix: str  # no leading or trailing '/'; "" for the whole bucket

    def key(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name

    def url(self, name: str = "") -> str:
        key = self.key(name) if name else self.prefix
        return f"{SCHEME}{self.bucket}/{key}".rstrip("/")


def parse(url: str, what: str, error: type[Exception]) -> Location:
    """`s3://bucket/prefix` -> Location; any other scheme is refused (never taken for a folder named `x:`)."""
    if not url.startswith(SCHEME):
        scheme = url.split("://", 1)[0]
        raise error(f"{what} {url}: distmerge reads and writes s3:// object stores and folders, not {scheme}://")
    bucket, _, prefix = url[len(SCHEME):].partition("/")
    if not bucket:
        raise error(f"{what} {url} names no bucket: pass s3://BUCKET/PREFIX")
    return Location(bucket=bucket, prefix=prefix.strip("/"))


def client() -> Any:
    """This process's S3 client (thread-safe), made on first use (again if the endpoint or key changes)."""
    return _client(os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL"),
                   os.environ.get("AWS_ACCESS_KEY_ID"))


@functools.cache
def _client(endpoint: str | None, key_id: str | None) -> Any:
    try:
        import boto3
        from botocore.config import Config
    except ImportError:
        raise ImportError("s3:// needs boto3: pip install 'distmerge[s3]'") from None
    config = Config(retries={"max_attempts": MAX_ATTEMPTS, "mode": "standard"}, max_pool_connections=POOL,
                    connect_timeout=10, read_timeout=120)
    return boto3.session.Session().client("s3", config=config)


def code_of(err: BaseException) -> str:
    response = getattr(err, "response", None) or {}
    return str(response.get("Error", {}).get("Code", ""))


MISSING = ("NoSuchKey", "404", "NotFound")
DENIED = ("AccessDenied", "403", "InvalidAccessKeyId", "SignatureDoesNotMatch", "AllAccessDisabled")


def describe(err: BaseException) -> str:
    """The SDK's error as a user can act on it."""
    if isinstance(err, BrokenBody):
        return str(err)
    code = code_of(err)
    if code in MISSING:
        return "it does not exist"
    if code == "NoSuchBucket":
        return "its bucket does not exist"
    if code in DENIED:
        return f"access denied ({code}): check the credentials (AWS_ACCESS_KEY_ID, AWS_PROFILE) and the bucket policy"
    if code in ("PreconditionFailed", "412"):
        return "it changed after distmerge listed it: merge a checkpoint nothing else is writing"
    name = type(err).__name__
    if name == "NoCredentialsError":
        return "no credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE"
    if name in ("EndpointConnectionError", "ConnectTimeoutError", "ConnectionClosedError"):
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or "AWS"
        return f"cannot reach the object store at {endpoint} ({name}, after {MAX_ATTEMPTS} tries)"
    if code:
        message = str(getattr(err, "response", {}).get("Error", {}).get("Message", ""))[:160]
        return f"{code}: {message}" if message else code
    return f"{name}: {(str(err).splitlines() or [''])[0][:160]}"


def sdk_errors() -> tuple[type[BaseException], ...]:
    """The exceptions a request or a read may end in (the SDK's own, the connection's, a body broken too often)."""
    from botocore.exceptions import BotoCoreError, ClientError

    return (ClientError, BotoCoreError, OSError, BrokenBody)


def missing(err: BaseException) -> bool:
    return code_of(err) in MISSING


class BrokenBody(Exception):
    """A body broke off on every try (stream_range): the message says how often and how much was read."""


class _CutShort(Exception):
    """A body that ended before its Content-Length without the connection saying so."""


def stream_range(bucket: str, key: str, offset: int = 0, nbytes: int | None = None, etag: str | None = None,
                 piece: int = READ_PIECE) -> Iterator[bytes]:
    """The object's bytes [offset, offset + nbytes) (None: to its end) from one GET, in pieces of at most `piece`.
    A body that breaks off (cut short, reset, stalled) is continued from the byte where it broke: a ranged GET of
    the rest, pinned to the ETag, up to BODY_RETRIES times with backoff, then BrokenBody. Ends early only where the
    object ends. `etag`: the object as it was listed (a replaced object fails with PreconditionFailed); without
    it, the ETag of the first answer."""
    done, breaks = 0, 0
    while nbytes is None or done < nbytes:
        response = _get(bucket, key, offset + done, None if nbytes is None else nbytes - done, etag)
        etag = etag or response.get("ETag")
        end = done + int(response["ContentLength"])  # where this body ends: the object may end before nbytes
        nbytes = end if nbytes is None else nbytes
        body = response["Body"]
        try:
            while done < end:
                data = body.read(min(end - done, piece))
                if not data:
                    raise _CutShort
                done += len(data)
                yield data
        except _broken() as err:
            breaks += 1
            if breaks > BODY_RETRIES:
                raise BrokenBody(f"the body broke off {breaks} times; {done:,} of {nbytes:,} bytes read") from err
            time.sleep(seams.s3_body_backoff(BODY_BACKOFF) * 2 ** (breaks - 1))
        finally:
            body.close()
        if done == end < nbytes:  # the object ends before the bytes asked
            return


def _get(bucket: str, key: str, offset: int, nbytes: int | None, etag: str | None) -> dict[str, Any]:
    """One GET of [offset, offset + nbytes) (None: to the end; from 0, no Range, so that an empty object reads)."""
    extra: dict[str, str] = {"IfMatch": etag} if etag else {}
    if nbytes is not None:
        extra["Range"] = f"bytes={offset}-{offset + nbytes - 1}"
    elif offset:
        extra["Range"] = f"bytes={offset}-"
    return client().get_object(Bucket=bucket, Key=key, **extra)


def read_range(bucket: str, key: str, offset: int, into: memoryview, etag: str | None = None) -> int:
    """Fill `into` with the object's bytes from `offset` (stream_range); returns the bytes read."""
    done = 0
    for data in stream_range(bucket, key, offset, len(into), etag):
        into[done : done + len(data)] = data
        done += len(data)
    return done


def _broken() -> tuple[type[BaseException], ...]:
    """What a body's read raises when the connection cuts it short, resets or stalls: botocore's own errors
    (IncompleteReadError when the bytes stop before Content-Length, ResponseStreamingError when the connection
    says it broke, ReadTimeoutError), and urllib3's and the socket's should one come through unwrapped."""
    from botocore.exceptions import IncompleteReadError, ReadTimeoutError, ResponseStreamingError
    from urllib3.exceptions import HTTPError

    return (IncompleteReadError, ResponseStreamingError, ReadTimeoutError, HTTPError, ConnectionError,
            TimeoutError, _CutShort)


def list_objects(loc: Location, cap: int, one_level: bool = False) -> list[dict[str, Any]]:
    """Every object under the prefix (a folder's worth: `prefix/...`), at most `cap` of them (then ValueError).
    `one_level`: only those directly in it (a folder's files, not its subfolders')."""
    prefix = f"{loc.prefix}/" if loc.prefix else ""
    found: list[dict[str, Any]] = []
    level = {"Delimiter": "/"} if one_level else {}
    for page in client().get_paginator("list_objects_v2").paginate(Bucket=loc.bucket, Prefix=prefix, **level):
        found.extend(page.get("Contents", []))
        if len(found) > cap:
            raise ValueError(f"more than {cap:,} objects")
    return found

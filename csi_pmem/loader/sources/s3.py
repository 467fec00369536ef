"""A model source in an S3-compatible object store: ``s3://bucket/prefix/``.

Why boto3: it is the S3 client operators already configure (the ``AWS_*`` environment
variables, ``~/.aws`` files, web identity tokens for IRSA-style service accounts,
``AWS_ENDPOINT_URL_S3`` or ``AWS_ENDPOINT_URL`` for a store on premises), it signs
(SigV4) and retries by itself, and its clients are thread-safe, so staging's threads
share one client and its connection pool.

How bytes move: each 64 MiB chunk is one ranged GET, read straight into the volume's
mapping in 8 MiB pieces (the HTTP client's buffer, then the mapping: no temporary file,
no whole-chunk buffer), with as many GETs in flight as staging has threads. Every GET
carries ``If-Match`` with the ETag the listing gave, so an object replaced during the
stage fails the stage (:class:`SourceChangedError`) instead of mixing two uploads.

What is never logged: credentials. Our messages name the bucket, key and endpoint
only, and botocore's own DEBUG records (which print request headers, among them the
access key id) are held at INFO whatever the root logger's level.
"""

from __future__ import annotations

import logging
import os
import threading
from datetime import datetime
from typing import Any
from urllib.parse import urlsplit

from csi_pmem.loader.sources.base import (
    SourceChangedError,
    SourceError,
    SourceUnreachableError,
)
from csi_pmem.sizes import MiB
from csi_pmem.weights.layout import KIND_AUX, KIND_SAFETENSORS, SourceFile
from csi_pmem.weights.stformat import read_header

SCHEME = "s3://"
PIECE = MiB  # one read from the HTTP response into the mapping (urllib3 copies each)
DEFAULT_ATTEMPTS = 5  # botocore's standard retry mode: total attempts per request
THREADS = 16  # ranged GETs in flight: the network, not the CPU, is the limit
# Connections the client keeps: enough for --threads up to this many without urllib3
# discarding (and reopening) connections; more threads only wait for one.
MAX_CONNECTIONS = 64

log = logging.getLogger(__name__)

_lock = threading.Lock()
_clients: dict[tuple[str | None, int], Any] = {}

_DENIED = {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "403",
           "InvalidToken", "ExpiredToken", "AllAccessDisabled", "AccountProblem"}
_NO_KEY = {"NoSuchKey", "404", "NotFound"}
_CHANGED = {"PreconditionFailed", "412"}


def split(url: str) -> tuple[str, str]:
    """(bucket, prefix) of ``s3://bucket/prefix``; the prefix ends in ``/`` unless it
    is empty (the whole bucket)."""
    parts = urlsplit(url)
    if parts.scheme != "s3" or not parts.netloc or parts.query or parts.fragment:
        raise SourceError(f"{url!r} is not an S3 location; write s3://BUCKET/PREFIX/")
    prefix = parts.path.lstrip("/")
    if prefix and not prefix.endswith("/"):
        prefix += "/"
    return parts.netloc, prefix


def endpoint() -> str | None:
    """The endpoint the client uses: ``AWS_ENDPOINT_URL_S3``, else ``AWS_ENDPOINT_URL``
    (botocore reads the same two), else None (AWS itself)."""
    return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")


def _where() -> str:
    return endpoint() or "AWS S3"


def attempts() -> int:
    try:
        return max(1, int(os.environ.get("AWS_MAX_ATTEMPTS", DEFAULT_ATTEMPTS)))
    except ValueError:
        return DEFAULT_ATTEMPTS


def client() -> Any:
    """One boto3 client per endpoint and retry setting, shared by every thread."""
    key = (endpoint(), attempts())
    with _lock:
        if key not in _clients:
            _clients[key] = _make_client(*key)
        return _clients[key]


def _make_client(url: str | None, tries: int) -> Any:
    try:
        import boto3
        from botocore.config import Config
    except ImportError as exc:
        raise SourceError("s3:// sources need boto3: pip install 'csi-pmem[s3]'") from exc
    for name in ("botocore", "boto3", "s3transfer", "urllib3"):
        quiet = logging.getLogger(name)
        if quiet.getEffectiveLevel() < logging.INFO:
            quiet.setLevel(logging.INFO)  # DEBUG prints request headers
    config = Config(retries={"max_attempts": tries, "mode": "standard"},
                    max_pool_connections=MAX_CONNECTIONS, connect_timeout=10,
                    read_timeout=60, user_agent_extra="csi-pmem",
                    # a store on premises rarely has a DNS name per bucket
                    s3={"addressing_style": "path"} if url else {})
    return boto3.session.Session().client("s3", endpoint_url=url, config=config)


def _error(exc: BaseException, what: str) -> SourceError:
    """The error a user can act on, for a botocore exception raised while ``what``."""
    from botocore import exceptions as bx

    if isinstance(exc, bx.NoCredentialsError | bx.PartialCredentialsError):
        return SourceError(
            f"{what}: no S3 credentials found; set AWS_ACCESS_KEY_ID and "
            "AWS_SECRET_ACCESS_KEY (from a Secret), or AWS_SHARED_CREDENTIALS_FILE, "
            "AWS_PROFILE or a web identity token")
    if isinstance(exc, bx.ClientError):
        err = exc.response.get("Error", {})
        code = str(err.get("Code", ""))
        status = str(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", ""))
        if code == "NoSuchBucket":
            return SourceError(f"{what}: no such bucket at {_where()}")
        if code in _DENIED or status == "403":
            return SourceError(f"{what}: access denied by {_where()} ({code or status}); "
                               "check the credentials and the bucket's policy")
        if code in _CHANGED or status == "412":
            return SourceChangedError(f"{what}: the object changed while it was being "
                                      "staged (its ETag no longer matches the listing); "
                                      "stage again once the upload is complete")
        if code in _NO_KEY or status == "404":
            return SourceChangedError(f"{what}: no such object (deleted while it was being "
                                      "staged?)")
        return SourceError(f"{what}: {_where()} answered {code or status}: "
                           f"{err.get('Message', '')}".rstrip(": "))
    if isinstance(exc, bx.EndpointConnectionError | bx.ConnectTimeoutError
                  | bx.ReadTimeoutError | bx.ConnectionClosedError
                  | bx.ResponseStreamingError | bx.IncompleteReadError):
        return SourceUnreachableError(f"{what}: cannot reach {_where()} after "
                                      f"{attempts()} attempts: {exc}")
    return SourceError(f"{what}: {exc}")


def _botocore_errors() -> tuple[type[BaseException], ...]:
    from botocore import exceptions as bx

    return (bx.BotoCoreError, bx.ClientError)


def scan(url: str) -> list[SourceFile]:
    """Every object under the prefix (names relative to it; "directory" markers and
    hidden names skipped), with size, last-modified time and ETag; the safetensors
    headers are read (two ranged GETs each) and validated up front."""
    bucket, prefix = split(url)
    s3 = client()
    found = []
    try:
        pages = s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        for page in pages:
            for obj in page.get("Contents", []):
                key = obj["Key"]
                name = key[len(prefix):]
                if not name or name.endswith("/") or any(
                        part.startswith(".") for part in name.split("/")):
                    continue
                kind = KIND_SAFETENSORS if name.endswith(".safetensors") else KIND_AUX
                found.append(SourceFile(name, f"{SCHEME}{bucket}/{key}", int(obj["Size"]),
                                        _ns(obj["LastModified"]), kind,
                                        str(obj.get("ETag", "")).strip('"')))
    except _botocore_errors() as exc:
        raise _error(exc, f"listing {url}") from exc
    for src in found:
        if src.kind == KIND_SAFETENSORS:
            reader = ObjectReader(src)
            read_header(reader.read, src.size, src.path)
    return sorted(found, key=lambda s: s.name)


def _ns(when: datetime) -> int:
    return int(when.timestamp() * 1_000_000) * 1000


class ObjectReader:
    """Ranged GETs of one object, pinned to the ETag it was listed with."""

    def __init__(self, src: SourceFile):
        self.src = src
        rest = src.path[len(SCHEME):]
        self.bucket, _, self.key = rest.partition("/")
        self.s3 = client()

    def _get(self, offset: int, end: int) -> Any:
        args: dict[str, Any] = {"Bucket": self.bucket, "Key": self.key,
                                "Range": f"bytes={offset}-{end - 1}"}
        if self.src.etag:
            args["IfMatch"] = f'"{self.src.etag}"'
        return self.s3.get_object(**args)["Body"]

    def readinto(self, view: memoryview, offset: int) -> None:
        """The bytes ``[offset, offset + len(view))``. A request botocore retries
        itself; a response body that breaks off is asked for again from the byte it
        stopped at, up to the same number of attempts."""
        errors = _botocore_errors()
        got, broken = 0, 0
        while got < len(view):
            try:
                body = self._get(offset + got, offset + len(view))
            except errors as exc:
                raise _error(exc, f"reading {self.src.path}") from exc
            try:
                while got < len(view):
                    n = body.readinto(view[got:got + PIECE])
                    if not n:
                        raise SourceChangedError(
                            f"{self.src.path} ended at byte {offset + got}, before "
                            f"{offset + len(view)}: it became shorter while staged")
                    got += n
            except errors as exc:
                err = _error(exc, f"reading {self.src.path}")
                broken += 1
                if not isinstance(err, SourceUnreachableError) or broken >= attempts():
                    raise err from exc
                log.warning("%s; asking again from byte %d", err, offset + got)
            finally:
                body.close()

    def read(self, offset: int, length: int) -> bytes:
        buf = bytearray(length)
        if length:
            self.readinto(memoryview(buf), offset)
        return bytes(buf)

    def check_unchanged(self) -> None:
        """Nothing to ask: every GET was pinned to the listed ETag."""

    def close(self) -> None:
        """The client is shared; nothing is held per object."""

"""An S3-compatible bucket as ``--out s3://BUCKET/PREFIX``: the client, and what its errors mean.

Endpoint and credentials come the way TensorBoard and boto3 take them, so one environment serves
the sidecar and ``tensorboard --logdir s3://...``: ``S3_ENDPOINT`` (TensorBoard's; a full URL),
else boto3's own ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL``; ``AWS_ACCESS_KEY_ID`` /
``AWS_SECRET_ACCESS_KEY`` (/ ``AWS_SESSION_TOKEN``) or anything else of boto3's credential chain
(profiles, web identity, instance roles); ``AWS_REGION`` / ``AWS_DEFAULT_REGION``.

boto3 is the optional extra ``s3``: without it, :func:`open_store` says how to install it. boto3's
own retries are off: the caller retries (:class:`Backoff`) so that each failed request is counted
under a :data:`REASONS` name. Checksums are sent only where a request requires one (boto3 >= 1.36
would add CRC32 trailers to every upload, which several S3-compatible stores refuse); uploads carry
``Content-MD5`` instead, so a store never keeps a body that was cut in transit.
"""

from __future__ import annotations

import base64
import hashlib
import logging
import os
import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from sidecar import __version__

SCHEME = "s3://"
INSTALL = "pip install 'mstb-sidecar[s3]'"
# Why a request failed. All are retried while running; "credentials" and "no-bucket" end a start.
REASONS = ("unreachable", "slow", "throttled", "server-error", "credentials", "no-bucket", "conflict", "rejected")
_THROTTLED = {"SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded", "TooManyRequests",
              "ServiceUnavailable", "RequestThrottled"}
_CREDENTIALS = {"ExpiredToken", "ExpiredTokenException", "RequestExpired", "TokenRefreshRequired",
                "InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidToken", "AccessDenied",
                "InvalidClientTokenId", "UnrecognizedClientException", "AuthorizationHeaderMalformed"}


class BucketError(Exception):
    """A request failed; ``reason`` is one of :data:`REASONS`, the message says what the store said."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


def split_url(url: str) -> tuple[str, str]:
    """(bucket, prefix without slashes at either end) of ``s3://BUCKET[/PREFIX]``; ValueError if malformed."""
    if not url.startswith(SCHEME):
        raise ValueError(f"not an {SCHEME} URL")
    bucket, _, prefix = url[len(SCHEME):].partition("/")
    if not bucket or "*" in url or "?" in url:
        raise ValueError("write it as s3://BUCKET/PREFIX")
    return bucket, prefix.strip("/")


def endpoint() -> str | None:
    """TensorBoard's ``S3_ENDPOINT`` first (what the reader will use), else boto3's own variables."""
    return os.environ.get("S3_ENDPOINT") or None  # None: boto3 reads AWS_ENDPOINT_URL(_S3) itself


@dataclass(frozen=True)
class Entry:
    """One object under the prefix: ``name`` is its key relative to the prefix."""

    name: str
    size: int
    etag: str
    modified: float


def classify(exc: BaseException) -> BucketError:
    """What a boto3/botocore exception means for the sidecar (:data:`REASONS`)."""
    from botocore import exceptions as bex

    if isinstance(exc, BucketError):
        return exc
    if isinstance(exc, bex.ClientError):
        error = exc.response.get("Error", {})
        code = str(error.get("Code", ""))
        status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
        detail = f"{code or status}: {error.get('Message') or exc}"
        if code in _THROTTLED or status in (429, 503):
            return BucketError("throttled", detail)
        if status >= 500:
            return BucketError("server-error", detail)
        if code in _CREDENTIALS or status == 403:
            return BucketError("credentials", detail)
        if code == "NoSuchBucket":
            return BucketError("no-bucket", detail)
        if code in ("PreconditionFailed", "ConditionalRequestConflict") or status in (409, 412):
            return BucketError("conflict", detail)
        return BucketError("rejected", detail)
    if isinstance(exc, (bex.NoCredentialsError, bex.PartialCredentialsError)):
        return BucketError("credentials", str(exc))
    if isinstance(exc, bex.ReadTimeoutError):
        return BucketError("slow", str(exc))
    return BucketError("unreachable", str(exc) or type(exc).__name__)  # connection refused, reset, DNS, TLS


class Store:
    """One bucket prefix. Keys are given relative to the prefix (``rank_0/run.json``)."""

    def __init__(self, url: str, connect_timeout: float = 5.0, read_timeout: float = 30.0) -> None:
        self.url = url.rstrip("/")
        self.bucket, self.prefix = split_url(url)
        self._timeouts = (connect_timeout, read_timeout)
        self._client: Any = None

    def key(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name

    def client(self) -> Any:
        if self._client is None:
            import boto3
            from botocore.config import Config

            for name in ("boto3", "botocore"):  # "Found credentials in ..." at INFO on every new client
                logging.getLogger(name).setLevel(max(logging.WARNING, logging.getLogger(name).level))
            config = Config(retries={"max_attempts": 1, "mode": "standard"}, connect_timeout=self._timeouts[0],
                            read_timeout=self._timeouts[1], user_agent_extra=f"mstb-sidecar/{__version__}",
                            request_checksum_calculation="when_required",
                            response_checksum_validation="when_required")
            self._client = boto3.session.Session().client("s3", endpoint_url=endpoint(), config=config)
        return self._client

    def renew(self) -> None:
        """Build the client again at the next request: credentials may have been rotated (a Secret
        remounted, a profile rewritten) since it read them."""
        self._client = None

    def _call(self, method: str, **kwargs: Any) -> Any:
        try:
            return getattr(self.client(), method)(Bucket=self.bucket, **kwargs)
        except Exception as exc:  # every botocore failure is classified; nothing else is expected here
            raise classify(exc) from None

    def check(self) -> None:
        """The bucket exists and these credentials may list it (BucketError otherwise)."""
        self._call("list_objects_v2", Prefix=self.key(""), MaxKeys=1)

    def put(self, name: str, body: bytes, if_none_match: bool = False, if_match: str | None = None) -> str:
        """Upload one whole object; its ETag. Conditional: ``conflict`` if the condition fails."""
        md5 = base64.b64encode(hashlib.md5(body, usedforsecurity=False).digest()).decode()
        extra: dict[str, str] = {"IfNoneMatch": "*"} if if_none_match else {}
        if if_match is not None:
            extra["IfMatch"] = if_match
        answer = self._call("put_object", Key=self.key(name), Body=body, ContentMD5=md5, **extra)
        return str(answer.get("ETag", ""))

    def get(self, name: str) -> tuple[bytes, str] | None:
        """(body, ETag) of one object, or None if there is none."""
        try:
            answer = self._call("get_object", Key=self.key(name))
        except BucketError as exc:
            if "NoSuchKey" in str(exc) or str(exc).startswith("404"):
                return None
            raise
        try:
            return answer["Body"].read(), str(answer.get("ETag", ""))
        except Exception as exc:  # the connection broke while reading the body
            raise classify(exc) from None

    def delete(self, name: str) -> None:
        self._call("delete_object", Key=self.key(name))

    def size(self, name: str) -> int | None:
        try:
            return int(self._call("head_object", Key=self.key(name))["ContentLength"])
        except BucketError as exc:
            if str(exc).startswith(("404", "NoSuchKey", "Not Found")):
                return None
            raise

    def list(self, under: str = "") -> Iterator[Entry]:
        """Every object whose relative key starts with ``under``, in key order."""
        start = self.key(under)
        cut = len(self.key(""))
        token: str | None = None
        while True:
            page = self._call("list_objects_v2", Prefix=start, **({"ContinuationToken": token} if token else {}))
            for item in page.get("Contents", []):
                yield Entry(item["Key"][cut:], int(item["Size"]), str(item.get("ETag", "")),
                            item["LastModified"].timestamp())
            token = page.get("NextContinuationToken")
            if not page.get("IsTruncated") or not token:
                return


class Backoff:
    """Exponential backoff with jitter: each failure doubles the wait (from ``first`` up to ``cap``),
    drawn at random from its upper half so that many sidecars do not retry in step; throttling
    starts higher. A success starts over."""

    def __init__(self, first: float = 0.5, cap: float = 30.0) -> None:
        self.first, self.cap = first, cap
        self.failures = 0

    def failed(self, reason: str) -> float:
        self.failures += 1
        base = self.first * (4 if reason == "throttled" else 1) * 2 ** min(self.failures - 1, 16)
        wait = min(base, self.cap)
        return random.uniform(wait / 2, wait)

    def succeeded(self) -> None:
        self.failures = 0

"""The content-addressed store on S3-compatible object storage (AWS S3, MinIO, Ceph, moto).

``S3Store("s3://bucket/prefix")`` implements ``protocol.Store`` (plus ``holds``: the ``HOLDS``
capability) with LocalStore's layout, flat instead of fanned out::

    <prefix>/objects/<64 hex sha256>     blobs, named by the sha256 of their bytes
    <prefix>/refs/<key>                  "<64 hex digest>\\n"
    <prefix>/locks/<key>.lock            best-effort build locks (see ``lock``)

* Every ``get`` re-hashes: an object whose bytes do not hash to its name is reported as
  ``CorruptArtifactError`` naming the ``s3://`` URL (nothing is moved: the bucket may be
  shared and read-only to us). ``put`` replaces a stored copy whose ETag (the MD5 of a
  single-part upload) does not match the bytes, so re-pushing or rebuilding repairs it.
* A PUT is atomic on S3: readers see the old object or the whole new one. Writers store parts
  first and the ref last (``entries.store_artifact``), so a reader that finds a ref finds
  every blob, as with LocalStore.
* The endpoint is ``$SPMD_AOT_S3_ENDPOINT``, else ``$AWS_ENDPOINT_URL`` (boto3 also reads the
  latter, and the rest of its usual configuration: credentials, region, profiles).
* boto3 is an optional dependency: ``pip install 'spmd-aot[s3]'``. Nothing here imports torch.
"""

from __future__ import annotations

import contextlib
import email.utils
import hashlib
import json
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Iterator

from ..errors import CorruptArtifactError, LockTimeoutError, SpmdAotError
from .names import check_digest, check_key, check_path_parts, digest_of, is_digest, is_key, parse_ref, ref_bytes
from .protocol import HOLDS, BlobProblem

__all__ = ["S3Store", "parse_s3_url", "ENV_S3_ENDPOINT", "is_s3_url"]

log = logging.getLogger(__name__)

#: Environment variable naming the S3 endpoint (e.g. http://minio:9000); overrides AWS_ENDPOINT_URL.
ENV_S3_ENDPOINT = "SPMD_AOT_S3_ENDPOINT"

_MISSING_CODES = {"404", "NoSuchKey", "NotFound"}
_PRECONDITION_CODES = {"PreconditionFailed", "412", "ConditionalRequestConflict", "409"}
_UNSUPPORTED_CODES = {"NotImplemented", "501", "InvalidArgument"}


def is_s3_url(value) -> bool:
    return isinstance(value, str) and value.startswith("s3://")


def parse_s3_url(url: str) -> tuple[str, str]:
    """``s3://bucket/some/prefix/`` -> (``bucket``, ``some/prefix``)."""
    if not is_s3_url(url):
        raise SpmdAotError(f"expected an s3://bucket/prefix URL, got {url!r}")
    bucket, _, prefix = url[len("s3://"):].partition("/")
    prefix = prefix.strip("/")
    if not bucket:
        raise SpmdAotError(f"S3 URL {url!r} names no bucket; expected s3://bucket/prefix")
    return bucket, check_path_parts(prefix, f"S3 URL {url!r}")


def _error_code(exc) -> str:
    response = getattr(exc, "response", None) or {}
    return str(response.get("Error", {}).get("Code", ""))


def _status(exc) -> int:
    response = getattr(exc, "response", None) or {}
    return int(response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)


def _is_missing(exc) -> bool:
    return _error_code(exc) in _MISSING_CODES or _status(exc) == 404 and _error_code(exc) != "NoSuchBucket"


def _is_precondition(exc) -> bool:
    return _error_code(exc) in _PRECONDITION_CODES or _status(exc) in (409, 412)


def _is_unsupported(exc) -> bool:
    return _error_code(exc) in _UNSUPPORTED_CODES or _status(exc) == 501


class S3Store:
    """Content-addressed blobs plus named refs under ``s3://bucket/prefix``.

    Safe for any number of writers and readers on any number of hosts: blobs are immutable
    and named by their content, every PUT is atomic, and refs are written last.

    ``lock(key)`` is **best effort**. It creates ``locks/<key>.lock`` with a conditional PUT
    (``If-None-Match: *``: only one writer can create it), refreshes it while held (a
    heartbeat, a conditional PUT with ``If-Match``) and treats a lock not refreshed for
    ``lock_stale_after`` seconds (by the server's clock) as left by a dead holder and takes it
    over. It keeps two hosts from tracing the same step at once, which only saves work:
    cross-host correctness relies on content addressing, not on the lock. Two builds of one
    key store identical part blobs and each writes its ref last, so readers always see one
    complete artifact. On a backend without conditional writes the lock degrades to no lock,
    with a warning.

    Capabilities (``protocol``): ``HOLDS`` (``holds`` compares the ETag, no download).
    """

    capabilities = frozenset({HOLDS})

    def __init__(self, url: str, *, client=None, endpoint_url: str | None = None,
                 lock_timeout: float = 600.0, lock_stale_after: float = 120.0,
                 lock_poll: float = 0.5) -> None:
        self.bucket, self.prefix = parse_s3_url(url)
        self.url = f"s3://{self.bucket}/{self.prefix}".rstrip("/")
        self.root = self.url  # where messages say the cache is (a LocalStore's root is a path)
        self.lock_timeout = lock_timeout
        self.lock_stale_after = lock_stale_after
        self.lock_poll = lock_poll
        self.endpoint_url = (endpoint_url or os.environ.get(ENV_S3_ENDPOINT)
                             or os.environ.get("AWS_ENDPOINT_URL") or None)
        self._client = client if client is not None else self._make_client()

    def __repr__(self) -> str:
        return f"S3Store({self.url!r})"

    @property
    def location(self) -> str:
        return self.url

    def _make_client(self):
        try:
            import boto3
            from botocore.config import Config
        except ImportError:
            raise SpmdAotError(
                f"{self.url}: the S3 backend needs boto3, which is not installed; "
                "install it with: pip install 'spmd-aot[s3]'"
            ) from None
        return boto3.client("s3", endpoint_url=self.endpoint_url,
                            config=Config(retries={"max_attempts": 5, "mode": "standard"}))

    # ------------------------------------------------------------------ helpers

    def _key(self, *parts: str) -> str:
        return "/".join(([self.prefix] if self.prefix else []) + list(parts))

    def _url(self, object_key: str) -> str:
        return f"s3://{self.bucket}/{object_key}"

    def blob_url(self, digest: str) -> str:
        """The ``s3://`` URL of the blob named ``digest`` (whether or not it exists)."""
        return self._url(self._key("objects", check_digest(digest)))

    def _call(self, op: str, **kwargs):
        """``client.<op>(Bucket=..., **kwargs)``; transport and permission failures become
        ``SpmdAotError`` naming the bucket and endpoint, ``ClientError`` is re-raised for the
        caller to inspect (missing object, failed precondition)."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return getattr(self._client, op)(Bucket=self.bucket, **kwargs)
        except ClientError as exc:
            code = _error_code(exc)
            if code == "NoSuchBucket":
                raise SpmdAotError(f"{self.url}: bucket {self.bucket!r} does not exist at "
                                   f"{self._where()}; create it or fix the URL") from None
            if code in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "403"):
                raise SpmdAotError(f"{self.url}: {op} was refused ({code}) by {self._where()}; "
                                   "check the credentials and the bucket policy") from None
            raise
        except BotoCoreError as exc:
            raise SpmdAotError(f"{self.url}: {op} failed talking to {self._where()}: {exc}") from None

    def _where(self) -> str:
        return f"endpoint {self.endpoint_url}" if self.endpoint_url else "the default AWS endpoint"

    def _list(self, *parts: str) -> Iterator[str]:
        """Names (the part after ``<prefix>/<parts>/``) of the objects under a folder."""
        folder = self._key(*parts) + "/"
        token = None
        while True:
            kwargs = {"Prefix": folder}
            if token:
                kwargs["ContinuationToken"] = token
            page = self._call("list_objects_v2", **kwargs)
            for item in page.get("Contents", []) or []:
                name = item["Key"][len(folder):]
                if name and "/" not in name:
                    yield name
            if not page.get("IsTruncated"):
                return
            token = page.get("NextContinuationToken")

    def _read(self, object_key: str, limit: int | None = None) -> bytes | None:
        """The object's bytes, or None if it does not exist; refused unread past ``limit``."""
        from botocore.exceptions import ClientError

        try:
            response = self._call("get_object", Key=object_key)
        except ClientError as exc:
            if _is_missing(exc):
                return None
            raise SpmdAotError(f"cannot read {self._url(object_key)}: {exc}") from None
        length = response.get("ContentLength")
        if limit is not None and (not isinstance(length, int) or length > limit):
            response["Body"].close()
            raise CorruptArtifactError(f"{self._url(object_key)} is {length} bytes, more than the {limit} "
                                       "allowed here; if the artifact is yours, raise SPMD_AOT_LOAD_LIMITS")
        try:
            data = response["Body"].read(limit + 1) if limit is not None else response["Body"].read()
        except Exception as exc:  # a connection cut mid-body
            raise CorruptArtifactError(f"reading {self._url(object_key)} failed: {exc}") from None
        if limit is not None and len(data) > limit:
            raise CorruptArtifactError(f"{self._url(object_key)} holds more than the {limit} bytes allowed")
        return data

    def _head(self, object_key: str) -> dict | None:
        from botocore.exceptions import ClientError

        try:
            return self._call("head_object", Key=object_key)
        except ClientError as exc:
            if _is_missing(exc):
                return None
            raise SpmdAotError(f"cannot stat {self._url(object_key)}: {exc}") from None

    # ------------------------------------------------------------------ blobs

    def put(self, data: bytes) -> str:
        """Store ``data``; return its sha256 hex digest.

        Idempotent: a stored copy whose size and ETag (MD5) match is left alone, anything else
        (missing, damaged, uploaded in parts by another tool) is overwritten.
        """
        data = bytes(data) if not isinstance(data, bytes) else data
        digest = digest_of(data)
        if self.holds(digest, data):
            return digest
        from botocore.exceptions import ClientError

        try:
            self._call("put_object", Key=self._key("objects", digest), Body=data,
                       ContentType="application/octet-stream", Metadata={"sha256": digest})
        except ClientError as exc:
            raise SpmdAotError(f"cannot write {self.blob_url(digest)}: {exc}") from None
        return digest

    def holds(self, digest: str, data: bytes) -> bool:
        """Whether the stored object ``digest`` is exactly ``data`` (by size and ETag = MD5),
        without downloading it. False when absent or when the ETag is not a plain MD5."""
        head = self._head(self._key("objects", check_digest(digest)))
        if head is None or head.get("ContentLength") != len(data):
            return False
        return str(head.get("ETag", "")).strip('"') == hashlib.md5(data).hexdigest()

    def get(self, digest: str, *, limit: int | None = None) -> bytes:
        """Return the bytes named ``digest``, checked against the name (none past ``limit`` read)."""
        url = self.blob_url(digest)
        data = self._read(self._key("objects", digest), limit)
        if data is None:
            raise CorruptArtifactError(f"blob {digest} missing at {url}")
        actual = digest_of(data)
        if actual != digest:
            raise CorruptArtifactError(
                f"blob {url} is corrupt: expected sha256 {digest}, content ({len(data)} bytes) "
                f"hashes to {actual}. Push a good copy again (spmd-aot push) or rebuild the "
                "artifact; the next put of the right bytes replaces it."
            )
        return data

    def has(self, digest: str) -> bool:
        """Whether a blob named ``digest`` exists (its content is not checked)."""
        return self._head(self._key("objects", check_digest(digest))) is not None

    def size(self, digest: str) -> int | None:
        """The stored object's size in bytes, or None if absent."""
        head = self._head(self._key("objects", check_digest(digest)))
        return None if head is None else int(head.get("ContentLength", 0))

    def delete(self, digest: str) -> None:
        """Remove a blob; no error if it is absent."""
        self._call("delete_object", Key=self._key("objects", check_digest(digest)))

    def blobs(self) -> Iterator[str]:
        """All stored digests, in sorted order (objects with malformed names are skipped)."""
        yield from sorted(name for name in self._list("objects") if is_digest(name))

    # ------------------------------------------------------------------ refs

    def set_ref(self, key: str, digest: str) -> None:
        """Point ``key`` at ``digest`` (one atomic PUT)."""
        check_key(key)
        check_digest(digest)
        self._call("put_object", Key=self._key("refs", key), Body=ref_bytes(digest),
                   ContentType="text/plain")

    def get_ref(self, key: str) -> str | None:
        """The digest ``key`` points to, or None if there is no such ref."""
        object_key = self._key("refs", check_key(key))
        raw = self._read(object_key)
        if raw is None:
            return None
        return parse_ref(raw, f"ref {self._url(object_key)}", "delete it (spmd-aot rm) or push the artifact again")

    def delete_ref(self, key: str) -> None:
        """Remove a ref; no error if it is absent."""
        self._call("delete_object", Key=self._key("refs", check_key(key)))

    def ref_keys(self) -> list[str]:
        """The key of every ref object (damaged ones included), sorted; other names are skipped."""
        return sorted(name for name in self._list("refs") if is_key(name))

    def refs(self) -> dict[str, str]:
        """All readable refs as key -> digest, sorted by key (damaged ones are skipped)."""
        out: dict[str, str] = {}
        for name in self.ref_keys():
            try:
                digest = self.get_ref(name)
            except CorruptArtifactError:  # damaged: verify() reports it
                continue
            if digest is not None:
                out[name] = digest
        return out

    # ------------------------------------------------------------------ locks

    @contextlib.contextmanager
    def lock(self, key: str, timeout: float | None = None) -> Iterator[str]:
        """Hold the best-effort lock ``key`` (see the class docstring); yields its URL.

        ``timeout`` defaults to ``lock_timeout``; a negative value waits forever.
        """
        from botocore.exceptions import ClientError

        object_key = self._key("locks", f"{check_key(key)}.lock")
        url = self._url(object_key)
        body = json.dumps({"token": secrets.token_hex(16), "host": socket.gethostname(),
                           "pid": os.getpid(), "created": time.time()}).encode()
        t = self.lock_timeout if timeout is None else timeout
        deadline = None if t < 0 else time.monotonic() + t
        etag = None
        while True:
            try:
                etag = self._call("put_object", Key=object_key, Body=body,
                                  IfNoneMatch="*")["ETag"]
                break
            except ClientError as exc:
                if _is_unsupported(exc):
                    log.warning("%s: the backend does not support conditional writes (%s); "
                                "building without a cross-host lock (duplicate work is harmless)",
                                url, _error_code(exc))
                    break
                if not _is_precondition(exc):
                    raise SpmdAotError(f"cannot take lock {url}: {exc}") from None
            if self._break_if_stale(object_key):
                continue
            if deadline is not None and time.monotonic() >= deadline:
                holder = (self._read(object_key) or b"").decode(errors="replace")[:200]
                raise LockTimeoutError(
                    f"could not take lock {url} within {t:g} s: another process holds it "
                    f"({holder or 'holder unknown'}). It is refreshed while its holder lives and "
                    f"taken over {self.lock_stale_after:g} s after it stops; if no spmd-aot "
                    f"process is using {self.url}, delete the lock object and retry."
                )
            time.sleep(self.lock_poll * (0.5 + secrets.randbelow(1000) / 1000))

        if etag is None:  # no conditional writes: no lock
            yield url
            return
        stop = threading.Event()
        state = {"etag": etag, "lost": False}
        beat = threading.Thread(target=self._heartbeat, args=(object_key, body, state, stop),
                                name=f"spmd-aot-lock-{key[:12]}", daemon=True)
        beat.start()
        try:
            yield url
        finally:
            stop.set()
            beat.join()
            if not state["lost"]:
                self._release(object_key, state["etag"])

    def _server_age(self, head: dict) -> float:
        """Seconds since the object was last written, by the server's clock (no skew)."""
        modified = head.get("LastModified")
        date = head.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("date")
        try:
            now = email.utils.parsedate_to_datetime(date) if date else None
        except (TypeError, ValueError):
            now = None
        if modified is None:
            return 0.0
        if now is None:
            return time.time() - modified.timestamp()
        return (now - modified).total_seconds()

    def _break_if_stale(self, object_key: str) -> bool:
        """Delete the lock object if its holder stopped refreshing it; True if it is gone."""
        from botocore.exceptions import ClientError

        head = self._head(object_key)
        if head is None:
            return True  # released meanwhile: try again at once
        age = self._server_age(head)
        if age <= self.lock_stale_after:
            return False
        log.warning("taking over stale lock %s (not refreshed for %.0f s)", self._url(object_key), age)
        try:  # only the version we judged stale: a fresh lock taken meanwhile survives
            self._call("delete_object", Key=object_key, IfMatch=head["ETag"])
        except ClientError as exc:
            if _is_precondition(exc):
                return False
            if not _is_unsupported(exc):
                raise SpmdAotError(f"cannot remove stale lock {self._url(object_key)}: {exc}") from None
            self._call("delete_object", Key=object_key)
        return True

    def _heartbeat(self, object_key, body, state, stop) -> None:
        from botocore.exceptions import ClientError

        interval = max(self.lock_stale_after / 4, 0.05)
        while not stop.wait(interval):
            try:
                state["etag"] = self._call("put_object", Key=object_key, Body=body,
                                           IfMatch=state["etag"])["ETag"]
            except ClientError as exc:
                if _is_precondition(exc) or _is_missing(exc):
                    log.warning("lock %s was taken over by another process (it judged it stale); "
                                "carrying on: duplicate work is harmless", self._url(object_key))
                    state["lost"] = True
                    return
                if _is_unsupported(exc):
                    return  # no refresh: a holder busy past lock_stale_after may be overtaken
                log.warning("cannot refresh lock %s: %s", self._url(object_key), exc)
            except SpmdAotError as exc:
                log.warning("cannot refresh lock %s: %s", self._url(object_key), exc)

    def _release(self, object_key: str, etag: str) -> None:
        from botocore.exceptions import ClientError

        try:
            self._call("delete_object", Key=object_key, IfMatch=etag)
        except ClientError as exc:
            if _is_unsupported(exc):
                with contextlib.suppress(Exception):
                    self._call("delete_object", Key=object_key)
            elif not (_is_precondition(exc) or _is_missing(exc)):
                log.warning("cannot release lock %s: %s", self._url(object_key), exc)
        except SpmdAotError as exc:
            log.warning("cannot release lock %s: %s", self._url(object_key), exc)

    # ------------------------------------------------------------------ maintenance

    def verify(self) -> list[BlobProblem]:
        """Download and re-hash every blob and check every ref; report, change nothing."""
        problems: list[BlobProblem] = []
        present = set()
        for name in sorted(self._list("objects")):
            url = self._url(self._key("objects", name))
            if not is_digest(name):
                problems.append(BlobProblem(name, url, "bad name"))
                continue
            present.add(name)
            data = self._read(self._key("objects", name))
            if data is None:
                continue  # deleted since listing
            actual = digest_of(data)
            if actual != name:
                problems.append(BlobProblem(name, url, f"content hashes to {actual}"))
        for name in sorted(self._list("refs")):
            url = self._url(self._key("refs", name))
            try:
                target = self.get_ref(name)
            except SpmdAotError as e:
                problems.append(BlobProblem("", url, f"ref {name} is damaged: {e}"))
                continue
            if target is not None and target not in present and not self.has(target):
                problems.append(BlobProblem(target, url, f"ref {name} points to missing blob"))
        return problems

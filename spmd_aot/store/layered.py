"""A local cache in front of a remote store: read-through, write-through.

``LayeredStore(LocalStore(...), S3Store("s3://bucket/prefix"))`` is what
``open_store("s3://...")`` returns, so every job host keeps a local copy of what it loaded and
every build lands in the shared bucket.

* Reads hit the local store first. A blob missing (or damaged) locally is read from the
  remote store, verified against its name, and written into the local store.
* ``get_ref`` on a key the local store lacks asks the remote store and, on a hit, copies the
  *whole artifact* (parts, manifest, then the ref: ``transfer.copy_artifact``) into the local
  store before answering, so the local store keeps its guarantee that a ref implies its blobs
  (``spmd-aot verify``/``ls`` on the local cache stay clean, and later runs work offline).
* Writes (``put``, ``set_ref``) go to the local store, then to the remote one, and a remote
  failure raises: ``store_artifact`` writes parts before the ref, so the remote store never
  gets a ref to blobs it lacks. ``delete``/``delete_ref`` remove from both.
* ``lock`` takes the local (filelock) lock, then the remote best-effort lock. Copies into
  the local store happen under the local lock of their key, as builds do, which is what lets
  ``gc`` run while jobs pull.
* Capabilities (``protocol``): ``LOCAL_FILES`` through the local store (gc, reader leases and
  last-use records work on the host's cache); ``location`` is the remote store's, since that is
  what ``cache_dir=`` names.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

from ..errors import CorruptArtifactError, SpmdAotError
from .local import LocalStore
from .protocol import LOCAL_FILES, BlobProblem, Store
from .transfer import copy_artifact

__all__ = ["LayeredStore"]

log = logging.getLogger(__name__)


class LayeredStore:
    capabilities = frozenset({LOCAL_FILES})

    def __init__(self, local: LocalStore, remote: Store) -> None:
        self.local = local
        self.remote = remote
        self.root = local.root  # the local cache: where leases, used/ and locks live
        self.location = remote.location
        self.lock_timeout = local.lock_timeout
        self._held: set[str] = set()  # keys whose lock this store holds (see get_ref)

    def __repr__(self) -> str:
        return f"LayeredStore({self.local!r}, {self.remote!r})"

    # ------------------------------------------------------------------ blobs

    def put(self, data: bytes) -> str:
        digest = self.local.put(data)
        remote = self.remote.put(data)
        if remote != digest:
            raise CorruptArtifactError(f"{self.remote!r} stored blob {digest} under {remote}")
        return digest

    def get(self, digest: str, *, limit: int | None = None) -> bytes:
        if self.local.has(digest):
            try:
                return self.local.get(digest, limit=limit)
            except CorruptArtifactError as exc:  # quarantined locally; the remote copy repairs it
                log.warning("local copy of blob %s is damaged (%s); reading it from %s",
                            digest[:12], exc, self.remote.root)
        data = self.remote.get(digest, limit=limit)  # verified against the name
        self._keep_locally(data)
        return data

    def _keep_locally(self, data: bytes) -> None:
        try:
            self.local.put(data)
        except (OSError, SpmdAotError) as exc:  # a read-only local cache still serves reads
            log.warning("cannot keep a local copy in %s: %s", self.local.root, exc)

    def has(self, digest: str) -> bool:
        return self.local.has(digest) or self.remote.has(digest)

    def size(self, digest: str) -> int | None:
        size = self.local.size(digest)
        return size if size is not None else self.remote.size(digest)

    def delete(self, digest: str) -> None:
        self.local.delete(digest)
        self.remote.delete(digest)

    def blobs(self) -> Iterator[str]:
        yield from sorted(set(self.local.blobs()) | set(self.remote.blobs()))

    # ------------------------------------------------------------------ refs

    def set_ref(self, key: str, digest: str) -> None:
        self.local.set_ref(key, digest)
        self.remote.set_ref(key, digest)

    def get_ref(self, key: str) -> str | None:
        digest = self.local.get_ref(key)
        if digest is not None:
            return digest
        digest = self.remote.get_ref(key)
        if digest is None:
            return None
        try:
            # Under the local build lock, as every writer of the local cache (gc relies on it),
            # unless this store already holds it (get_ref inside trace_and_store's lock).
            with contextlib.nullcontext() if key in self._held else self.local.lock(key):
                if self.local.get_ref(key) == digest:
                    return digest  # another process copied it meanwhile
                copy_artifact(self.remote, self.local, key, digest)
        except CorruptArtifactError:
            raise  # the remote artifact is damaged: the caller rebuilds (and so repairs) it
        except (OSError, SpmdAotError) as exc:  # e.g. a read-only local cache: still usable
            log.warning("cannot copy artifact %s into %s: %s", key[:12], self.local.root, exc)
        return digest

    def delete_ref(self, key: str) -> None:
        self.local.delete_ref(key)
        self.remote.delete_ref(key)

    def ref_keys(self) -> list[str]:
        return sorted(set(self.local.ref_keys()) | set(self.remote.ref_keys()))

    def refs(self) -> dict[str, str]:
        merged = {**self.remote.refs(), **self.local.refs()}
        return dict(sorted(merged.items()))

    # ------------------------------------------------------------------ locks & maintenance

    @contextlib.contextmanager
    def lock(self, key: str, timeout: float | None = None):
        with self.local.lock(key, timeout) as path, self.remote.lock(key, timeout):
            self._held.add(key)
            try:
                yield path
            finally:
                self._held.discard(key)

    def verify(self) -> list[BlobProblem]:
        return self.local.verify() + self.remote.verify()

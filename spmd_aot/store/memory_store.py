"""Blobs and refs held in this process's memory: the smallest complete store.

Two uses:

* ``MemoryStore(blobs)``: what a rank without cache access loads from after rank 0 sends it the
  blobs, and what a job trains from when its cache cannot take its build. Anonymous: no
  ``cache_dir`` reaches it.
* ``memory://NAME`` (``open_memory_store``): a store shared by everything in this process that
  opens the same NAME; for tests, examples and runs that want no disk cache. Nothing survives
  the process, and ``lock`` is a thread lock: other processes never see this store.

It is also the worked example of a backend: this file implements ``protocol.Store`` and
declares one optional capability (``HOLDS``: ``holds`` compares a stored copy in place), and one
line in ``registry.SCHEMES`` makes ``memory://`` work everywhere a cache location is accepted
(``cache_dir=``, ``--cache-dir``, ``push --to``, ``pull --from``).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from ..errors import CorruptArtifactError, LockTimeoutError, SpmdAotError
from .names import check_digest, check_key, digest_of, is_digest, is_key
from .protocol import HOLDS, BlobProblem

__all__ = ["MemoryStore", "open_memory_store", "SCHEME"]

SCHEME = "memory"


class MemoryStore:
    """Blobs and refs in dicts. Every ``get`` re-hashes, as every store's does: the initial
    ``blobs`` may come from another process."""

    capabilities = frozenset({HOLDS})

    def __init__(self, blobs: dict[str, bytes] | None = None, *, name: str | None = None,
                 root: str = "<memory>", lock_timeout: float = 600.0) -> None:
        self._blobs = dict(blobs or {})
        self._refs: dict[str, str] = {}
        self._locks: dict[str, threading.Lock] = {}
        self._mutex = threading.Lock()  # guards the dicts: many threads may use one store
        self.location = f"{SCHEME}://{name}" if name is not None else None
        self.root = self.location or root
        self.lock_timeout = lock_timeout

    def __repr__(self) -> str:
        return f"MemoryStore({self.root!r})"

    # ------------------------------------------------------------------ blobs

    def put(self, data: bytes) -> str:
        data = bytes(data)
        digest = digest_of(data)
        with self._mutex:
            self._blobs[digest] = data  # replaces a damaged initial copy, if any
        return digest

    def get(self, digest: str, *, limit: int | None = None) -> bytes:
        data = self._blobs.get(check_digest(digest))
        if data is None:
            raise CorruptArtifactError(f"blob {digest} missing in {self.root}")
        if limit is not None and len(data) > limit:
            raise CorruptArtifactError(f"blob {digest} in {self.root} is {len(data)} bytes, more than {limit}")
        actual = digest_of(data)
        if actual != digest:
            raise CorruptArtifactError(f"blob {digest} in {self.root} is corrupt: it hashes to {actual}")
        return data

    def has(self, digest: str) -> bool:
        return check_digest(digest) in self._blobs

    def holds(self, digest: str, data: bytes) -> bool:
        """Whether the copy of ``digest`` is exactly ``data`` (so a copy need not store it again)."""
        return self._blobs.get(check_digest(digest)) == data

    def size(self, digest: str) -> int | None:
        data = self._blobs.get(check_digest(digest))
        return None if data is None else len(data)

    def delete(self, digest: str) -> None:
        with self._mutex:
            self._blobs.pop(check_digest(digest), None)

    def blobs(self) -> Iterator[str]:
        yield from sorted(d for d in list(self._blobs) if is_digest(d))

    # ------------------------------------------------------------------ refs

    def set_ref(self, key: str, digest: str) -> None:
        check_key(key)
        check_digest(digest)
        with self._mutex:
            self._refs[key] = digest

    def get_ref(self, key: str) -> str | None:
        return self._refs.get(check_key(key))

    def delete_ref(self, key: str) -> None:
        with self._mutex:
            self._refs.pop(check_key(key), None)

    def ref_keys(self) -> list[str]:
        return sorted(self._refs)

    def refs(self) -> dict[str, str]:
        return dict(sorted(self._refs.items()))

    # ------------------------------------------------------------------ locks & maintenance

    @contextlib.contextmanager
    def lock(self, key: str, timeout: float | None = None) -> Iterator[str]:
        """A lock among this process's threads (nothing else can see this store)."""
        with self._mutex:
            lock = self._locks.setdefault(check_key(key), threading.Lock())
        t = self.lock_timeout if timeout is None else timeout
        if not lock.acquire(timeout=-1 if t < 0 else t):
            raise LockTimeoutError(f"could not take lock {key!r} of {self.root} within {t:g} s: another "
                                   "thread of this process holds it")
        try:
            yield f"{self.root}/locks/{key}"
        finally:
            lock.release()

    def verify(self) -> list[BlobProblem]:
        problems = []
        for digest, data in sorted(self._blobs.items()):
            where = f"{self.root}/objects/{digest}"
            if not is_digest(digest):
                problems.append(BlobProblem(str(digest), where, "bad name"))
            elif digest_of(data) != digest:
                problems.append(BlobProblem(digest, where, f"content hashes to {digest_of(data)}"))
        for key, target in self.refs().items():
            if target not in self._blobs:
                problems.append(BlobProblem(target, f"{self.root}/refs/{key}", f"ref {key} points to missing blob"))
        return problems


_named: dict[str, MemoryStore] = {}
_named_mutex = threading.Lock()


def open_memory_store(url: str) -> MemoryStore:
    """``memory://NAME`` -> this process's store named NAME, created empty on first use."""
    name = url[len(f"{SCHEME}://"):] if url.startswith(f"{SCHEME}://") else None
    if not is_key(name):
        raise SpmdAotError(f"memory store URL {url!r}: expected {SCHEME}://NAME with NAME 1-200 characters "
                           "from [A-Za-z0-9._-], not starting with '.'")
    with _named_mutex:
        if name not in _named:
            _named[name] = MemoryStore(name=name)
        return _named[name]

"""The interface a store implements, and the one place that says what a store can do.

A store is bytes in, bytes out: blobs named by the sha256 of their content, and refs that map
an opaque key to a blob's digest. It knows nothing about torch or the artifact format (the
order writers follow, parts then manifest then ref, is ``entries.store_artifact``'s business).
Names follow ``names`` (one rule for every backend: no path can be spelled as a key or digest).

Every store has the required members of ``Store``. Beyond them a store declares, in its
``capabilities`` set, which optional abilities it has; callers ask ``supports(store, X)`` (or
the accessor of that capability below) instead of probing for attributes:

* ``LOCAL_FILES``: its blobs, refs and locks are files in a directory on this host, a
  ``LocalStore`` found at ``store.local`` (the store itself, or the local cache in front of a
  remote store). gc, reader leases, last-use records, temp-file cleanup and ``blob_path`` need
  it; ``local_files(store)`` returns that ``LocalStore`` or None.
* ``HOLDS``: ``store.holds(digest, data)`` says whether the stored copy is exactly ``data``
  without reading it back (object storage compares its ETag), so copies skip uploads;
  ``holds(store, digest, data)`` answers False for a store without it.

A new backend is one module that implements ``Store`` plus one line in ``registry.SCHEMES``
(or a ``registry.register_scheme`` call from your own code); ``memory_store.py`` is the smallest
complete example, and ``tests/support/store_contract.py`` is the conformance check every backend runs.
"""

from __future__ import annotations

import dataclasses
from contextlib import AbstractContextManager
from typing import Protocol, runtime_checkable
from collections.abc import Iterator

__all__ = ["Store", "BlobProblem", "LOCAL_FILES", "HOLDS", "CAPABILITIES", "supports", "local_files",
           "holds"]

#: Optional capability: blobs are files on this host, in the LocalStore ``store.local``.
LOCAL_FILES = "local_files"
#: Optional capability: ``store.holds(digest, data)`` compares a stored copy without reading it.
HOLDS = "holds"
#: Every optional capability a store may declare.
CAPABILITIES = frozenset({LOCAL_FILES, HOLDS})


@dataclasses.dataclass(frozen=True)
class BlobProblem:
    """One thing ``Store.verify`` found wrong, for a person to read or a tool to act on."""

    digest: str  # the name of the blob (or the digest a broken ref points to); "" if none
    path: str  # the file or URL concerned
    reason: str  # e.g. "content hashes to <sha>", "unreadable: ...", "bad name"


@runtime_checkable
class Store(Protocol):
    """What every store implements. Contract, for every backend:

    * **Names.** Digests and keys are checked with ``names`` before storage is touched: an
      invalid digest raises ``CorruptArtifactError`` (it came from a damaged manifest or ref),
      an invalid key ``SpmdAotError``. Keys are opaque: the store never interprets them.
    * **Reads verify.** ``get`` re-hashes and raises ``CorruptArtifactError`` for a blob that is
      missing, unreadable or does not hash to its name; no caller ever sees unchecked bytes.
    * **Writes are atomic.** A reader sees the old content or the whole new content of a blob or
      ref, never a part; writing the same bytes concurrently from many processes is safe.
    * **Deletes are idempotent**: deleting what is absent is no error.
    * **Failures of the storage itself** (permissions, a full disk, an unreachable endpoint)
      raise ``SpmdAotError`` saying where and what to do, never a raw library exception.
    """

    #: Where messages say the store is: a directory path, a URL, or a ``<description>``.
    root: object
    #: What ``cache_dir=`` / ``--cache-dir`` says to reach this store again; None if nothing does.
    location: str | None
    #: The optional capabilities (``CAPABILITIES``) this store has.
    capabilities: frozenset

    def put(self, data: bytes) -> str:
        """Store ``data`` and return its digest. Idempotent: an intact copy is left alone, a
        damaged one replaced."""

    def get(self, digest: str, *, limit: int | None = None) -> bytes:
        """The bytes named ``digest``, checked against the name (``CorruptArtifactError`` if not).
        With ``limit``, a blob larger than that is refused (``CorruptArtifactError``) without
        reading more than ``limit`` + 1 of its bytes: loads pass their limits here."""

    def has(self, digest: str) -> bool:
        """Whether a blob named ``digest`` exists (its content is not checked)."""

    def size(self, digest: str) -> int | None:
        """The stored blob's size in bytes (None if absent), without reading it where the backend
        can: loads refuse an oversized blob before reading it."""

    def delete(self, digest: str) -> None:
        """Remove a blob; no error if it is absent."""

    def blobs(self) -> Iterator[str]:
        """Every stored digest, sorted (objects with malformed names are skipped)."""

    def set_ref(self, key: str, digest: str) -> None:
        """Point ``key`` at ``digest``, atomically."""

    def get_ref(self, key: str) -> str | None:
        """The digest ``key`` points to; None if there is no such ref, ``CorruptArtifactError``
        if the ref is damaged."""

    def delete_ref(self, key: str) -> None:
        """Remove a ref; no error if it is absent."""

    def ref_keys(self) -> list[str]:
        """The key of every ref present, sorted, damaged ones included (their ``get_ref``
        raises), so listings can report them."""

    def refs(self) -> dict[str, str]:
        """Every readable ref as key -> digest, sorted by key; damaged refs are skipped."""

    def lock(self, key: str, timeout: float | None = None) -> AbstractContextManager:
        """Hold the lock named ``key`` among every process that shares this store (as far as the
        backend can reach: see each backend), e.g. while building one artifact. ``timeout`` in
        seconds (None: the store's default, negative: forever); ``LockTimeoutError`` when it
        runs out. Locks save duplicate work; correctness rests on content addressing."""

    def verify(self) -> list[BlobProblem]:
        """Re-hash every blob and check every ref; report problems, change nothing."""


def supports(store: Store, capability: str) -> bool:
    """Whether ``store`` declares ``capability`` (one of ``CAPABILITIES``)."""
    if capability not in CAPABILITIES:
        raise ValueError(f"unknown store capability {capability!r}; known: {', '.join(sorted(CAPABILITIES))}")
    return capability in store.capabilities


def local_files(store: Store):
    """The ``LocalStore`` holding ``store``'s blobs as files on this host, or None (object storage,
    memory): gc, reader leases and last-use records work on it."""
    return store.local if supports(store, LOCAL_FILES) else None


def holds(store: Store, digest: str, data: bytes) -> bool:
    """Whether ``store`` already holds exactly ``data`` as ``digest``, when it can tell without
    reading the copy back; False when it cannot."""
    return supports(store, HOLDS) and store.holds(digest, data)

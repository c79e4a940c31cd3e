"""Reader leases and last use: what loading an artifact records in a local cache, so that gc
(``eviction.py``) neither deletes an artifact while it is loaded nor evicts a recently used one.

    leases/<manifest digest>.lock   reader leases: flock(LOCK_SH) while an artifact is loaded
    used/<key>                      empty file; its mtime is when the artifact was last loaded

**Reader leases.** A reader wraps the load in ``with reading(store, digest):``, which holds a
shared ``flock`` on ``leases/<digest>.lock``. gc deletes a manifest only while holding an
exclusive ``flock`` on the same file, taken without waiting (``try_exclusive``): if any reader
holds a lease, gc skips that artifact. A reader that arrives while gc is deleting waits for
gc's exclusive lock, then finds the manifest gone and gets ``ArtifactGoneError`` (a
``CorruptArtifactError``: the runtime treats it as a miss), never a half-deleted artifact. The
OS drops a dead reader's lease, so leases never go stale. Lease files are the cache owner's,
mode 0600 (0660 in a shared cache: ``LocalStore.lock_mode``), so another user who can read the
cache cannot hold one; and a reader waits for a lease at most ``LEASE_WAIT`` seconds, then
reads without one (``reading``), so no lock anyone holds can fail a hit.

**Last use.** ``touch_used(store, key)`` (called after each load) sets ``used/<key>``'s mtime;
without one the ref file's mtime counts (when it was built or pulled).

Nothing here imports torch; leases need ``fcntl`` (POSIX). Without it ``reading`` is a no-op, as
it is for a store without a local cache directory (object storage alone, memory).
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
from collections.abc import Iterator

from ..errors import CorruptArtifactError, SpmdAotError
from .nofollow import LinkError
from .local import LocalStore
from .locks import FileLock, locks_supported
from .names import check_digest, check_key
from .protocol import Store, local_files

__all__ = ["reading", "touch_used", "forget_used", "last_used", "ArtifactGoneError", "LEASES", "USED",
           "lease_lock", "try_exclusive", "require_local"]

log = logging.getLogger(__name__)

LEASES, USED = "leases", "used"


class ArtifactGoneError(CorruptArtifactError):
    """The artifact was deleted (by gc or ``spmd-aot rm``) before the lease was taken."""


def require_local(store: Store) -> LocalStore:
    local = local_files(store)
    if local is None:
        raise SpmdAotError(f"gc works on a local cache directory, not on {store!r}; run it on the "
                           "hosts' caches (objects in a bucket are best expired by a lifecycle rule)")
    return local


def lease_lock(local: LocalStore, digest: str) -> FileLock:
    return local.lock_file((LEASES,), f"{digest}.lock")


def try_exclusive(lock: FileLock) -> bool:
    """Take ``lock`` exclusively without waiting; a lock that cannot be examined (a planted
    link, an unwritable directory) counts as held by someone, so what it guards stays."""
    try:
        return lock.acquire(0)
    except (OSError, SpmdAotError) as exc:
        log.warning("treating %s as held: %s", lock.path, exc)
        return False


#: How long a reader waits for a lease: gc holds one exclusively only while it deletes that
#: artifact (milliseconds).
LEASE_WAIT = 10.0


@contextlib.contextmanager
def reading(store, digest: str, *, timeout: float | None = None) -> Iterator[None]:
    """Hold a reader lease on the artifact whose manifest is ``digest`` while loading it::

        with reading(store, digest):
            artifact = read_artifact(store, digest)

    gc does not delete an artifact while any process holds a lease on it. Raises
    ``ArtifactGoneError`` if the artifact was deleted before the lease was taken. On a
    read-only cache, or without a local cache, no lease is taken.

    A load never waits longer than ``timeout`` (default ``LEASE_WAIT``) for the lease: held
    longer, it is a stuck gc or a lock someone else holds (lease files are the owner's, mode
    0600, but a descriptor opened on an older, readable one keeps its lock). The artifact is
    then read without a lease (logged): its blobs are immutable and re-hashed when read, so the
    worst a deletion meanwhile can do is a missing blob, which the load reports as damage and
    rebuilds, as after any gc.
    """
    check_digest(digest)
    timeout = LEASE_WAIT if timeout is None else timeout
    local = local_files(store)
    lease = None
    if local is not None and locks_supported():
        lease = lease_lock(local, digest)
        try:
            taken = lease.acquire(timeout, shared=True)
        except OSError as exc:  # read-only cache: nobody can gc it either
            log.debug("no reader lease on %s: %s", lease.path, exc)
            lease = None
        except LinkError as exc:  # a planted link: gc treats that lease as held, so this is safe
            log.warning("no reader lease: %s", exc)
            lease = None
        else:
            if not taken:
                log.warning("reader lease %s is held exclusively for over %g s (a stuck gc, or a lock another "
                            "process holds); reading artifact %s without a lease: a gc may remove it meanwhile, "
                            "and the load would then rebuild it", lease.path, timeout, digest[:12])
                lease = None
    try:
        if not store.has(digest):
            raise ArtifactGoneError(
                f"artifact {digest[:12]} is no longer in {store.root} (removed "
                "by gc or `spmd-aot rm`); look its key up again, or rebuild it")
        yield
    finally:
        if lease is not None:
            lease.release()


def touch_used(store, key: str) -> None:
    """Record that the artifact ``key`` was just loaded (gc evicts least recently used first)."""
    local = local_files(store)
    if local is None:
        return
    check_key(key)
    try:
        fd = local.tree.open((USED,), key, os.O_WRONLY | os.O_CREAT, create_dirs=True)
        try:
            os.utime(fd)
        finally:
            os.close(fd)
    except (OSError, SpmdAotError) as exc:  # a read-only cache is never collected
        log.debug("cannot record use of %s: %s", key, exc)


def forget_used(store, key: str) -> None:
    """Drop ``used/<key>`` (after its ref was removed); a regular file only."""
    local = local_files(store)
    if local is not None:
        with contextlib.suppress(OSError, SpmdAotError):
            local.tree.unlink((USED,), check_key(key))


def last_used(store, key: str) -> float:
    """When ``key`` was last loaded (``used/<key>``), else built or pulled (its ref); 0 if unknown."""
    local = require_local(store)
    for parts in ((USED,), ("refs",)):
        try:
            st = local.tree.lstat(parts, key)
        except (OSError, SpmdAotError):
            continue
        if st is not None and stat.S_ISREG(st.st_mode):
            return st.st_mtime
    return 0.0

"""Reader leases and last use: what loading an artifact records in a local cache, so that gc
(``gc.py``) neither deletes an artifact while it is loaded nor evicts a recently used one.

    leases/<manifest digest>.lock   reader leases: flock(LOCK_SH) while an artifact is loaded
    used/<key>                      empty file; its mtime is when the artifact was last loaded

**Reader leases.** A reader wraps the load in ``with reading(store, digest):``, which holds a
shared ``flock`` on ``leases/<digest>.lock``. gc deletes a manifest only while holding an
exclusive ``flock`` on the same file, taken without waiting (``try_exclusive``): if any reader
holds a lease, gc skips that artifact. A reader that arrives while gc is deleting waits for
gc's exclusive lock, then finds the manifest gone and gets ``ArtifactGoneError`` (a
``CorruptArtifactError``: the runtime treats it as a miss), never a half-deleted artifact. The
OS drops a dead reader's lease, so leases never go stale.

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
from typing import Iterator

from ..errors import CorruptArtifactError, LockTimeoutError, SpmdAotError
from .fsafe import LinkError
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
    return FileLock(local.tree, (LEASES,), f"{digest}.lock")


def try_exclusive(lock: FileLock) -> bool:
    """Take ``lock`` exclusively without waiting; a lock that cannot be examined (a planted
    link, an unwritable directory) counts as held by someone, so what it guards stays."""
    try:
        return lock.acquire(0)
    except (OSError, SpmdAotError) as exc:
        log.warning("treating %s as held: %s", lock.path, exc)
        return False


@contextlib.contextmanager
def reading(store, digest: str, *, timeout: float = 120.0) -> Iterator[None]:
    """Hold a reader lease on the artifact whose manifest is ``digest`` while loading it::

        with reading(store, digest):
            artifact = read_artifact(store, digest)

    gc does not delete an artifact while any process holds a lease on it. Raises
    ``ArtifactGoneError`` if the artifact was deleted before the lease was taken, and
    ``LockTimeoutError`` if gc kept it locked for ``timeout`` seconds (it holds it only while
    deleting it). On a read-only cache, or without a local cache, no lease is taken.
    """
    check_digest(digest)
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
                raise LockTimeoutError(f"could not take reader lease {lease.path} within {timeout:g} s: "
                                       "a gc has held it that long; is a gc process stuck?")
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

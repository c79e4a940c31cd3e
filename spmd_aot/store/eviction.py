"""Garbage collection of a local cache, made safe by the reader leases of ``leases.py``.

``collect_garbage(store, max_size=..., max_age=...)`` evicts whole artifacts, least recently
used first, then removes blobs nothing references any more. Three files under the cache
root make that safe while jobs are loading and builds are writing::

    leases/<manifest digest>.lock   reader leases: flock(LOCK_SH) while an artifact is loaded
    leases/gc.lock                  one gc at a time
    used/<key>                      empty file; its mtime is when the artifact was last loaded

**Reader leases and last use** (``leases.py``): gc deletes a manifest only while holding an
exclusive ``flock`` on its lease file, taken without waiting, so an artifact a job is loading
stays. Part blobs are deleted only when no manifest left on disk names them. Together: *inside
a lease, if the manifest exists, every part it names exists*. Both sides re-check after locking
that the lease file is still the one on disk (gc unlinks lease files of deleted artifacts).
Eviction follows ``used/<key>``'s mtime, least recently used first.

**Writers.** Builds write parts, then the manifest, then the ref, under
``locks/<key>.lock``. gc holds every build lock it can take for its whole run (a build of
such a key waits); an artifact whose key another process is building is not evicted, and
while any build runs every unreferenced part blob stays until the next gc. gc reads the parts
of every manifest a ref names when it sweeps, including a manifest stored after it listed the
blobs (a build re-uses intact old blobs without rewriting them). Unreferenced blobs that no
manifest named are also kept while younger than ``grace`` (for writers that take no lock), and
a blob whose mtime changed since gc listed it (``LocalStore.put`` refreshes the mtime of a
blob it re-uses) is kept. ``tools/stress/stress_cache.py gc`` runs gc, builders and loaders together.

Nothing here imports torch.
All of it works on the host's cache directory: the store's ``LocalStore`` (``protocol.local_files``;
for an s3:// cache, the local cache in front of the bucket). A store without one (object storage
alone, memory) takes no leases and records no use, and ``collect_garbage`` refuses it.
Every file is reached through the store's ``nofollow.Tree``: no symbolic link is followed, so a
link planted at ``used/``, ``leases/``, ``locks/`` or a fan-out directory cannot make gc delete,
or a load create, anything outside the cache.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import re
import time

from ..errors import CorruptArtifactError, LockTimeoutError, SpmdAotError
from ..format.limits import load_limits
from .local import LocalStore
from .locks import FileLock, locks_supported
from .names import is_digest
from .transfer import looks_like_manifest, manifest_parts
from .leases import LEASES, USED, forget_used, last_used, lease_lock, require_local, try_exclusive

__all__ = ["collect_garbage", "GcReport", "Artifact", "parse_size", "parse_age", "format_size", "cache_size"]

log = logging.getLogger(__name__)

_MANIFEST_MAX = 16 << 20  # blobs larger than this are never read to look for a manifest


# ---------------------------------------------------------------------------- sizes and ages
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgtp]?)(i?b)?\s*$", re.I)
_AGE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*$", re.I)
_SIZE_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40, "p": 1 << 50}
_AGE_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_size(text: str) -> int:
    """``500M``, ``2G``, ``1.5GiB``, ``100k``, ``0`` -> bytes (binary units: 1K = 1024)."""
    m = _SIZE_RE.match(str(text))
    if not m:
        raise ValueError(f"expected a size such as 500M, 2G or 1024 (bytes), got {text!r}")
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])


def parse_age(text: str) -> float:
    """``7d``, ``12h``, ``30m``, ``45s``, ``2w``, ``0`` -> seconds."""
    m = _AGE_RE.match(str(text))
    if not m:
        raise ValueError(f"expected an age such as 7d, 12h, 30m or 45s, got {text!r}")
    return float(m.group(1)) * _AGE_UNITS[m.group(2).lower()]


def format_size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def _blob_sizes(local: LocalStore) -> dict[str, tuple[int, float]]:
    """digest -> (size, mtime) of every blob on disk."""
    return {digest: (st.st_size, st.st_mtime) for digest, st in local.blob_stats().items()}


def cache_size(store) -> int:
    """Bytes held by the blobs of a local cache (what ``--max-size`` bounds)."""
    return sum(size for size, _ in _blob_sizes(require_local(store)).values())


# ---------------------------------------------------------------------------- inventory
@dataclasses.dataclass
class Artifact:
    key: str
    digest: str  # manifest
    blobs: frozenset  # manifest and parts
    used: float  # last use (epoch seconds)


def _read_manifest_parts(local: LocalStore, digest: str) -> set[str] | None:
    """The part digests a manifest on disk names; None if it is missing or not a manifest.
    Reads the file directly (no quarantine side effect: gc must not move things around)."""
    try:  # any manifest a load would read (a larger one is no manifest: its parts are not kept)
        data = local.read_raw(digest, limit=load_limits().part_bytes)
    except (OSError, SpmdAotError):
        return None
    try:
        return set(manifest_parts(data, f"manifest {digest}").values())
    except CorruptArtifactError:
        return None


def _inventory(local: LocalStore) -> list[Artifact]:
    arts = []
    for key, digest in local.refs().items():
        parts = _read_manifest_parts(local, digest) or set()
        arts.append(Artifact(key, digest, frozenset({digest, *parts}), last_used(local, key)))
    return arts


class _BuildLocks:
    """Take every build lock (``locks/*.lock``) that is free, without waiting; remember which
    ones another process holds. ``busy()`` looks again (new builds start at any time)."""

    def __init__(self, local: LocalStore) -> None:
        self.local = local
        self.held: dict[str, FileLock] = {}
        self.busy_names: set[str] = set()

    def __enter__(self):
        self.busy()
        return self

    def busy(self) -> set[str]:
        try:
            entries = self.local.tree.entries("locks")
        except (OSError, SpmdAotError):
            entries = []
        busy = set()
        for name, _ in entries:
            if not name.endswith(".lock") or name in self.held:
                continue
            lock = self.local.lock_file(("locks",), name)
            if try_exclusive(lock):
                self.held[name] = lock
            else:
                busy.add(name)  # held by a build (or unexaminable: a link): keep what builds need
        self.busy_names = busy
        return busy

    def __exit__(self, *exc):
        for lock in self.held.values():
            lock.release()


# ---------------------------------------------------------------------------- gc
@dataclasses.dataclass
class GcReport:
    bytes_before: int
    bytes_after: int
    artifacts_before: int
    artifacts_after: int
    evicted: list[tuple[str, str, str]]  # (key, manifest digest, "age" | "size")
    skipped_leased: list[str]  # keys gc would have evicted but a reader held a lease on
    blobs_removed: int
    bytes_removed: int
    kept_unreferenced: int  # unreferenced blobs kept (leased, being built, younger than grace)
    builds_running: list[str]  # build locks held by other processes during the run
    dry_run: bool


def collect_garbage(store, *, max_size: int | None = None, max_age: float | None = None,
                    grace: float = 0.0, dry_run: bool = False, now: float | None = None,
                    lock_timeout: float = 60.0) -> GcReport:
    """Evict artifacts, then remove unreferenced blobs; never touches a leased artifact.

    1. Every artifact not used for more than ``max_age`` seconds is evicted.
    2. While the blobs the remaining refs reach take more than ``max_size`` bytes, the least
       recently used artifact is evicted.
    3. Unreferenced blobs are removed: manifests (under the lease lock) and the parts no
       remaining manifest names.
    Evicting deletes the ref and (under an exclusive lease lock, skipped if a reader holds a
    lease) the manifest. With ``dry_run`` nothing is deleted and the report says what would be.
    """
    local = require_local(store)
    if not locks_supported():  # pragma: no cover
        raise SpmdAotError("gc needs POSIX file locks (fcntl), which this platform lacks")
    now = time.time() if now is None else now
    gc_lock = local.lock_file((LEASES,), "gc.lock")
    if not gc_lock.acquire(lock_timeout):
        raise LockTimeoutError(f"another gc of {local.root} has been running for {lock_timeout:g} s "
                               f"(it holds {gc_lock.path})")
    try:
        with _BuildLocks(local) as builds:
            return _collect(local, builds, max_size, max_age, grace, dry_run, now)
    finally:
        gc_lock.release()


def _collect(local, builds, max_size, max_age, grace, dry_run, now) -> GcReport:
    sizes = _blob_sizes(local)
    bytes_before = sum(s for s, _ in sizes.values())
    arts = _inventory(local)
    alive = {a.key: a for a in arts}
    refcount = collections.Counter(d for a in arts for d in a.blobs)
    live_bytes = sum(sizes.get(d, (0, 0))[0] for d in refcount)
    evicted: list[tuple[str, str, str]] = []
    skipped: list[str] = []
    gone: dict[str, set[str]] = {}  # manifests evict() deleted (or would, in a dry run) -> parts
    removed = removed_bytes = 0

    def evict(a: Artifact, reason: str) -> None:
        nonlocal live_bytes, removed, removed_bytes
        if f"{a.key}.lock" in builds.busy_names:  # being rebuilt right now: it stays this time
            skipped.append(a.key)
            return
        shared = any(o.digest == a.digest for o in alive.values() if o.key != a.key)
        lease = None
        if not shared:  # another ref naming the same manifest keeps it: only this ref goes
            lease = lease_lock(local, a.digest)
            if not try_exclusive(lease):
                skipped.append(a.key)
                return
        try:
            if not dry_run:
                local.delete_ref(a.key)
                forget_used(local, a.key)
                if lease is not None:
                    local.delete(a.digest)
                    _unlink_quietly(local, (LEASES,), f"{a.digest}.lock")
        finally:
            if lease is not None:
                lease.release()
        if lease is not None and a.digest in sizes:
            gone[a.digest] = set(a.blobs) - {a.digest}
            removed += 1
            removed_bytes += sizes[a.digest][0]
        del alive[a.key]
        evicted.append((a.key, a.digest, reason))
        for d in a.blobs:
            refcount[d] -= 1
            if refcount[d] == 0:
                del refcount[d]
                live_bytes -= sizes.get(d, (0, 0))[0]

    by_age = sorted(arts, key=lambda a: (a.used, a.key))
    if max_age is not None:
        for a in by_age:
            if now - a.used > max_age:
                evict(a, "age")
    if max_size is not None:
        for a in by_age:
            if live_bytes <= max_size:
                break
            if a.key in alive:
                evict(a, "size")

    evicted_keys = {key for key, _, _ in evicted}
    n, nbytes, kept = _sweep(local, builds, evicted_keys, gone, grace, dry_run, now)
    removed, removed_bytes = removed + n, removed_bytes + nbytes
    _tidy(local, dry_run)
    bytes_after = bytes_before - removed_bytes if dry_run else cache_size(local)
    return GcReport(bytes_before, bytes_after, len(arts), len(alive), evicted, skipped,
                    removed, removed_bytes, kept, sorted(n[:-5] for n in builds.busy_names), dry_run)


def _sweep(local, builds, evicted_keys, gone, grace, dry_run, now) -> tuple[int, int, int]:
    """Remove unreferenced blobs; returns (removed, bytes removed, kept).

    Order matters (see the module docstring): list the blobs, then look at the build locks,
    then read the refs, so a writer that wrote a blob before the listing either still holds
    its lock (then every unreferenced blob stays) or has set its ref by the time gc reads refs;
    then the parts of every referenced manifest are read, including manifests written after
    the listing (their parts may be old blobs the writer re-used).
    """
    listing = {d: v for d, v in _blob_sizes(local).items() if d not in gone}
    building = bool(builds.busy())
    referenced = {d for k, d in local.refs().items() if k not in evicted_keys}
    manifests: dict[str, set[str]] = {}  # every manifest on disk -> the parts it names
    # Every referenced manifest, listed or not: one a builder stored after the listing (its
    # ref read just now) names parts that may be in the listing (re-used, not rewritten).
    for digest in referenced:
        parts = _read_manifest_parts(local, digest)
        if parts is not None:
            manifests[digest] = parts
    live_parts = set().union(*manifests.values())
    for digest, (size, _) in listing.items():  # unreferenced manifests (rm'd, or being written)
        if (digest not in manifests and digest not in live_parts and size <= _MANIFEST_MAX
                and _is_manifest_blob(local, digest)):
            parts = _read_manifest_parts(local, digest)
            if parts is not None:
                manifests[digest] = parts
    freed = set().union(*gone.values())  # parts of manifests deleted in this run
    removed = removed_bytes = kept = 0
    # 1. unreferenced manifests, each deleted under an exclusive lease lock
    for digest in sorted(set(manifests) - referenced):
        size, mtime = listing[digest]
        if building or now - mtime < grace or _touched(local, digest, mtime):
            kept += 1
            continue
        lease = lease_lock(local, digest)
        if not try_exclusive(lease):  # a reader holds it: the manifest and its parts stay
            kept += 1
            continue
        try:
            if not dry_run:
                local.delete(digest)
                _unlink_quietly(local, (LEASES,), f"{digest}.lock")
        finally:
            lease.release()
        freed |= manifests.pop(digest)
        del listing[digest]
        removed, removed_bytes = removed + 1, removed_bytes + size
    # 2. blobs that no ref and no remaining manifest names
    named = referenced | set(manifests)
    for parts in manifests.values():
        named |= parts
    for digest, (size, mtime) in sorted(listing.items()):
        if digest in named:
            continue
        if building or (digest not in freed and now - mtime < grace) or _touched(local, digest, mtime):
            kept += 1
            continue
        if not dry_run:
            local.delete(digest)
        removed, removed_bytes = removed + 1, removed_bytes + size
    return removed, removed_bytes, kept


def _touched(local: LocalStore, digest: str, mtime: float) -> bool:
    """Whether the blob was rewritten (or re-used, if the writer refreshes its mtime) since gc
    listed it: then a writer wants it, and it stays."""
    try:
        st = local.tree.lstat(("objects", digest[:2]), digest[2:])
    except (OSError, SpmdAotError):
        return True
    return st is None or st.st_mtime != mtime  # None: gone already


def _is_manifest_blob(local: LocalStore, digest: str) -> bool:
    try:
        data = local.read_raw(digest, limit=_MANIFEST_MAX)
    except (OSError, SpmdAotError):
        return False
    return looks_like_manifest(data)


def _unlink_quietly(local: LocalStore, parts: tuple[str, ...], name: str) -> None:
    with contextlib.suppress(OSError, SpmdAotError):
        local.tree.unlink(parts, name)


def _tidy(local: LocalStore, dry_run: bool) -> None:
    """Drop ``used/`` files of refs that are gone, lease files of deleted artifacts, old temps.
    Only regular files directly in those directories are removed (links are left alone)."""
    if dry_run:
        return
    tree = local.tree
    with contextlib.suppress(OSError, SpmdAotError):
        for name, _ in tree.files(USED):
            if not tree.is_file(("refs",), name):
                _unlink_quietly(local, (USED,), name)
    with contextlib.suppress(OSError, SpmdAotError):
        for name, _ in tree.files(LEASES):
            digest = name[:-5]
            if not name.endswith(".lock") or not is_digest(digest) or local.has(digest):
                continue
            lease = lease_lock(local, digest)
            if try_exclusive(lease):
                try:
                    if not local.has(digest):
                        _unlink_quietly(local, (LEASES,), name)
                finally:
                    lease.release()
    with contextlib.suppress(OSError, SpmdAotError):
        local.clean_tmp()

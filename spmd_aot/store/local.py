"""A content-addressed blob store with named refs, on a local (or shared) filesystem.

Why it looks like this:

* Blobs are named by the sha256 of their bytes, so a name can always be checked against the
  content. ``get`` re-hashes on every read: a truncated or bit-flipped artifact is reported
  (and moved aside) instead of being loaded into a training job.
* Every write goes to a uniquely named temp file in ``root/tmp``, is fsync'ed, then
  ``os.replace``'d into place. ``tmp/`` is on the same filesystem as ``objects/`` and
  ``refs/``, so the rename is atomic: readers see the old file or the whole new one, never a
  partial one, and any number of processes may ``put`` the same bytes at once.
* Refs map an opaque key to a digest; they are tiny text files (``<digest>\\n``) so a person
  can inspect the cache with ``cat``.
* The store knows nothing about torch: bytes in, bytes out.

Layout under ``root`` (see cache/README.md)::

    objects/<first 2 hex>/<remaining 62 hex>
    refs/<key>
    locks/<key>.lock
    tmp/
    quarantine/<digest>.<UTC time>
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import logging
import os
import pathlib
import re
import secrets
import stat
import threading
import time
from collections.abc import Iterator

from ..errors import CorruptArtifactError, LockTimeoutError, SpmdAotError, describe_os_error, os_error
from .cache_dir import ENV_CACHE_DIR, default_cache_dir, resolve_cache_dir
from .faults import crash_point
from ..format.limits import load_limits
from . import trust
from .nofollow import LinkError, TooLargeError, Tree
from .locks import FileLock
from .names import check_digest, check_key, digest_of, is_digest, is_key, parse_ref, ref_bytes
from .protocol import LOCAL_FILES, BlobProblem

# BlobProblem: see protocol; the cache-directory rule lives in cache_dir.py (named here too, as before)
__all__ = ["LocalStore", "resolve_cache_dir", "default_cache_dir", "BlobProblem", "ENV_CACHE_DIR"]

#: Environment variable that overrides the default cache directory.

_TMP_SUFFIX = ".tmp"
_PID_RE = re.compile(r"[1-9][0-9]{0,9}")
_CHUNK = 1 << 20
_REF_MAX = 1024  # a ref holds 65 bytes
_SUBDIRS = ("objects", "refs", "locks", "tmp", "quarantine")

log = logging.getLogger(__name__)


def _blob_location(digest: str) -> tuple[tuple[str, ...], str]:
    return ("objects", digest[:2]), digest[2:]


def _fsync_dir(tree: Tree, parts: tuple[str, ...]) -> None:
    """Persist a rename in ``root/parts``. Best effort: not every OS/filesystem allows it."""
    try:
        with tree.dir(*parts) as fd:
            os.fsync(fd)
    except (OSError, SpmdAotError):
        pass


def _write_all(fd: int, view: memoryview) -> None:
    while view:
        n = os.write(fd, view)
        view = view[n:]


def _hash_fd(fd: int) -> tuple[str, int]:
    h = hashlib.sha256()
    size = 0
    while chunk := os.read(fd, _CHUNK):
        h.update(chunk)
        size += len(chunk)
    return h.hexdigest(), size


class LocalStore:
    """Content-addressed blobs plus named refs under one directory.

    Safe for many processes (and threads) on one machine, and on shared filesystems whose
    rename is atomic. ``lock(key)`` serialises expensive work (a build) between processes;
    the store's own reads and writes need no lock. No symbolic link inside the root is ever
    followed (``nofollow.Tree``): the root is resolved once, a linked subdirectory is refused, a
    linked file is treated as damaged, and only regular files are deleted. Without a signing
    key the cache must be writable by nobody else unless ``trust_cache`` (or
    ``$SPMD_AOT_TRUST_CACHE``) says otherwise (``trust.py``: ``UntrustedCacheError``).
    """

    capabilities = frozenset({LOCAL_FILES})

    def __init__(self, root: str | os.PathLike, *, lock_timeout: float = 600.0,
                 trust_cache: bool | None = None) -> None:
        policy = trust.policy_for(trust_cache)
        self.tree = Tree(root, policy)
        self.root = self.tree.root
        self.lock_timeout = lock_timeout
        # Private unless declared shared (``trust_cache`` / $SPMD_AOT_TRUST_CACHE): a new cache
        # directory is 0700, its lock and lease files 0600, so no other user can read entries or
        # hold a lock the owner's builds and loads take. A shared one is 0755, its locks 0660
        # (the group that shares it can take them; others cannot open them).
        self.shared = trust.opted_in(trust_cache)
        self.lock_mode = 0o660 if self.shared else 0o600
        try:
            _make_dirs(self.root, 0o755 if self.shared else 0o700)
        except OSError as e:
            if not self.root.is_dir():
                raise SpmdAotError(
                    f"cannot create cache directory {self.root}: {describe_os_error(e)}; pass another "
                    f"cache_dir or set {ENV_CACHE_DIR}"
                ) from None
        if policy is not None:
            policy.check_ancestors(self.root)
            with self.tree.dir():  # the root itself: refused here, with the reason, not on first use
                pass
        for d in _SUBDIRS:
            try:
                with self.tree.dir(d, create=True):
                    pass
            except LinkError as e:  # refused when used; reads of other parts still work
                log.warning("%s", e)
            except OSError:
                pass  # a read-only cache (e.g. a shared, pre-built one) is still usable for get()

    def __repr__(self) -> str:
        return f"LocalStore({str(self.root)!r})"

    @property
    def location(self) -> str:
        return str(self.root)

    @property
    def local(self) -> LocalStore:
        """The LocalStore holding the blobs as files (``protocol.LOCAL_FILES``): this one."""
        return self

    # ------------------------------------------------------------------ helpers

    def _write_atomic(self, parts: tuple[str, ...], name: str, data: bytes, stage: str = "blob") -> None:
        """Write ``data`` to ``root/parts/name`` so no reader ever sees a partial file.

        ``stage`` names the crash points (``<stage>.partial`` etc., see ``spmd_aot.store.faults``).
        If the temp file vanishes before the rename (``clean_tmp`` on another host mistook our
        pid for a dead one), the write is simply redone under a new temp name. OS errors (a
        full disk, a read-only cache) become ``SpmdAotError``s naming the path and the fix.
        """
        dest = self.tree.path(*parts, name)
        try:
            self._write_atomic_os(parts, name, data, stage)
        except OSError as e:
            raise os_error(e, dest, "write") from None

    def _write_atomic_os(self, parts, name, data, stage) -> None:
        for attempt in range(3):
            # Unique per process and thread; O_EXCL guarantees we never share a temp file.
            tmp = (f"{name[:16]}.{os.getpid()}.{threading.get_ident()}."
                   f"{secrets.token_hex(8)}{_TMP_SUFFIX}")
            fd = self.tree.open(("tmp",), tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0),
                                create_dirs=True)
            try:
                try:
                    view = memoryview(data)
                    _write_all(fd, view[: len(view) // 2])
                    crash_point(f"{stage}.partial")
                    _write_all(fd, view[len(view) // 2 :])
                    os.fsync(fd)
                finally:
                    os.close(fd)
                crash_point(f"{stage}.before_rename")
                try:
                    self.tree.replace(("tmp",), tmp, parts, name, create_dirs=True)
                except FileNotFoundError:
                    if attempt < 2 and self.tree.lstat(("tmp",), tmp) is None:
                        continue  # our temp file was cleaned away: write it again
                    raise
            except BaseException:
                with contextlib.suppress(OSError, SpmdAotError):
                    self.tree.unlink(("tmp",), tmp)
                raise
            crash_point(f"{stage}.after_rename")
            _fsync_dir(self.tree, parts)
            return

    def _quarantine_file(self, digest: str, st: os.stat_result) -> pathlib.Path | None:
        """Move a bad blob aside, unless someone replaced it since we read it."""
        parts, name = _blob_location(digest)
        now = self.tree.lstat(parts, name)
        if now is None or (now.st_ino, now.st_dev) != (st.st_ino, st.st_dev):
            return None  # a concurrent put() already replaced it with a fresh copy
        stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%S.%fZ")
        dest = f"{digest}.{stamp}"
        try:
            self.tree.replace(parts, name, ("quarantine",), dest, create_dirs=True)
        except (OSError, SpmdAotError):
            return None
        return self.tree.path("quarantine", dest)

    # ------------------------------------------------------------------ blobs

    def blob_path(self, digest: str) -> pathlib.Path:
        """Where the blob named ``digest`` lives (whether or not it exists)."""
        parts, name = _blob_location(check_digest(digest))
        return self.tree.path(*parts, name)

    def put(self, data: bytes) -> str:
        """Store ``data``; return its sha256 hex digest.

        Idempotent: if a copy that hashes correctly is already there it is left alone; a
        damaged copy is replaced. Safe to call concurrently with the same bytes.
        """
        data = bytes(data) if not isinstance(data, bytes) else data
        digest = digest_of(data)
        parts, name = _blob_location(digest)
        try:
            fd = self.tree.open(parts, name, os.O_RDONLY)
            try:
                st = os.fstat(fd)
                intact = stat.S_ISREG(st.st_mode) and st.st_size == len(data) and _hash_fd(fd)[0] == digest
            finally:
                os.close(fd)
            if intact:
                # a fresh mtime tells a concurrent gc this blob was just reused
                with contextlib.suppress(OSError, SpmdAotError):
                    self.tree.utime(parts, name)
                return digest
        except (OSError, SpmdAotError):
            pass  # missing, unreadable or a link: (re)write it (the rename replaces a link)
        self._write_atomic(parts, name, data)
        return digest

    def put_stream(self, reader, digest: str) -> int:
        """Store what ``reader`` (a binary file object) yields as blob ``digest``, streamed: hashed
        while written to ``tmp/``, renamed into place only if it hashes to ``digest`` (else
        ``CorruptArtifactError``, nothing stored). Never holds the blob in memory. Returns the
        bytes written (0 when an intact copy was already there)."""
        parts, name = _blob_location(check_digest(digest))
        with contextlib.suppress(OSError, SpmdAotError):
            fd = self.tree.open(parts, name, os.O_RDONLY)
            try:
                if _hash_fd(fd)[0] == digest:
                    return 0
            finally:
                os.close(fd)
        tmp = f"{name[:16]}.{os.getpid()}.{threading.get_ident()}.{secrets.token_hex(8)}{_TMP_SUFFIX}"
        try:
            fd = self.tree.open(("tmp",), tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, create_dirs=True)
            h, size = hashlib.sha256(), 0
            try:
                while chunk := reader.read(_CHUNK):
                    h.update(chunk)
                    _write_all(fd, memoryview(chunk))
                    size += len(chunk)
                os.fsync(fd)
            finally:
                os.close(fd)
            if h.hexdigest() != digest:
                raise CorruptArtifactError(f"blob {digest}: the bytes given hash to {h.hexdigest()}; not stored")
            self.tree.replace(("tmp",), tmp, parts, name, create_dirs=True)
        except OSError as e:
            raise os_error(e, self.tree.path(*parts, name), "write") from None
        finally:
            with contextlib.suppress(OSError, SpmdAotError):
                self.tree.unlink(("tmp",), tmp)
        _fsync_dir(self.tree, parts)
        return size

    def read_raw(self, digest: str, limit: int | None = None) -> bytes:
        """The bytes stored under ``digest``, unchecked and with no side effect (for gc).
        Raises ``OSError`` / ``SpmdAotError`` when missing, unreadable, a link, not a regular
        file or larger than ``limit``."""
        return self.tree.read(*_blob_location(check_digest(digest)), limit=limit)[0]

    def get(self, digest: str, *, limit: int | None = None) -> bytes:
        """Return the bytes named ``digest``, checked against the name.

        A blob whose content does not hash to its name is moved to ``quarantine/`` (so the
        next build rewrites it) and reported as ``CorruptArtifactError``; so is a link or
        anything but a regular file, and a file larger than ``limit`` (refused unread).
        """
        path = self.blob_path(digest)
        try:
            data, st = self.tree.read(*_blob_location(digest), limit=limit)
        except FileNotFoundError:
            raise CorruptArtifactError(f"blob {digest} missing at {path}") from None
        except OSError as e:
            raise CorruptArtifactError(f"blob {digest} unreadable at {path}: {describe_os_error(e)}") from None
        except TooLargeError as e:
            raise CorruptArtifactError(f"blob {digest} refused: {e}; if the artifact is yours, raise the "
                                       "load limits with SPMD_AOT_LOAD_LIMITS") from None
        except LinkError as e:
            raise CorruptArtifactError(f"blob {digest} refused: {e}") from None
        actual = digest_of(data)
        if actual != digest:
            moved = self._quarantine_file(digest, st)
            where = (
                f"moved to {moved}"
                if moved is not None
                else "not moved (it changed or could not be moved)"
            )
            raise CorruptArtifactError(
                f"blob {path} is corrupt: expected sha256 {digest}, content ({len(data)} bytes) "
                f"hashes to {actual}; {where}. Rebuild the artifact to store a good copy."
            )
        return data

    def has(self, digest: str) -> bool:
        """Whether a blob named ``digest`` exists as a regular file (its content is not checked)."""
        try:
            return self.tree.is_file(*_blob_location(check_digest(digest)))
        except (OSError, LinkError):
            return False

    def size(self, digest: str) -> int | None:
        """The blob file's size in bytes; None if it is missing or not a regular file."""
        try:
            st = self.tree.lstat(*_blob_location(check_digest(digest)))
        except (OSError, LinkError):
            return None
        return st.st_size if st is not None and stat.S_ISREG(st.st_mode) else None

    def delete(self, digest: str) -> None:
        """Remove a blob (a regular file only); no error if it is absent."""
        try:
            self.tree.unlink(*_blob_location(check_digest(digest)))
        except LinkError as e:
            log.warning("not deleting blob %s: %s", digest, e)

    def blob_stats(self) -> dict[str, os.stat_result]:
        """digest -> lstat of every blob file (links and malformed names are skipped)."""
        out = {}
        for fan in self.tree.dirs("objects"):
            if len(fan) != 2:
                continue
            try:
                files = self.tree.files("objects", fan)
            except LinkError:
                continue
            for name, st in files:
                if is_digest(fan + name):
                    out[fan + name] = st
        return out

    def blobs(self) -> Iterator[str]:
        """All stored digests, in sorted order (links and files with malformed names are skipped)."""
        yield from sorted(self.blob_stats())

    # ------------------------------------------------------------------ refs

    def set_ref(self, key: str, digest: str) -> None:
        """Point ``key`` at ``digest``, atomically (readers see the old or the new target)."""
        check_key(key)
        check_digest(digest)
        self._write_atomic(("refs",), key, ref_bytes(digest), stage="ref")

    def get_ref(self, key: str) -> str | None:
        """The digest ``key`` points to, or None if there is no such ref."""
        path = self.tree.path("refs", check_key(key))
        try:
            raw, _ = self.tree.read(("refs",), key, limit=_REF_MAX)
        except FileNotFoundError:
            return None
        except OSError as e:
            raise CorruptArtifactError(f"ref {key!r} unreadable at {path}: {describe_os_error(e)}") from None
        except (LinkError, TooLargeError) as e:
            raise CorruptArtifactError(f"ref {key!r} refused: {e}") from None
        return parse_ref(raw, f"ref file {path}", "delete it (or rebuild) to fix")

    def delete_ref(self, key: str) -> None:
        """Remove a ref; no error if it is absent."""
        self.tree.unlink(("refs",), check_key(key))

    def ref_keys(self) -> list[str]:
        """Every valid key with an entry in ``refs/`` that is a file or a link, sorted: a linked
        or damaged ref is listed (its ``get_ref`` raises) so that listings can flag it. A linked
        ``refs/`` raises ``LinkError``: no listing may look like an empty cache (gc would sweep)."""
        return [name for name, st in self.tree.entries("refs")
                if is_key(name) and (stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode))]

    def refs(self) -> dict[str, str]:
        """All readable refs as key -> digest, sorted by key.

        A damaged ref file is skipped rather than failing every listing; ``verify()`` reports it.
        """
        out: dict[str, str] = {}
        for key in self.ref_keys():
            try:
                digest = self.get_ref(key)
            except CorruptArtifactError:
                continue
            if digest is not None:  # removed since listing
                out[key] = digest
        return out

    # ------------------------------------------------------------------ locks

    def lock_file(self, parts: tuple[str, ...], name: str) -> FileLock:
        """A lock on ``root/parts/name`` whose file is created (or narrowed to) ``lock_mode``."""
        return FileLock(self.tree, parts, name, self.lock_mode)

    @contextlib.contextmanager
    def lock(self, key: str, timeout: float | None = None) -> Iterator[pathlib.Path]:
        """Hold an inter-process lock named ``key`` (e.g. while building one artifact).

        ``timeout`` defaults to the store's ``lock_timeout``; a negative value waits forever.
        Yields the lock file's path.
        """
        lock = self.lock_file(("locks",), f"{check_key(key)}.lock")
        t = self.lock_timeout if timeout is None else timeout
        try:
            taken = lock.acquire(t)
        except OSError as e:
            raise os_error(e, lock.path, "lock") from None
        if not taken:
            raise LockTimeoutError(
                f"could not take lock {lock.path} within {t:g} s: another process (probably another "
                f"spmd-aot build or job using the cache {self.root}) holds it. Wait for it to "
                f"finish or raise the timeout; if no such process is running, the lock is stale: "
                f"delete {lock.path} and retry."
            )
        try:
            # The lock is the builder's path: clear what killed writers left in tmp/ first.
            with contextlib.suppress(OSError, SpmdAotError):
                self.clean_tmp(dead_writers=True)
            crash_point("lock.acquired")
            yield lock.path
        finally:
            lock.release()

    # ------------------------------------------------------------------ maintenance

    def verify(self) -> list[BlobProblem]:
        """Re-hash every blob and check every ref; report problems without changing anything."""
        problems: list[BlobProblem] = []
        limits = load_limits()
        largest = max(limits.graph_bytes, limits.constants_bytes, limits.part_bytes)
        for sub in _SUBDIRS + ("leases", "used"):
            st = self.tree.lstat((), sub)
            if st is not None and not stat.S_ISDIR(st.st_mode):
                problems.append(BlobProblem("", str(self.tree.path(sub)), "symbolic link or not a directory"))
        try:
            fans = self.tree.entries("objects")
        except LinkError:
            fans = []
        for fan, st in fans:
            path = str(self.tree.path("objects", fan))
            if stat.S_ISLNK(st.st_mode):
                problems.append(BlobProblem(fan, path, "symbolic link (never followed)"))
                continue
            if len(fan) != 2 or not stat.S_ISDIR(st.st_mode):
                problems.append(BlobProblem(fan, path, "bad name"))
                continue
            try:
                entries = self.tree.entries("objects", fan)
            except (OSError, LinkError) as e:
                problems.append(BlobProblem(fan, path, f"unreadable: {e}"))
                continue
            for entry, est in entries:
                name = fan + entry
                epath = str(self.tree.path("objects", fan, entry))
                if stat.S_ISLNK(est.st_mode):
                    problems.append(BlobProblem(name, epath, "symbolic link (never followed)"))
                    continue
                if not is_digest(name) or not stat.S_ISREG(est.st_mode):
                    problems.append(BlobProblem(name, epath, "bad name" if not is_digest(name) else
                                                "not a regular file (a FIFO, device or directory)"))
                    continue
                if est.st_size > largest:  # never hashed: no load would read it either
                    problems.append(BlobProblem(name, epath, f"{est.st_size} bytes, larger than any blob a "
                                                f"load reads ({largest}; SPMD_AOT_LOAD_LIMITS)"))
                    continue
                try:
                    fd = self.tree.open(("objects", fan), entry, os.O_RDONLY)
                    try:
                        actual, _ = _hash_fd(fd)
                    finally:
                        os.close(fd)
                except (OSError, LinkError) as e:
                    problems.append(BlobProblem(name, epath, f"unreadable: {e}"))
                    continue
                if actual != name:
                    problems.append(BlobProblem(name, epath, f"content hashes to {actual}"))
        try:
            ref_entries = self.tree.entries("refs")
        except LinkError:
            ref_entries = []
        for key, st in ref_entries:
            path = self.tree.path("refs", key)
            if not stat.S_ISREG(st.st_mode):
                problems.append(BlobProblem("", str(path), f"ref {key} is a symbolic link or not a file"))
                continue
            if not is_key(key):
                continue
            try:
                target = self.get_ref(key)
            except CorruptArtifactError as e:
                problems.append(BlobProblem("", str(path), f"ref {key} is damaged: {e}"))
                continue
            if target is not None and not self.has(target):
                problems.append(
                    BlobProblem(target, str(path), f"ref {key} points to missing blob")
                )
        return problems

    def clean_tmp(self, older_than: float = 3600.0, *, dead_writers: bool = False) -> int:
        """Remove temp files older than ``older_than`` seconds (left by killed writers).

        The age threshold keeps this safe to run while other processes are writing. With
        ``dead_writers`` also remove, whatever their age, temp files whose writer (the pid in
        the name) is no longer running on this host. On a cache shared between hosts that pid
        may belong to a live writer elsewhere; such a writer notices its vanished temp file
        and writes again. ``lock()`` runs this with ``dead_writers=True``. Only regular files
        directly in ``tmp/`` are removed (a linked ``tmp/`` raises ``LinkError``).
        Returns how many files were removed.
        """
        cutoff = time.time() - older_than
        removed = 0
        for name, st in self.tree.files("tmp"):
            if st.st_mtime < cutoff or (dead_writers and not _writer_alive(name)):
                if self.tree.unlink(("tmp",), name):
                    removed += 1
        return removed


def _make_dirs(path: pathlib.Path, mode: int) -> None:
    """``mkdir -p`` with ``mode`` (0700, or 0755 for a shared cache) for every directory it
    creates; the umask can only narrow it, so a fresh cache passes the trust rule (``trust.py``)."""
    missing = []
    while not path.exists() and path != path.parent:
        missing.append(path)
        path = path.parent
    for p in reversed(missing):
        with contextlib.suppress(FileExistsError):
            p.mkdir(mode)


def _writer_alive(tmp_name: str) -> bool:
    """Whether the process that created temp file ``tmp_name`` may still be writing it.

    Names are ``<prefix>.<pid>.<thread id>.<hex>.tmp`` (the prefix may contain dots). Anything
    that does not parse counts as alive: only provably dead writers' files are removed early.
    """
    parts = tmp_name.rsplit(".", 4)
    if len(parts) != 5 or "." + parts[4] != _TMP_SUFFIX or not _PID_RE.fullmatch(parts[1]):
        return True
    pid = int(parts[1])
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (OSError, OverflowError):
        return True  # exists (another user's process: EPERM) or cannot tell
    try:  # a killed child that its parent has not reaped yet is a zombie: dead
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[-1].split()[:1] != [b"Z"]
    except OSError:
        return True

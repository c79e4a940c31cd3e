"""Inter-process file locks inside a cache, opened without following links.

``flock`` is what the cache uses (the kernel releases it when its holder dies, so a killed
builder never blocks the next). Some filesystems (certain FUSE and network mounts) refuse
``flock``; there a lock falls back to POSIX record locks (``lockf``), which those usually
support, and if neither works the lock raises an ``SpmdAotError`` that names the path and the
fix instead of an ``OSError`` traceback.
"""

from __future__ import annotations

import errno
import os
import stat
import time

from ..errors import SpmdAotError
from .nofollow import Tree

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None

__all__ = ["FileLock", "locks_supported"]

_UNSUPPORTED = {errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOLCK, errno.ENOSYS, errno.EINVAL}


def locks_supported() -> bool:
    return fcntl is not None


def _try_lock(fd: int, shared: bool, path) -> bool:
    """One non-blocking attempt: flock, else lockf on filesystems without flock."""
    try:
        fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    except OSError as exc:
        if exc.errno not in _UNSUPPORTED:
            raise
    try:
        fcntl.lockf(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
        return True
    except (BlockingIOError, PermissionError):
        return False
    except OSError as exc:
        if exc.errno in _UNSUPPORTED:
            raise SpmdAotError(
                f"cannot lock {path}: the filesystem supports neither flock nor POSIX locks "
                f"({os.strerror(exc.errno)}). Put the cache on a filesystem with locking (a local disk, "
                "NFSv4, Lustre with -o flock), or give each host its own --cache-dir.") from None
        raise


class FileLock:
    """An exclusive (or shared) lock on ``root/parts/name``, created if missing.

    After locking it re-checks that the name still refers to the locked file: gc unlinks lease
    files of deleted artifacts, and a lock on an unlinked file protects nothing.

    ``flock`` needs only a descriptor, and any user who can open a file for reading can hold
    one: so a lock file is created with ``mode`` (``LocalStore.lock_mode``: 0600, or 0660 in a
    cache declared shared), and one of ours with more permission bits (made by an older
    release, 0644) is narrowed to ``mode`` when opened.
    """

    def __init__(self, tree: Tree, parts: tuple[str, ...], name: str, mode: int = 0o600) -> None:
        self.tree, self.parts, self.name, self.mode = tree, parts, name, mode
        self.path = tree.path(*parts, name)
        self.fd: int | None = None

    def acquire(self, timeout: float, shared: bool = False) -> bool:
        """Take the lock within ``timeout`` seconds (negative: wait forever); whether it was taken."""
        if fcntl is None:  # pragma: no cover
            raise SpmdAotError("file locks need POSIX fcntl, which this platform lacks")
        deadline = None if timeout < 0 else time.monotonic() + timeout
        delay = 0.001
        while True:
            fd = self.tree.open(self.parts, self.name, os.O_RDWR | os.O_CREAT, self.mode, create_dirs=True)
            try:
                self._narrow(fd)
                locked = _try_lock(fd, shared, self.path)
                if locked and self._still_named(fd):
                    self.fd = fd
                    return True
            except BaseException:
                os.close(fd)
                raise
            os.close(fd)
            if locked:
                continue  # the file was unlinked meanwhile: lock the new one
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(delay)
            delay = min(delay * 2, 0.05)

    def _narrow(self, fd: int) -> None:
        st = os.fstat(fd)
        extra = stat.S_IMODE(st.st_mode) & ~self.mode
        if extra and st.st_uid == os.geteuid():
            try:
                os.fchmod(fd, stat.S_IMODE(st.st_mode) & self.mode)
            except OSError:  # a filesystem without modes: nothing to narrow
                pass

    def _still_named(self, fd: int) -> bool:
        st = self.tree.lstat(self.parts, self.name)
        return st is not None and st.st_ino == os.fstat(fd).st_ino

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing drops flock and lockf locks alike
            self.fd = None

"""Filesystem access below a cache root that never follows a symbolic link.

A shared cache may be writable by others. A link planted anywhere in its layout
(``tmp -> ~``, ``used -> ~/project``, ``objects/ab -> another cache``, ``used/<key> -> ~/.bashrc``)
must not make spmd-aot read, create or delete anything outside the root. So the root is
resolved once, and everything below it is reached one component at a time from directory file
descriptors opened with ``O_NOFOLLOW``: a linked directory is refused (``LinkError``), files are
opened with ``O_NOFOLLOW``, listings use ``lstat``, and only regular files are ever deleted.

Every file is opened ``O_NONBLOCK`` and must then ``fstat`` as a regular file: a FIFO, socket or
device planted at a blob, ref, lock or last-use record is refused at once instead of blocking
the job forever. Reads are capped (``read(..., limit=)``) by the size the caller expects, checked
on the open descriptor, so a file swapped in after a size check cannot make a read unbounded.
Every directory walked is also checked against the cache's trust rule (``trust.py``).
"""

from __future__ import annotations

import contextlib
import errno
import os
import pathlib
import stat as stat_mod
from collections.abc import Iterator

from ..errors import SpmdAotError
from . import trust

__all__ = ["Tree", "LinkError", "TooLargeError"]

_DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0)
NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_CHUNK = 1 << 20


class LinkError(SpmdAotError):
    """Something inside the cache is a symbolic link (or not what the layout says it is)."""


def _link_error(path: pathlib.Path) -> LinkError:
    try:
        target = f" (to {os.readlink(path)})"
    except OSError:
        target = ""
    return LinkError(f"{path} is a symbolic link{target} or not a directory; spmd-aot never follows links "
                     "inside a cache directory. Remove it (someone with write access to the cache put it "
                     "there) and retry.")


class TooLargeError(SpmdAotError):
    """A file is larger than the reader allows; nothing past the limit was read."""


class Tree:
    """The directory ``root`` (resolved once) and safe operations on names below it.

    ``policy`` (``trust.Policy``) is checked on every directory walked; None checks nothing."""

    def __init__(self, root: str | os.PathLike, policy: trust.Policy | None = None) -> None:
        self.root = pathlib.Path(os.path.realpath(pathlib.Path(root).expanduser()))
        self.policy = policy

    def path(self, *parts: str) -> pathlib.Path:
        return self.root.joinpath(*parts)

    @contextlib.contextmanager
    def dir(self, *parts: str, create: bool = False) -> Iterator[int]:
        """A descriptor of ``root/parts...``; each component must be a real directory."""
        fd = os.open(self.root, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            if self.policy is not None:
                self.policy.check_dir(os.fstat(fd), self.root)
            for i, part in enumerate(parts):
                if create:
                    with contextlib.suppress(FileExistsError):
                        os.mkdir(part, 0o755, dir_fd=fd)  # never group-writable, whatever the umask
                try:
                    new = os.open(part, _DIR_FLAGS, dir_fd=fd)
                except OSError as exc:
                    if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                        raise _link_error(self.path(*parts[: i + 1])) from None
                    raise
                os.close(fd)
                fd = new
                if self.policy is not None:
                    self.policy.check_dir(os.fstat(fd), self.path(*parts[: i + 1]))
            yield fd
        finally:
            os.close(fd)

    def open(self, parts: tuple[str, ...], name: str, flags: int, mode: int = 0o644,
             create_dirs: bool = False) -> int:
        """``os.open`` of ``root/parts/name`` with ``O_NOFOLLOW | O_NONBLOCK``; a link, or anything
        but a regular file (a FIFO, a device, a directory), is refused with ``LinkError``."""
        with self.dir(*parts, create=create_dirs) as d:
            try:
                fd = os.open(name, flags | NOFOLLOW | NONBLOCK, mode, dir_fd=d)
            except OSError as exc:
                if exc.errno == errno.ELOOP:
                    raise _link_error(self.path(*parts, name)) from None
                if exc.errno in (errno.ENXIO, errno.EISDIR, errno.ENODEV):  # a FIFO without reader, a dir
                    raise LinkError(f"{self.path(*parts, name)} is not a regular file; remove it") from None
                raise
        try:
            if not stat_mod.S_ISREG(os.fstat(fd).st_mode):
                raise LinkError(f"{self.path(*parts, name)} is not a regular file (a FIFO, device or "
                                "directory someone put there); remove it")
        except BaseException:
            os.close(fd)
            raise
        return fd

    def read(self, parts: tuple[str, ...], name: str, limit: int | None = None) -> tuple[bytes, os.stat_result]:
        """The bytes of a regular file and its ``fstat``; ``TooLargeError`` before reading when
        it is larger than ``limit``. Never reads more than its size at open (or ``limit``) + 1."""
        fd = self.open(parts, name, os.O_RDONLY)
        try:
            st = os.fstat(fd)
            if limit is not None and st.st_size > limit:
                raise TooLargeError(f"{self.path(*parts, name)} is {st.st_size} bytes, more than the "
                                    f"{limit} allowed here")
            cap = st.st_size if limit is None else limit
            chunks, got = [], 0
            while got <= cap:
                chunk = os.read(fd, min(_CHUNK, cap + 1 - got))
                if not chunk:
                    break
                chunks.append(chunk)
                got += len(chunk)
            if got > cap and limit is not None:
                raise TooLargeError(f"{self.path(*parts, name)} grew past the {limit} bytes allowed here")
            return b"".join(chunks), st
        finally:
            os.close(fd)

    def lstat(self, parts: tuple[str, ...], name: str) -> os.stat_result | None:
        """``lstat`` of ``root/parts/name``; None when it (or a directory on the way) is missing."""
        try:
            with self.dir(*parts) as d:
                return os.stat(name, dir_fd=d, follow_symlinks=False)
        except FileNotFoundError:
            return None

    def is_file(self, parts: tuple[str, ...], name: str) -> bool:
        st = self.lstat(parts, name)
        return st is not None and stat_mod.S_ISREG(st.st_mode)

    def unlink(self, parts: tuple[str, ...], name: str) -> bool:
        """Delete ``root/parts/name`` if it is a regular file; whether it was deleted."""
        try:
            with self.dir(*parts) as d:
                st = os.stat(name, dir_fd=d, follow_symlinks=False)
                if not stat_mod.S_ISREG(st.st_mode):
                    return False
                os.unlink(name, dir_fd=d)
                return True
        except FileNotFoundError:
            return False

    def entries(self, *parts: str) -> list[tuple[str, os.stat_result]]:
        """(name, lstat) of every entry of ``root/parts``, sorted; [] if it does not exist."""
        try:
            with self.dir(*parts) as d:
                names = sorted(os.listdir(d))
                out = []
                for name in names:
                    with contextlib.suppress(FileNotFoundError):
                        out.append((name, os.stat(name, dir_fd=d, follow_symlinks=False)))
                return out
        except FileNotFoundError:
            return []

    def files(self, *parts: str) -> list[tuple[str, os.stat_result]]:
        return [(n, st) for n, st in self.entries(*parts) if stat_mod.S_ISREG(st.st_mode)]

    def dirs(self, *parts: str) -> list[str]:
        return [n for n, st in self.entries(*parts) if stat_mod.S_ISDIR(st.st_mode)]

    def replace(self, src: tuple[str, ...], src_name: str, dst: tuple[str, ...], dst_name: str,
                create_dirs: bool = False) -> None:
        """Atomically rename ``src/src_name`` over ``dst/dst_name`` (a link there is replaced, not followed)."""
        with self.dir(*src) as s, self.dir(*dst, create=create_dirs) as d:
            os.replace(src_name, dst_name, src_dir_fd=s, dst_dir_fd=d)

    def utime(self, parts: tuple[str, ...], name: str) -> None:
        """Set the mtime of a regular file to now (a link is not followed)."""
        with self.dir(*parts) as d:
            os.utime(name, dir_fd=d, follow_symlinks=False)

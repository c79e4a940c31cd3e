"""The project's error types.

Every failure the user can act on is raised as a subclass of ``SpmdAotError`` with a message
that says what happened, what was expected, what was found, and how to fix it. Loaders never
let a foreign exception (KeyError, msgpack's, torch's) escape on malformed input.
"""

__all__ = [
    "SpmdAotError",
    "TargetError",
    "UnsupportedError",
    "CacheMissError",
    "ArtifactMismatchError",
    "CorruptArtifactError",
    "UnsafeArtifactError",
    "LoadLimitError",
    "OpNotAllowedError",
    "LockTimeoutError",
    "CacheIOError",
    "os_error",
    "describe_os_error",
]

import errno as _errno
import os as _os


class SpmdAotError(Exception):
    """Base class of every error spmd-aot raises on purpose."""


class TargetError(SpmdAotError):
    """A build TARGET could not be imported or did not return a ``Job``."""


class UnsupportedError(SpmdAotError):
    """The step uses something the tracer or expander cannot handle (raised at build time)."""


class CacheMissError(SpmdAotError):
    """``require_hit=True`` and no artifact matches the live job's key."""


class ArtifactMismatchError(SpmdAotError):
    """A loaded artifact does not fit the live job (world size, batch shapes, state layout)."""


class CorruptArtifactError(SpmdAotError):
    """A stored blob does not hash to its name, or cannot be decoded."""


class UnsafeArtifactError(CorruptArtifactError):
    """A stored graph names a callable outside the op allowlist."""


class LoadLimitError(UnsafeArtifactError):
    """A stored artifact would make loading (or ``verify``) do more work than a load limit
    (``format/limits.py``) allows; the message names the limit and ``SPMD_AOT_LOAD_LIMITS``."""


class OpNotAllowedError(UnsafeArtifactError):
    """A stored graph calls an overload that is neither on the allowlist nor opted in to by this
    job (``allow_ops``). Not repaired by rebuilding: the build that stored it opted in, or a
    writer of the cache put it there; the job says which op and how to opt in."""

    def __init__(self, message: str, op: str = ""):
        super().__init__(message)
        self.op = op


class LockTimeoutError(SpmdAotError):
    """A cache lock could not be taken in time."""


class CacheIOError(SpmdAotError):
    """The cache's filesystem refused an operation: full, over quota, read-only, no permission.

    ``errno`` keeps the OS error number, so callers can tell a full disk from the rest.
    """

    def __init__(self, message: str, errno: int | None = None):
        super().__init__(message)
        self.errno = errno


_FIXES = {
    _errno.ENOSPC: "the filesystem is full: free space (`spmd-aot gc --max-size ...`) or point "
                   "--cache-dir / SPMD_AOT_CACHE_DIR at a larger disk",
    _errno.EDQUOT: "your disk quota is used up: free space (`spmd-aot gc --max-size ...`) or use a cache "
                   "directory on another quota",
    _errno.EFBIG: "the file is larger than this process may write (`ulimit -f`, RLIMIT_FSIZE) or than the "
                  "filesystem allows: raise the limit or use another cache directory",
    _errno.EROFS: "the cache is on a read-only filesystem: loading from it still works; to build or store, "
                  "use a writable --cache-dir",
    _errno.EACCES: "you may not write there: fix the directory's owner or mode, or use a cache directory "
                   "you own",
    _errno.EPERM: "the operation is not permitted there: fix the directory's owner or mode, or use a cache "
                  "directory you own",
}


def describe_os_error(exc: OSError) -> str:
    """``"No space left on device (ENOSPC)"`` for an ``OSError``."""
    code = exc.errno
    name = _errno.errorcode.get(code, str(code)) if code is not None else "?"
    return f"{exc.strerror or _os.strerror(code or 0)} ({name})"


def os_error(exc: OSError, path, action: str) -> CacheIOError:
    """A ``CacheIOError`` for ``exc`` raised while trying to ``action`` ``path``: what, errno, fix."""
    fix = _FIXES.get(exc.errno, "check the cache directory and retry")
    return CacheIOError(f"cannot {action} {path}: {describe_os_error(exc)}; {fix}", exc.errno)

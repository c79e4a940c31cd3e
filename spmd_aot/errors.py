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
    "LockTimeoutError",
]


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


class LockTimeoutError(SpmdAotError):
    """A cache lock could not be taken in time."""

"""Fault injection for crash tests: kill this process at a named stage of a cache write.

**For tests only.** Nothing happens unless the environment variable ``SPMD_AOT_CRASH_AT``
names a stage; production code pays one dictionary lookup per crash point.

``SPMD_AOT_CRASH_AT`` is a comma-separated list of entries ``STAGE`` or ``STAGE:N``. When the
process reaches ``STAGE`` (the N-th time it reaches it, counting from 1; N defaults to 1) it
sends itself SIGKILL: no ``finally`` blocks, no atexit handlers, no flushing, exactly like
``kill -9`` or the OOM killer. Example::

    SPMD_AOT_CRASH_AT=blob.partial:3 spmd-aot build ...   # die half-way through the 3rd blob write

This module imports nothing from torch or the rest of the package (the store uses it).
"""

from __future__ import annotations

import os
import signal

__all__ = ["ENV_CRASH_AT", "STAGES", "crash_point"]

#: Environment variable naming the stage(s) at which to crash.
ENV_CRASH_AT = "SPMD_AOT_CRASH_AT"

#: Every stage a crash can be injected at, in the order a build reaches them.
#: ``blob.*`` fire in ``LocalStore.put`` (each blob actually written), ``ref.*`` in
#: ``LocalStore.set_ref``; ``artifact.*`` in ``entries.store_artifact``.
STAGES = (
    "lock.acquired",  # LocalStore.lock: just after taking the inter-process lock (builder holds it)
    "blob.partial",  # temp file created and half of the bytes written, not fsync'ed
    "blob.before_rename",  # temp file fully written and fsync'ed, not yet renamed into objects/
    "blob.after_rename",  # blob renamed into place, directory not yet fsync'ed
    "artifact.parts_stored",  # the five part blobs stored, manifest not yet
    "artifact.manifest_stored",  # manifest blob stored, ref not yet set
    "ref.partial",  # ref temp file half written
    "ref.before_rename",  # ref temp file complete, not yet renamed into refs/
    "ref.after_rename",  # ref renamed into place, directory not yet fsync'ed
    "artifact.ref_set",  # store_artifact finished: parts, manifest and ref all written
)

_hits: dict[str, int] = {}


def _wanted(stage: str, env: str) -> int | None:
    """The occurrence number at which ``stage`` should crash, or None if it is not listed."""
    for entry in env.split(","):
        name, _, count = entry.strip().partition(":")
        if name == stage:
            try:
                return max(int(count), 1) if count else 1
            except ValueError:
                return 1
    return None


def crash_point(stage: str) -> None:
    """SIGKILL this process if ``SPMD_AOT_CRASH_AT`` selects this occurrence of ``stage``."""
    env = os.environ.get(ENV_CRASH_AT)
    if not env:
        return
    want = _wanted(stage, env)
    if want is None:
        return
    _hits[stage] = _hits.get(stage, 0) + 1
    if _hits[stage] == want:
        os.kill(os.getpid(), signal.SIGKILL)

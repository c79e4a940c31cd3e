"""Find the stored entry that may serve a key: the newest one whose guards hold here.

One key can hold several entries: when the key matches but a guard fails (a helper file was
edited, a library upgraded), the new trace is stored as a new manifest whose ``previous``
names the one it replaces, and the ref moves to it. Lookup follows that chain from the ref,
newest first, up to ``MAX_ENTRIES``, so jobs that alternate between two versions of a helper
both hit. Only the newest entry is named by the ref: gc, push/pull and bundles keep that one,
and an older entry that gc removed just ends the chain (a miss, then a rebuild).
"""

from __future__ import annotations

import dataclasses
import logging

from . import guards
from ..entries import read_manifest
from ..errors import CorruptArtifactError
from .key import CacheKey

__all__ = ["Lookup", "find_entry", "MAX_ENTRIES"]

log = logging.getLogger(__name__)

MAX_ENTRIES = 8


@dataclasses.dataclass(frozen=True)
class Lookup:
    digest: str | None  # the manifest that may serve, or None (a miss)
    head: str | None  # the newest readable manifest of this key (``previous`` of a new entry)
    misses: tuple[str, ...]  # why each newer entry could not serve (a failed guard, named)
    # the serving entry's manifest, as read and verified here (``read_artifact`` need not read it again)
    manifest: dict | None = dataclasses.field(default=None, compare=False, repr=False)

    def explain(self) -> str:
        return "; ".join(self.misses)


def find_entry(store, key: CacheKey) -> Lookup:
    """Raises ``CorruptArtifactError`` when the ref itself names a damaged manifest or one of
    another key (the caller rebuilds or refuses); damage further down the chain ends it."""
    digest = store.get_ref(key.key)
    head, misses, seen = None, [], set()
    while digest is not None and digest not in seen and len(seen) < MAX_ENTRIES:
        seen.add(digest)
        try:
            manifest = read_manifest(store, digest)
            if manifest["key"] != key.key:
                raise CorruptArtifactError(
                    f"ref {key.key[:12]} leads to manifest {digest[:12]} of key {manifest['key'][:12]}")
        except CorruptArtifactError as exc:
            if head is None:
                raise
            log.info("older entry %s of key %s is unusable (%s); ending its chain", digest[:12], key.key[:12], exc)
            break
        head = head or digest
        problem = guards.check(manifest["guards"], key)
        if problem is None:
            return Lookup(digest, head, tuple(misses), manifest)
        log.info("entry %s of key %s does not serve: %s", digest[:12], key.key[:12], problem)
        misses.append(f"entry {digest[:12]}: {problem}")
        digest = manifest["previous"]
    return Lookup(None, head, tuple(misses))

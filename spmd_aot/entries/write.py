"""An entry written into a store: parts first, manifest next, ref last, with crash points between.

A reader never sees a ref to a missing blob: every part is stored before the manifest that names
it, and the ref is set only once the manifest is stored. ``crash_point`` names the moments in
between, where the crash tests (``tests/store/test_crash.py``) kill a builder. With
``SPMD_AOT_SIGNING_KEY`` set the manifest is signed first (``format/signing.py``).
"""

from __future__ import annotations

from ..format import signing
from ..format.digests import digest_of
from ..store.faults import crash_point
from ..store.memory_store import MemoryStore

__all__ = ["store_artifact", "artifact_in_memory"]


def store_artifact(store, key: str, blobs: dict[str, bytes]) -> str:
    """Write parts first, manifest next, ref last: a reader never sees a ref to a missing blob.

    With ``SPMD_AOT_SIGNING_KEY`` set the manifest is signed first (see ``signing``).
    """
    for name, data in blobs.items():
        if name != "manifest":
            store.put(data)
    crash_point("artifact.parts_stored")
    manifest = blobs["manifest"]
    key_bytes = signing.signing_key()
    if key_bytes is not None:
        manifest = signing.sign_manifest_blob(manifest, key_bytes)
    digest = store.put(manifest)
    crash_point("artifact.manifest_stored")
    store.set_ref(key, digest)
    crash_point("artifact.ref_set")
    return digest


def artifact_in_memory(blobs: dict[str, bytes]) -> tuple[str, MemoryStore]:
    """(manifest digest, MemoryStore) holding a build the cache could not take, signed as
    ``store_artifact`` would sign it, so it loads through the same checks."""
    blobs = dict(blobs)
    key_bytes = signing.signing_key()
    if key_bytes is not None:
        blobs["manifest"] = signing.sign_manifest_blob(blobs["manifest"], key_bytes)
    named = {digest_of(data): data for data in blobs.values()}
    return digest_of(blobs["manifest"]), MemoryStore(named, root="<this job's own trace>")

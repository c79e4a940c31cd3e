"""Copy whole artifacts (ref + manifest + part blobs) between stores, verifying every digest.

The store is torch-free and treats blobs as opaque bytes; the one thing it has to know about
the artifact format (cache/README.md) is that a manifest blob is a header line (``signing``)
and a msgpack map whose ``blobs`` field maps part names to the digests of the other blobs,
and whose ``key`` field is the key its ref is named by. ``manifest_parts`` reads just that,
within the load limits (``bounded``), so pushing, pulling, exporting and garbage collection
work on whole artifacts without importing torch.
"""

from __future__ import annotations

import dataclasses

from ..format import bounded
from ..format import signing
from ..errors import CorruptArtifactError, SpmdAotError
from ..format.limits import load_limits
from .names import digest_of, is_digest
from .protocol import Store, holds, local_files

__all__ = ["manifest_parts", "manifest_key", "looks_like_manifest", "blob_list", "artifact_blobs", "copy_artifact", "CopyResult"]


def _decode_manifest(data: bytes, where: str) -> dict:
    """The manifest map (signature not checked: these readers only move or delete blobs)."""
    limits = load_limits()
    if len(data) > limits.part_bytes:
        raise CorruptArtifactError(f"{where} is {len(data)} bytes, more than the load limit part_bytes")
    _, body = signing.split(data, where)
    manifest = bounded.unpack(body, where, objects=limits.objects, max_array=limits.items, max_map=limits.items)
    if not isinstance(manifest, dict):
        raise CorruptArtifactError(f"{where} is not a manifest (not a msgpack map)")
    return manifest


def manifest_parts(data: bytes, where: str = "manifest") -> dict[str, str]:
    """Part name -> digest of the blobs a manifest names (``CorruptArtifactError`` if malformed)."""
    blobs = _decode_manifest(data, where).get("blobs")
    if not isinstance(blobs, dict) or not blobs:
        raise CorruptArtifactError(f"{where} names no part blobs")
    for name, digest in blobs.items():
        if not isinstance(name, str) or not is_digest(digest):
            raise CorruptArtifactError(f"{where}: part {name!r} has invalid digest {str(digest)[:80]!r}")
    return dict(blobs)


def manifest_key(data: bytes, where: str = "manifest") -> str | None:
    key = _decode_manifest(data, where).get("key")
    return key if isinstance(key, str) else None


def largest_blob() -> int:
    """The largest blob any load reads (``LoadLimits``): nothing larger is ever read whole."""
    limits = load_limits()
    return max(limits.graph_bytes, limits.constants_bytes, limits.part_bytes)


def looks_like_manifest(data: bytes) -> bool:
    """Cheap test used by gc to find manifests among unreferenced blobs."""
    if not signing.is_manifest_blob(data):
        return False
    try:
        manifest_parts(data)
    except CorruptArtifactError:
        return False
    return True


def blob_list(parts: dict[str, str], digest: str) -> list[tuple[str, str]]:
    """An artifact's blobs as (part name, digest), its manifest (``digest``) first: the one list of
    what an entry holds (copying, verifying, listing, bundling and lending an artifact walk it)."""
    return [("manifest", digest), *parts.items()]


def artifact_blobs(store: Store, digest: str, where: str | None = None) -> dict[str, str]:
    """``{"manifest": digest, <part>: <digest>, ...}`` of the artifact whose manifest is ``digest``."""
    data = store.get(digest, limit=load_limits().part_bytes)
    return dict(blob_list(manifest_parts(data, where or f"manifest {digest}"), digest))


@dataclasses.dataclass
class CopyResult:
    key: str
    digest: str
    blobs: int  # blobs in the artifact, manifest included
    copied: int  # blobs written to the destination (the others were already there, intact)
    bytes: int  # bytes written


def copy_artifact(src: Store, dst: Store, key: str, digest: str | None = None) -> CopyResult:
    """Copy the artifact ``key`` (manifest ``digest``, default: ``src``'s ref) from ``src`` to
    ``dst``: parts first, manifest next, ref last, as ``store_artifact`` writes them.

    Every blob read from ``src`` is re-hashed against its name (``get``), and ``dst.put`` must
    return that name again; the manifest must say it is the manifest of ``key``. A copy that
    is already intact in ``dst`` is not written again (a damaged one is replaced).
    """
    if digest is None:
        digest = src.get_ref(key)
        if digest is None:
            raise SpmdAotError(f"no ref {key!r} in {src.root}")
    manifest = src.get(digest, limit=load_limits().part_bytes)
    where = f"manifest {digest} (ref {key})"
    parts = manifest_parts(manifest, where)
    stored_key = manifest_key(manifest, where)
    if stored_key != key:
        raise CorruptArtifactError(
            f"ref {key!r} in {src.root} points to {where}, which is the manifest of "
            f"key {stored_key!r}: refusing to copy a ref that names another build's artifact"
        )
    copied = written = 0
    for part_digest, data in [*((d, None) for d in dict.fromkeys(parts.values())), (digest, manifest)]:
        n = _copy_blob(src, dst, part_digest, data)
        if n is not None:
            copied += 1
            written += n
    dst.set_ref(key, digest)
    return CopyResult(key, digest, 1 + len(set(parts.values())), copied, written)


def _copy_blob(src: Store, dst: Store, digest: str, data: bytes | None = None) -> int | None:
    """Make ``dst`` hold an intact copy of blob ``digest``; return the bytes written, or None
    when ``dst`` already had an intact copy."""
    # A store that is all local files checks its own copy by reading it (cheap), and then the
    # source is not read at all. (Not a layered store: its remote part may still lack the blob.)
    if local_files(dst) is dst and dst.has(digest):
        try:
            dst.get(digest, limit=largest_blob())  # re-hashes; a damaged copy is quarantined, rewritten below
            return None
        except CorruptArtifactError:
            pass
    if data is None:
        data = src.get(digest, limit=largest_blob())  # re-hashed against ``digest``
    if digest_of(data) != digest:  # a source store that does not check
        raise CorruptArtifactError(f"blob {digest} read from {src.root} does not hash to its name")
    if holds(dst, digest, data):  # object storage: compared without downloading it
        return None
    stored = dst.put(data)
    if stored != digest:
        raise CorruptArtifactError(f"{dst!r} stored blob {digest} under {stored}")
    return len(data)

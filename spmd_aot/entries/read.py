"""An entry read back from a store: every blob fetched within its load limit and re-hashed.

A ref maps a key to a manifest digest; the manifest names every part by digest. Reading checks
each blob's size before and after the read (a blob a writer of the cache swaps in is never read
unbounded), re-hashes it (the store's ``get`` verifies the digest), and validates every field
(``format/manifest.py``, ``format/artifact.py``), so a torn, corrupted or tampered entry is refused
with ``CorruptArtifactError`` before anything runs. ``check_entry`` adds every check a load runs
(``Artifact.check``), for ``spmd-aot verify`` and for a build before it stores an entry.
"""

from __future__ import annotations

import contextlib

from .artifact import Artifact
from ..errors import CorruptArtifactError, SpmdAotError
from ..format import signing
from ..format.artifact import check_layout
from ..format.limits import ENV_LOAD_LIMITS, load_limits
from ..format.manifest import PARTS, blob_limit, decode_manifest, plan_from_manifest, unpack
from ..store.transfer import blob_list

__all__ = ["read_blob", "read_manifest", "manifest_blobs", "artifact_bytes", "read_artifact", "check_entry"]


def read_blob(store, digest: str, limit: int, what: str) -> bytes:
    """A blob's bytes, refused before reading when the store says it is larger than ``limit``
    (and the store's ``get`` reads at most ``limit`` bytes, whatever the file became since)."""
    size = None
    with contextlib.suppress(OSError, SpmdAotError):
        size = store.size(digest)
    data = store.get(digest, limit=limit) if size is None or size <= limit else None
    if data is None or len(data) > limit:
        raise CorruptArtifactError(
            f"{what} blob {digest} is {size if data is None else len(data)} bytes, more than the load "
            f"limit of {limit}; if the artifact is yours, raise it with {ENV_LOAD_LIMITS}")
    return data


def read_manifest(store, digest: str) -> dict:
    """The validated manifest ``digest``; with a signing key set, only a correctly signed one."""
    return decode_manifest(read_blob(store, digest, blob_limit("manifest"), "manifest"), digest)


def manifest_blobs(manifest: dict, digest: str) -> list[tuple[str, str]]:
    """The blobs of a decoded ``manifest`` whose digest is ``digest`` (``store.transfer.blob_list``)."""
    return blob_list(manifest["blobs"], digest)


def artifact_bytes(store, digest: str) -> dict[str, bytes]:
    """Every blob of the artifact whose manifest is ``digest``, by digest (read within its
    part's load limit, not verified)."""
    return {d: read_blob(store, d, blob_limit(name), name)
            for name, d in manifest_blobs(read_manifest(store, digest), digest)}


def read_artifact(store, digest: str, manifest: dict | None = None) -> Artifact:
    """Load and verify every blob of the artifact whose manifest is ``digest``.

    ``manifest``: that manifest as ``read_manifest`` returned it moments ago (a lookup read it to
    check its guards); it is named by its digest, so it is the same manifest, not read twice.
    A signed entry with a ``program`` part is built from that part, never from its graph: its
    graph, readable code and schema are read (and verified the same way) only if something asks
    for them (``Artifact.graph``: a fallback to the full check, ``verify``, ``show``)."""
    from safetensors.torch import load as load_safetensors

    signed = signing.signing_key() is not None  # then read_manifest verifies the signature
    if manifest is None:
        manifest = read_manifest(store, digest)
    limits = load_limits()
    deferred = ("graph", "code", "schema") if signed and "program" in manifest["blobs"] else ()
    parts = {name: read_blob(store, manifest["blobs"][name], blob_limit(name), name)
             for name in PARTS if name not in deferred}
    try:
        constants = load_safetensors(parts["constants"])
    except Exception as exc:
        raise CorruptArtifactError(f"artifact {digest[:12]}: constants blob unreadable: {exc}") from None
    code = None
    if "code" in parts:
        try:
            code = parts["code"].decode()
        except UnicodeDecodeError:
            raise CorruptArtifactError(f"artifact {digest[:12]}: code blob is not UTF-8") from None
    layout = unpack(parts["layout"], f"layout of {digest[:12]}", limits)
    check_layout(layout, digest, plan_from_manifest(manifest["plan"]).world_size)
    artifact = Artifact(digest, manifest, parts.get("graph"), code, parts.get("schema"), layout, constants)
    if deferred:
        artifact.unread = lambda name: read_blob(store, manifest["blobs"][name], blob_limit(name), name)
    if "kernels" in manifest["blobs"]:
        artifact.kernels = read_blob(store, manifest["blobs"]["kernels"], blob_limit("kernels"), "kernels")
    if signed and "program" in manifest["blobs"]:  # unsigned: never read, the graph is checked in full
        artifact.program_blob = read_blob(store, manifest["blobs"]["program"], blob_limit("program"), "program")
    artifact.out_spec()  # parse now: a bad spec is a corrupt artifact, not a failure mid-step
    return artifact


def check_entry(store, key: str, digest: str) -> Artifact:
    """Every check a load runs before it binds live state, for ``spmd-aot verify``: read and
    verify every blob (``read_artifact``), the manifest must be of ``key`` (a ref or ``previous``
    naming another key's manifest is refused), the graph must pass ``Artifact.check`` and a
    kernels blob must be well formed (``kernels_blob.unpack``)."""
    artifact = read_artifact(store, digest)
    artifact.graph, artifact.code  # noqa: B018  (read and verified here, however the entry loads)
    artifact.schema  # noqa: B018  (decoded here: a load never reads it, verify must)
    if artifact.manifest["key"] != key:
        raise CorruptArtifactError(f"ref {key[:64]} leads to manifest {digest[:12]}, which is the manifest "
                                   f"of key {artifact.manifest['key'][:64]!r}")
    artifact.check()
    if artifact.kernels is not None:  # decoded as data only (msgpack): compiled code is never run here
        from ..format.kernels_blob import unpack as unpack_kernels

        unpack_kernels(artifact.kernels, f"artifact {digest[:12]}")
    if artifact.program_blob is not None:  # read only when the signature verified
        from . import program_blob

        program_blob.check(artifact)
    return artifact

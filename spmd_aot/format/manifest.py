"""An entry's manifest as bytes: what it must hold, how it is packed, and the check of a read one.

The manifest (itself a blob) lists the parts' digests, the plan, the key with its ingredients,
the guards and stats. Its blob is an envelope (``signing``: a header that may carry a signature)
around one canonical msgpack map, so one content has one blob and one digest. ``decode_manifest``
takes the bytes a reader fetched (``entries/read.py`` fetches them within ``blob_limit``) and
refuses anything a builder of this release would not have written, with ``CorruptArtifactError``,
before any field is used. Nothing here touches a store.
"""

from __future__ import annotations

from typing import Any

import msgpack

from . import bounded
from . import signing
from ..errors import CorruptArtifactError
from .digests import is_digest
from .limits import LoadLimits, load_limits
from ..parallel.plan import Plan

__all__ = ["FORMAT", "PARTS", "OPTIONAL_PARTS", "GUARD_KINDS", "empty_guards", "is_safe_path", "pack_manifest",
           "decode_manifest", "plan_from_manifest", "blob_limit", "pack", "unpack"]

#: The artifact format (the manifest's ``format``; cache/README.md). 3: the manifest blob is an
#: envelope whose header carries the signature (``signing``), and the output spec is spmd-aot's
#: own (``output_spec.encode_spec``), not torch's pytree JSON.
FORMAT = 3

#: The parts every entry has.
PARTS = ("graph", "code", "schema", "layout", "constants")
#: Parts an entry may hold beside ``PARTS``: compiled kernels (``building/kernels.py``: native
#: code, loaded only when trusted, ``runtime/kernel_load.py``); the checked program of a signed
#: entry (``entries/program_blob.py``: read only when the manifest's signature was verified).
OPTIONAL_PARTS = ("kernels", "program")

#: The guard schema: a manifest's ``guards`` maps exactly these kinds to lists of [name, value]
#: string pairs (files: path, content digest; distributions: name, version; tensors: path, digest).
#: ``keying/guards.py`` records and checks them.
GUARD_KINDS = ("files", "distributions", "tensors")


def empty_guards() -> dict:
    return {kind: [] for kind in GUARD_KINDS}


def is_safe_path(rel) -> bool:
    """A guard path spmd-aot could have written: relative, ``/``-separated, no empty, ``.`` or
    ``..`` part, no NUL, at most 4096 characters."""
    return (isinstance(rel, str) and 0 < len(rel) <= 4096 and "\0" not in rel and not rel.startswith("/")
            and all(part not in ("", ".", "..") for part in rel.split("/")))


def pack(obj) -> bytes:
    """A stored document (manifest body, layout, schema) as msgpack."""
    return msgpack.packb(obj, use_bin_type=True)


def unpack(data: bytes, what: str, limits: LoadLimits):
    """A stored document (manifest, layout, schema), decoded within ``limits`` (``bounded``)."""
    return bounded.unpack(data, what, objects=limits.objects, max_array=limits.items, max_map=limits.items)


def pack_manifest(manifest: dict) -> bytes:
    """An (unsigned) manifest blob: the envelope header, then the canonical msgpack body."""
    return signing.wrap(pack(manifest))


def decode_manifest(data: bytes, digest: str) -> dict:
    """The validated manifest in the blob ``data`` whose digest is ``digest``; with a signing key
    set, only a correctly signed one (the signature is verified before anything is decoded)."""
    limits = load_limits()
    body = signing.verified_body(data, digest)
    manifest = unpack(body, f"manifest {digest}", limits)
    if not isinstance(manifest, dict):
        raise CorruptArtifactError(f"manifest {digest}: not a map")
    try:
        canonical = pack(manifest) == body
    except Exception:  # a value msgpack cannot encode back
        canonical = False
    if not canonical:  # one manifest content, one blob (and one digest)
        raise CorruptArtifactError(
            f"manifest {digest} is not in canonical form (msgpack, shortest encodings, as spmd-aot writes "
            "it): another writer re-encoded it; refusing it. Rebuild the artifact.")
    _check_manifest(manifest, digest)
    return manifest


def plan_from_manifest(p: dict) -> Plan:
    return Plan.from_dict(p)


def blob_limit(name: str) -> int:
    """The most bytes a load reads of the part ``name`` (``LoadLimits``): every reader of a
    part caps its read with it, so no blob a writer of the cache swaps in is read unbounded."""
    limits = load_limits()
    return {"graph": limits.graph_bytes, "constants": limits.constants_bytes,
            "kernels": limits.constants_bytes}.get(name, limits.part_bytes)


def _check_manifest(m: Any, digest: str) -> None:
    def bad(why):
        raise CorruptArtifactError(f"manifest {digest}: {why}")

    if not isinstance(m, dict):
        bad("not a map")
    if m.get("format") != FORMAT:
        bad(f"format {str(m.get('format'))[:20]!r}, this spmd-aot reads format {FORMAT}; rebuild the artifact")
    blobs = m.get("blobs")
    if not isinstance(blobs, dict) or not set(PARTS) <= set(blobs) <= set(PARTS + OPTIONAL_PARTS):
        bad(f"blobs must name exactly {list(PARTS)}, and may name {list(OPTIONAL_PARTS)}")
    for name, d in blobs.items():
        if not isinstance(d, str) or not is_digest(d):
            bad(f"blob {name} has invalid digest {str(d)[:80]!r}")
    plan = m.get("plan")
    if not isinstance(plan, dict):
        bad("no plan")
    try:
        plan_from_manifest(plan)
    except Exception as exc:
        bad(f"invalid plan {plan!r}: {exc}")
    if not isinstance(plan["device_type"], str):
        bad(f"invalid device type {str(plan['device_type'])[:40]!r}")
    if not isinstance(m.get("key"), str) or not isinstance(m.get("ingredients"), dict):
        bad("no key or ingredients")
    if not all(isinstance(v, str) for v in m["ingredients"].values()):
        bad("ingredients must map names to digests")
    if not isinstance(m.get("ingredient_values", {}), dict):
        bad("ingredient_values must be a map")
    _check_guards(m.get("guards"), bad)
    previous = m.get("previous", False)
    if previous is not None and not (isinstance(previous, str) and is_digest(previous)):
        bad(f"previous must be a manifest digest or nil, got {str(previous)[:80]!r}")
    stats = m.get("stats")
    if not isinstance(stats, dict):
        bad("no stats")
    for name in ("nodes", "collectives", "bytes_per_step", "trace_seconds", "by_kind"):
        if name not in stats:  # the CLI and runtime read these; other fields are free-form
            continue
        value = stats[name]
        ok = (isinstance(value, dict) if name == "by_kind"
              else isinstance(value, (int, float)) and not isinstance(value, bool))
        if not ok:
            bad(f"stats field {name!r} has invalid value {str(value)[:80]!r}")


def _check_guards(guards, bad) -> None:
    """Guards decide whether an entry may serve: every field typed, digests well formed."""
    if not isinstance(guards, dict) or set(guards) != set(GUARD_KINDS):
        bad(f"guards must be a map of exactly {list(GUARD_KINDS)}")
    for kind in GUARD_KINDS:
        entries = guards[kind]
        if not isinstance(entries, list):
            bad(f"guards.{kind} must be a list")
        for entry in entries:
            if not (isinstance(entry, list) and len(entry) == 2
                    and all(isinstance(x, str) and 0 < len(x) <= 4096 for x in entry)):
                bad(f"guards.{kind} entry {str(entry)[:80]!r} must be two non-empty strings")
            if kind != "distributions" and not is_digest(entry[1]):
                bad(f"guards.{kind} entry {entry[0][:80]!r} has invalid digest {entry[1][:80]!r}")
            if kind == "files" and not is_safe_path(entry[0]):
                bad(f"guard file {entry[0][:80]!r} is not a plain relative path (absolute, empty parts or '..')")

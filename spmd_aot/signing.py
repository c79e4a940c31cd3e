"""Optional HMAC signing of artifact manifests.

With the environment variable ``SPMD_AOT_SIGNING_KEY`` set (any non-empty string; its UTF-8
bytes are the HMAC key), ``store_artifact`` signs every manifest it writes and
``read_manifest`` refuses manifests that are unsigned or whose signature does not verify.
The manifest names every other blob by sha256, and every blob is re-hashed on read, so a
valid manifest signature authenticates the whole artifact. Without the key, signatures are
ignored and signed artifacts load as before.

Format: the manifest map gets one more field, written last::

    "signature": {"alg": "hmac-sha256", "key_id": <16 hex>, "mac": <64 hex>}

``key_id`` is the first 16 hex of HMAC-SHA256(key, ``b"spmd-aot key id"``): a non-secret
name for the key, so "signed with another key" errors are readable. ``mac`` is
HMAC-SHA256(key, ``b"spmd-aot manifest v1\\0"`` + key_id + ``b"\\0"`` + msgpack of the manifest
without its ``signature`` field, keys in stored order).

The MAC covers the exact stored bytes: ``read_manifest`` refuses a manifest blob that is not
the canonical msgpack encoding of its content (what ``msgpack.packb`` writes: shortest integer,
string and container headers, keys in stored order), so one decoded manifest has exactly one
accepted encoding, and re-encoding a value (say an integer in a wider form) is refused rather
than yielding a second, differently named manifest that still verifies. The signature map must have exactly
these three fields. The stored manifest blob, signature included, is named by its sha256 as
before, so refs and digests stay well defined; signing changes the manifest digest, not the
parts.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
from typing import Any

import msgpack

from .errors import CorruptArtifactError

__all__ = ["ENV_SIGNING_KEY", "SIGNATURE_FIELD", "ALGORITHM", "SignatureError", "signing_key",
           "key_id", "sign_manifest", "sign_manifest_blob", "verify_manifest"]

#: Environment variable holding the signing key (a string; empty means unset).
ENV_SIGNING_KEY = "SPMD_AOT_SIGNING_KEY"
SIGNATURE_FIELD = "signature"
ALGORITHM = "hmac-sha256"
_DOMAIN = b"spmd-aot manifest v1\0"
_HEX64 = re.compile(r"[0-9a-f]{64}")
_HEX16 = re.compile(r"[0-9a-f]{16}")
_SIG_FIELDS = frozenset({"alg", "key_id", "mac"})


class SignatureError(CorruptArtifactError):
    """A manifest is unsigned or its signature does not verify, and a signing key is set."""


def signing_key() -> bytes | None:
    """The HMAC key from ``SPMD_AOT_SIGNING_KEY`` (UTF-8 bytes), or None when unset or empty."""
    value = os.environ.get(ENV_SIGNING_KEY)
    return value.encode("utf-8", "surrogateescape") if value else None


def key_id(key: bytes) -> str:
    """A short, non-secret name for ``key`` (to tell keys apart in error messages)."""
    return hmac.new(key, b"spmd-aot key id", hashlib.sha256).hexdigest()[:16]


def _mac(key: bytes, kid: str, unsigned: dict) -> str:
    body = msgpack.packb(unsigned, use_bin_type=True)
    return hmac.new(key, _DOMAIN + kid.encode("ascii") + b"\0" + body, hashlib.sha256).hexdigest()


def sign_manifest(manifest: dict, key: bytes) -> dict:
    """A copy of ``manifest`` with a ``signature`` field (any old one replaced)."""
    unsigned = {k: v for k, v in manifest.items() if k != SIGNATURE_FIELD}
    kid = key_id(key)
    return {**unsigned, SIGNATURE_FIELD: {"alg": ALGORITHM, "key_id": kid, "mac": _mac(key, kid, unsigned)}}


def sign_manifest_blob(data: bytes, key: bytes) -> bytes:
    """Manifest msgpack bytes -> the same manifest, signed, as msgpack bytes."""
    manifest = msgpack.unpackb(data, raw=False, strict_map_key=True)
    if not isinstance(manifest, dict):
        raise CorruptArtifactError("cannot sign a manifest that is not a msgpack map")
    return msgpack.packb(sign_manifest(manifest, key), use_bin_type=True)


def verify_manifest(manifest: Any, digest: str, key: bytes | None = None) -> None:
    """Raise ``SignatureError`` unless ``manifest`` is signed with ``key``.

    ``key`` defaults to ``signing_key()``; with no key at all nothing is checked.
    """
    key = signing_key() if key is None else key
    if key is None or not isinstance(manifest, dict):
        return
    fix = (f"Rebuild it with the same {ENV_SIGNING_KEY} as this process (key id {key_id(key)}): "
           "remove its ref (or use a fresh cache dir) and run `spmd-aot build` again, or unset "
           f"{ENV_SIGNING_KEY} to load unsigned artifacts.")
    sig = manifest.get(SIGNATURE_FIELD)
    if sig is None:
        raise SignatureError(f"manifest {digest} is unsigned, but {ENV_SIGNING_KEY} is set, so only "
                             f"signed artifacts load; refusing it. {fix}")
    if (not isinstance(sig, dict) or set(sig) != _SIG_FIELDS or sig["alg"] != ALGORITHM
            or not isinstance(sig["mac"], str) or not _HEX64.fullmatch(sig["mac"])
            or not isinstance(sig["key_id"], str) or not _HEX16.fullmatch(sig["key_id"])):
        raise SignatureError(f"manifest {digest} has a malformed signature {str(sig)[:160]!r} "
                             f"(expected exactly alg {ALGORITHM!r}, a 16-hex key_id and a 64-hex mac); "
                             f"refusing it. {fix}")
    unsigned = {k: v for k, v in manifest.items() if k != SIGNATURE_FIELD}
    try:
        expected = _mac(key, sig["key_id"], unsigned)
    except Exception as exc:  # a value msgpack cannot re-encode: not what any writer signed
        raise SignatureError(f"manifest {digest}: signature mismatch (cannot re-encode: {exc}); "
                             f"refusing it. {fix}") from None
    if not hmac.compare_digest(expected, sig["mac"]):
        why = (f"it was signed with another key (key id {sig['key_id']})" if sig["key_id"] != key_id(key)
               else "the manifest was changed after it was signed")
        raise SignatureError(f"manifest {digest}: signature mismatch: {why}; refusing it. {fix}")

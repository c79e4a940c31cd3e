"""The manifest blob's envelope, and its optional HMAC signature.

A manifest blob is one header line, then the manifest's msgpack bytes (the body)::

    spmd-aot-manifest 3 unsigned\\n<body>
    spmd-aot-manifest 3 hmac-sha256 <key id: 16 hex> <mac: 64 hex>\\n<body>

The signature sits beside the bytes it signs, so checking it decodes nothing an attacker
wrote: the header has a fixed grammar (``split``), and the MAC is computed over the body's
exact stored bytes. Only a body whose MAC verifies is ever decoded (``manifest.decode_manifest``).

With ``SPMD_AOT_SIGNING_KEY`` set (any non-empty string; its UTF-8 bytes are the HMAC key),
``store_artifact`` signs every manifest it writes and ``verified_body`` refuses one that is
unsigned or whose MAC does not verify (``SignatureError``). The manifest names every other blob
by sha256 and every blob is re-hashed on read, so a valid signature authenticates the whole
artifact. Without the key the header's signature is ignored.

``key_id`` is the first 16 hex of HMAC-SHA256(key, ``b"spmd-aot key id"``): a non-secret name
for the key, so "signed with another key" errors are readable. ``mac`` is
HMAC-SHA256(key, ``b"spmd-aot manifest v3\\0"`` + key_id + ``b"\\0"`` + body). The blob,
header included, is named by its sha256 as every blob is, so signing changes the manifest's
digest, never the parts'. Nothing here imports torch.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re

from ..errors import CorruptArtifactError

__all__ = ["ENV_SIGNING_KEY", "ALGORITHM", "MAGIC", "SignatureError", "signing_key", "key_id", "wrap",
           "split", "is_manifest_blob", "sign_manifest_blob", "verified_body"]

#: Environment variable holding the signing key (a string; empty means unset).
ENV_SIGNING_KEY = "SPMD_AOT_SIGNING_KEY"
ALGORITHM = "hmac-sha256"
#: How every manifest blob of this format starts (3: the artifact format, cache/README.md).
MAGIC = b"spmd-aot-manifest 3 "
_DOMAIN = b"spmd-aot manifest v3\0"
_HEADER = re.compile(rb"unsigned|hmac-sha256 ([0-9a-f]{16}) ([0-9a-f]{64})")
_MAX_HEADER = len(MAGIC) + 96  # the longest header line: the signed one


class SignatureError(CorruptArtifactError):
    """A manifest is unsigned or its signature does not verify, and a signing key is set."""


def signing_key() -> bytes | None:
    """The HMAC key from ``SPMD_AOT_SIGNING_KEY`` (UTF-8 bytes), or None when unset or empty."""
    value = os.environ.get(ENV_SIGNING_KEY)
    return value.encode("utf-8", "surrogateescape") if value else None


def key_id(key: bytes) -> str:
    """A short, non-secret name for ``key`` (to tell keys apart in error messages)."""
    return hmac.new(key, b"spmd-aot key id", hashlib.sha256).hexdigest()[:16]


def _mac(key: bytes, kid: str, body: bytes) -> str:
    return hmac.new(key, _DOMAIN + kid.encode("ascii") + b"\0" + body, hashlib.sha256).hexdigest()


def wrap(body: bytes, key: bytes | None = None) -> bytes:
    """The manifest blob holding ``body``: signed with ``key``, or unsigned when it is None."""
    if key is None:
        return MAGIC + b"unsigned\n" + body
    kid = key_id(key)
    return MAGIC + f"{ALGORITHM} {kid} {_mac(key, kid, body)}\n".encode("ascii") + body


def split(data: bytes, where: str) -> tuple[tuple[str, str] | None, bytes]:
    """((key id, mac) or None when unsigned, body) of a manifest blob; ``CorruptArtifactError``
    when ``data`` does not start with a header of exactly this grammar."""
    end = data.find(b"\n", 0, _MAX_HEADER + 1)
    m = _HEADER.fullmatch(data, len(MAGIC), end) if data.startswith(MAGIC) and end > 0 else None
    if m is None:
        raise CorruptArtifactError(
            f"{where} is not a manifest of this spmd-aot (it must start with "
            f"{MAGIC.decode()!r} and a signature line); it may come from another release: rebuild it")
    sig = (m.group(1).decode(), m.group(2).decode()) if m.group(1) else None
    return sig, data[end + 1:]


def is_manifest_blob(data: bytes) -> bool:
    """Whether ``data`` looks like a manifest blob (a cheap test, no decoding)."""
    try:
        split(data, "blob")
    except CorruptArtifactError:
        return False
    return True


def sign_manifest_blob(data: bytes, key: bytes) -> bytes:
    """A manifest blob -> the same body, signed with ``key`` (any old signature replaced)."""
    return wrap(split(data, "the manifest to sign")[1], key)


def verified_body(data: bytes, digest: str, key: bytes | None = None) -> bytes:
    """The body of manifest blob ``data``, once its signature verifies over the body's bytes.

    ``key`` defaults to ``signing_key()``; with no key at all the signature is not checked.
    Raises ``SignatureError`` (unsigned, another key, changed bytes) before anything is decoded.
    """
    sig, body = split(data, f"manifest {digest}")
    key = signing_key() if key is None else key
    if key is None:
        return body
    fix = (f"Rebuild it with the same {ENV_SIGNING_KEY} as this process (key id {key_id(key)}): "
           "remove its ref (or use a fresh cache dir) and run `spmd-aot build` again, or unset "
           f"{ENV_SIGNING_KEY} to load unsigned artifacts.")
    if sig is None:
        raise SignatureError(f"manifest {digest} is unsigned, but {ENV_SIGNING_KEY} is set, so only "
                             f"signed artifacts load; refusing it. {fix}")
    kid, mac = sig
    if not hmac.compare_digest(_mac(key, kid, body), mac):
        why = (f"it was signed with another key (key id {kid})" if kid != key_id(key)
               else "the manifest was changed after it was signed")
        raise SignatureError(f"manifest {digest}: signature mismatch: {why}; refusing it. {fix}")
    return body

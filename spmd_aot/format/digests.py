"""A blob's name: the sha256 of its bytes, as 64 lowercase hex characters.

The artifact format names every part by it (a manifest's ``blobs``, ``previous``, its guards'
file digests) and every store names blobs by it (``store/names.py`` takes the rule from here),
so a digest read from a manifest and a digest a store accepts are checked by one rule.
"""

from __future__ import annotations

import hashlib
import re

from ..errors import CorruptArtifactError

__all__ = ["DIGEST_PATTERN", "digest_of", "is_digest", "check_digest"]

#: A blob's name: the sha256 hex digest of its bytes.
DIGEST_PATTERN = r"[0-9a-f]{64}"
_DIGEST_RE = re.compile(DIGEST_PATTERN)


def digest_of(data: bytes) -> str:
    """The name a blob holding ``data`` has in every store."""
    return hashlib.sha256(data).hexdigest()


def is_digest(digest: object) -> bool:
    return isinstance(digest, str) and _DIGEST_RE.fullmatch(digest) is not None


def check_digest(digest: object) -> str:
    """``digest`` if it is a valid blob name, else ``CorruptArtifactError``."""
    if not is_digest(digest):
        raise CorruptArtifactError(
            f"invalid blob digest {digest!r}: expected 64 lowercase hex characters (a sha256); "
            "the manifest or ref that named it is damaged"
        )
    return digest  # type: ignore[return-value]

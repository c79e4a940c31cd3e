"""What names in a store may look like: one rule for every backend.

A store holds two kinds of names, and both end up as path components (``objects/<digest>``,
``refs/<key>``, ``locks/<key>.lock``) on a filesystem or in a bucket. So both are checked
before any backend touches storage, and neither can express a path: no separator, no ``..``,
no leading dot (which would also hide the file from listings).

* **digest**: the name of a blob, the sha256 of its bytes as 64 lowercase hex characters
  (the artifact format's rule, ``format/digests.py``). A bad digest comes from a damaged
  manifest or ref: ``CorruptArtifactError``.
* **key**: the name of a ref (and of its build lock), 1-200 characters from ``[A-Za-z0-9._-]``,
  not starting with ``.``. Keys are opaque to the store: cache keys are hex digests, but tests and
  tools use readable names. A bad key is a caller's mistake: ``SpmdAotError``.
* **ref content**: ``"<digest>\\n"``, so a person can read a ref with ``cat``.
"""

from __future__ import annotations

import re

from ..errors import CorruptArtifactError, SpmdAotError
from ..format.digests import DIGEST_PATTERN, check_digest, digest_of, is_digest

__all__ = ["DIGEST_PATTERN", "is_digest", "check_digest", "is_key", "check_key", "digest_of",
           "ref_bytes", "parse_ref", "check_path_parts"]

_KEY_RE = re.compile(r"[A-Za-z0-9._-]{1,200}")


def is_key(key: object) -> bool:
    return isinstance(key, str) and _KEY_RE.fullmatch(key) is not None and not key.startswith(".")


def check_key(key: object) -> str:
    """``key`` if it is a valid ref name, else ``SpmdAotError`` (never a path: see the module doc)."""
    if not is_key(key):
        raise SpmdAotError(
            f"invalid store key {key!r}: keys must be 1-200 characters from [A-Za-z0-9._-] "
            "and must not start with '.' (no path separators or traversal)"
        )
    return key  # type: ignore[return-value]


def ref_bytes(digest: str) -> bytes:
    """What a ref pointing at ``digest`` holds."""
    return (check_digest(digest) + "\n").encode("ascii")


def parse_ref(raw: bytes, where: str, fix: str) -> str:
    """The digest a ref's bytes name (``"<64 hex>\\n"``), or an error saying ``where`` and ``fix``."""
    text = raw.decode("ascii", errors="replace").strip()
    if not is_digest(text):
        raise CorruptArtifactError(
            f"{where} is damaged: expected a sha256 hex digest, found {raw[:100]!r}; {fix}")
    return text


def check_path_parts(path: str, what: str) -> str:
    """``path`` (a ``/``-separated prefix inside a bucket or namespace, possibly empty) if none
    of its parts is empty, ``.`` or ``..``; else ``SpmdAotError`` naming ``what``."""
    if path and any(part in ("", ".", "..") for part in path.split("/")):
        raise SpmdAotError(f"{what}: the prefix must not contain '.', '..' or empty parts")
    return path

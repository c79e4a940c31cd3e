"""Blobs held in memory: what a rank without cache access loads from after rank 0 sends them."""

from __future__ import annotations

import hashlib

from ..errors import CorruptArtifactError

__all__ = ["MemoryStore"]


class MemoryStore:
    """Read-only store over ``{digest: bytes}``; every ``get`` re-hashes, like ``LocalStore``."""

    def __init__(self, blobs: dict[str, bytes]):
        self._blobs = dict(blobs)
        self.root = "<memory>"

    def get(self, digest: str) -> bytes:
        data = self._blobs.get(digest)
        if data is None:
            raise CorruptArtifactError(f"blob {digest} was not received from rank 0")
        actual = hashlib.sha256(data).hexdigest()
        if actual != digest:
            raise CorruptArtifactError(f"blob received from rank 0 hashes to {actual}, expected {digest}")
        return data

    def has(self, digest: str) -> bool:
        return digest in self._blobs

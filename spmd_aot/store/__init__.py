"""Where built artifacts live: a content-addressed, torch-free blob store with named refs.

``protocol.Store`` is the interface every backend implements (required methods, optional
capabilities); ``names`` the naming rules they share; ``registry`` turns a cache location into a
store, for the API and the CLI alike. ``open_store(cache)`` is what entry points call: a path
gives a ``LocalStore``; an ``s3://bucket/prefix`` URL a ``LayeredStore`` (a local cache in front
of the bucket: read-through, write-through); ``memory://NAME`` a store in this process's memory.
"""

from __future__ import annotations

from .layered import LayeredStore
from .cache_dir import ENV_CACHE_DIR, resolve_cache_dir
from .local import LocalStore
from .memory_store import MemoryStore
from .protocol import HOLDS, LOCAL_FILES, BlobProblem, Store, local_files, supports
from .registry import ENV_LOCAL_CACHE, open_location, open_store, register_scheme
from .s3 import ENV_S3_ENDPOINT, S3Store, is_s3_url

__all__ = ["Store", "LocalStore", "S3Store", "LayeredStore", "MemoryStore", "BlobProblem",
           "open_store", "open_location", "register_scheme", "supports", "local_files", "LOCAL_FILES",
           "HOLDS", "resolve_cache_dir", "is_s3_url", "ENV_CACHE_DIR", "ENV_LOCAL_CACHE", "ENV_S3_ENDPOINT"]

"""Where built artifacts live: a content-addressed, torch-free blob store with named refs.

``open_store(cache)`` is the one way entry points turn a ``cache_dir``/``--cache-dir`` value into
a store: a path gives a ``LocalStore``; an ``s3://bucket/prefix`` URL gives a ``LayeredStore``
(a local cache in front of the bucket: read-through, write-through).
"""

from __future__ import annotations

import os
import pathlib

from .layered import LayeredStore
from .local import ENV_CACHE_DIR, BlobProblem, LocalStore, resolve_cache_dir
from .s3 import ENV_S3_ENDPOINT, S3Store, is_s3_url

__all__ = ["LocalStore", "resolve_cache_dir", "BlobProblem", "S3Store", "LayeredStore",
           "open_store", "is_s3_url", "ENV_LOCAL_CACHE", "ENV_S3_ENDPOINT"]

#: Environment variable naming the local cache kept in front of an s3:// cache.
ENV_LOCAL_CACHE = "SPMD_AOT_LOCAL_CACHE"


def open_store(cache: str | os.PathLike | None = None, *, local_cache: str | os.PathLike | None = None):
    """The store for ``cache``, chosen as every entry point chooses it.

    * ``s3://bucket/prefix`` -> ``LayeredStore(LocalStore(<local>), S3Store(url))`` where
      ``<local>`` is ``local_cache``, else ``$SPMD_AOT_LOCAL_CACHE``, else the usual default
      (``$SPMD_AOT_CACHE_DIR`` when it is a path, ``$XDG_CACHE_HOME/spmd_aot``, ``~/.cache/spmd_aot``).
    * a path, or None -> ``LocalStore(resolve_cache_dir(cache))``; when ``cache`` is None and
      ``$SPMD_AOT_CACHE_DIR`` holds an ``s3://`` URL, that URL is used as above.
    """
    if cache is None and is_s3_url(os.environ.get(ENV_CACHE_DIR)):
        cache = os.environ[ENV_CACHE_DIR]
    if isinstance(cache, str) and is_s3_url(cache):
        return LayeredStore(LocalStore(_local_cache_dir(local_cache)), S3Store(cache))
    return LocalStore(resolve_cache_dir(cache))


def _local_cache_dir(local_cache) -> pathlib.Path:
    if local_cache is not None:
        return pathlib.Path(local_cache).expanduser()
    env = os.environ.get(ENV_LOCAL_CACHE)
    if env:
        return pathlib.Path(env).expanduser()
    if not is_s3_url(os.environ.get(ENV_CACHE_DIR)):
        return resolve_cache_dir(None)
    # $SPMD_AOT_CACHE_DIR is the URL, not a directory: the rest of resolve_cache_dir's rule
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg and pathlib.Path(xdg).expanduser().is_absolute():
        return pathlib.Path(xdg).expanduser() / "spmd_aot"
    return pathlib.Path("~/.cache/spmd_aot").expanduser()

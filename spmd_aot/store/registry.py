"""Which store a cache location names: one table from URL scheme to backend, used by the API
(``cache_dir=`` of ``spmd_aot.compile`` and ``build``) and by every CLI command alike.

A location is a directory path or a URL ``SCHEME://...``:

* a path, or None (then ``$SPMD_AOT_CACHE_DIR``, ``$XDG_CACHE_HOME/spmd_aot``, ``~/.cache/spmd_aot``:
  ``cache_dir.resolve_cache_dir``; ``$SPMD_AOT_CACHE_DIR`` may hold a URL too) -> ``LocalStore``;
* ``SCHEME://...`` with SCHEME in ``SCHEMES`` -> that backend's opener, given the whole URL.
  ``open_location`` returns that store itself (``spmd-aot push --to``, ``pull --from``, and
  ``--cache-dir URL`` for the commands that inspect a cache). ``open_store``, what jobs and builds
  use, puts a local read-through cache in front of a backend marked ``local_cache`` (object
  storage: ``LayeredStore``), so each host keeps a copy of what it loaded;
* any other ``SCHEME://`` is an error naming the known schemes (never a directory called ``s4:``).

A new backend is one module implementing ``protocol.Store`` and one line in ``SCHEMES`` (or, from
your own code, one ``register_scheme`` call).
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import re
from collections.abc import Callable

from ..errors import SpmdAotError
from .layered import LayeredStore
from .cache_dir import ENV_CACHE_DIR, default_cache_dir, resolve_cache_dir
from .local import LocalStore
from .memory_store import open_memory_store
from .protocol import Store
from .s3 import S3Store

__all__ = ["Backend", "SCHEMES", "register_scheme", "scheme_of", "is_url", "resolve_location",
           "open_location", "open_store", "ENV_LOCAL_CACHE"]

#: Environment variable naming the local cache kept in front of an s3:// (any ``local_cache``) cache.
ENV_LOCAL_CACHE = "SPMD_AOT_LOCAL_CACHE"

_SCHEME_RE = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://")


@dataclasses.dataclass(frozen=True)
class Backend:
    open: Callable[[str], Store]  # the store a URL of this scheme names
    local_cache: bool = False  # jobs and builds keep a local read-through cache in front of it


#: scheme -> backend: the one table of store URLs.
SCHEMES: dict[str, Backend] = {
    "s3": Backend(S3Store, local_cache=True),  # s3://bucket/prefix
    "memory": Backend(open_memory_store),  # memory://NAME, shared within this process
}


def register_scheme(scheme: str, opener: Callable[[str], Store], *, local_cache: bool = False) -> None:
    """Make ``scheme://...`` locations open with ``opener(url)`` everywhere (API and CLI)."""
    if not _SCHEME_RE.fullmatch(f"{scheme}://"):
        raise ValueError(f"invalid URL scheme {scheme!r}")
    SCHEMES[scheme] = Backend(opener, local_cache)


def scheme_of(location) -> str | None:
    """The registered scheme of a URL location; None for a path (or None). An unregistered
    ``SCHEME://`` raises, so a typo never becomes a new directory."""
    if not isinstance(location, str):
        return None
    m = _SCHEME_RE.match(location)
    if m is None:
        return None
    if m.group(1) not in SCHEMES:
        raise SpmdAotError(f"unknown store URL scheme {m.group(1)!r} in {location!r}; known: "
                           f"{', '.join(f'{s}://' for s in sorted(SCHEMES))}, or a directory path")
    return m.group(1)


def is_url(location) -> bool:
    return scheme_of(location) is not None


def resolve_location(cache: str | os.PathLike | None = None) -> str | pathlib.Path:
    """The location ``cache`` means: a URL as given, else the cache directory (explicit argument >
    ``$SPMD_AOT_CACHE_DIR`` (which may be a URL) > ``$XDG_CACHE_HOME/spmd_aot`` > ``~/.cache/spmd_aot``)."""
    if cache is None and is_url(os.environ.get(ENV_CACHE_DIR)):
        return os.environ[ENV_CACHE_DIR]
    if is_url(cache):
        return cache  # type: ignore[return-value]
    return resolve_cache_dir(cache)


def open_location(location: str | os.PathLike, *, trust_cache: bool | None = None) -> Store:
    """The store at ``location`` itself: a URL's backend, or the ``LocalStore`` of a directory
    (``trust_cache``: see ``trust.py``)."""
    scheme = scheme_of(location)
    if scheme is not None:
        return SCHEMES[scheme].open(location)  # type: ignore[arg-type]
    return LocalStore(pathlib.Path(location).expanduser(), trust_cache=trust_cache)


def open_store(cache: str | os.PathLike | None = None, *, local_cache: str | os.PathLike | None = None,
               trust_cache: bool | None = None) -> Store:
    """The store for ``cache_dir=cache``, chosen as every job and build chooses it.

    * a path, or None -> ``LocalStore(resolve_cache_dir(cache))`` (None: see ``resolve_location``);
    * a URL of a ``local_cache`` backend (``s3://bucket/prefix``) ->
      ``LayeredStore(LocalStore(<local>), <backend store>)`` where ``<local>`` is ``local_cache``,
      else ``$SPMD_AOT_LOCAL_CACHE``, else the default cache directory;
    * any other URL (``memory://NAME``) -> the backend's store itself.

    ``trust_cache=True`` uses a local cache directory other users can write (``trust.py``).
    """
    location = resolve_location(cache)
    scheme = scheme_of(location)
    if scheme is None:
        return LocalStore(location, trust_cache=trust_cache)
    remote = SCHEMES[scheme].open(location)  # type: ignore[arg-type]
    if not SCHEMES[scheme].local_cache:
        return remote
    return LayeredStore(LocalStore(_local_cache_dir(local_cache), trust_cache=trust_cache), remote)


def _local_cache_dir(local_cache) -> pathlib.Path:
    if local_cache is not None:
        return pathlib.Path(local_cache).expanduser()
    env = os.environ.get(ENV_LOCAL_CACHE)
    if env:
        return pathlib.Path(env).expanduser()
    if not is_url(os.environ.get(ENV_CACHE_DIR)):
        return resolve_cache_dir(None)
    return default_cache_dir()  # $SPMD_AOT_CACHE_DIR is the URL, not a directory

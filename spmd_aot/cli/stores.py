"""The cache a command reads or writes: ``--cache-dir`` resolved as a job resolves it, refs listed
with damaged ones in place, and REF arguments resolved to (key, digest)."""

from __future__ import annotations

import dataclasses

from ..errors import CorruptArtifactError, SpmdAotError
from .report import error


@dataclasses.dataclass
class Ref:
    key: str
    path: str
    digest: str | None  # None when the ref file is damaged
    error: str | None


def is_url(cache_dir) -> bool:
    from ..store.registry import is_url

    return is_url(cache_dir)


def cache_root(cache_dir):
    """The location ``--cache-dir`` means (a URL, or the cache directory), as the job resolves it."""
    from ..store.registry import resolve_location

    return resolve_location(cache_dir)


def store_at(cache_dir, *, create: bool = False):
    """The store at ``cache_dir``; ``None`` when it is a directory that does not exist and
    ``create`` is false (so ``ls`` or ``verify`` on a mistyped path does not create an empty
    cache). A URL gives that store itself (``s3://`` the bucket: ``S3Store``)."""
    from ..store import LocalStore

    root = cache_root(cache_dir)
    if is_url(root):
        return open_location(root)
    if not create and not root.is_dir():
        return None
    return LocalStore(root)


def open_location(location: str):
    """A store URL (``s3://bucket/prefix``: ``S3Store``) or another cache directory."""
    from ..store import open_location

    return open_location(location)


def list_refs(store) -> list[Ref]:
    """Every ref, with a damaged one reported in place rather than dropped (``refs()`` skips them)."""
    out = []
    for key in store.ref_keys():
        path = f"{store.root}/refs/{key}"
        try:
            digest = store.get_ref(key)
        except CorruptArtifactError as exc:
            out.append(Ref(key, path, None, str(exc)))
            continue
        if digest is not None:  # removed since listing
            out.append(Ref(key, path, digest, None))
    return out


def existing_store(cache_dir):
    """The store at ``cache_dir``; a directory that does not exist is an error (exit 2) for every
    command that reads a cache, so a mistyped path never looks like an empty, healthy cache."""
    store = store_at(cache_dir)
    if store is None:
        raise SpmdAotError(f"cache directory {cache_root(cache_dir)} does not exist; check "
                           "--cache-dir (or $SPMD_AOT_CACHE_DIR), or build into it with `spmd-aot build`")
    return store


def resolve_ref(store, ref: str) -> tuple[str, str]:
    """The (key, digest) named by a key, a manifest digest, or a unique prefix of either."""
    if not ref:
        raise SpmdAotError("REF is empty: expected a key, a manifest digest, or a prefix of one")
    needle = ref.lower()
    entries = list_refs(store)
    matches = [e for e in entries if needle in (e.key.lower(), (e.digest or "").lower())]
    if not matches:
        matches = [e for e in entries if e.key.lower().startswith(needle)
                   or (e.digest or "").lower().startswith(needle)]
    if not matches:
        raise SpmdAotError(
            f"no artifact matches {ref!r} in {store.root}: expected a key, a manifest digest, or a "
            "unique prefix of either; `spmd-aot ls` lists them")
    if len(matches) > 1:
        lines = "\n".join(f"  key {e.key[:16]}  digest {(e.digest or '?')[:16]}  {describe(store, e)}"
                          for e in matches)
        raise SpmdAotError(f"{ref!r} is ambiguous, it matches {len(matches)} artifacts:\n{lines}\n"
                           "use a longer prefix")
    entry = matches[0]
    if entry.error:
        raise SpmdAotError(entry.error)
    return entry.key, entry.digest


def select(store, refs: list[str]) -> list[tuple[str, str]]:
    """(key, digest) for each REF (resolved like `show`), or for every intact ref if none."""
    if not refs:
        entries = list_refs(store)
        for e in entries:
            if e.error:
                error(f"skipping damaged ref {e.key}: {e.error}")
        return [(e.key, e.digest) for e in entries if not e.error]
    return list(dict.fromkeys(resolve_ref(store, ref) for ref in refs))


def describe(store, entry) -> str:
    from ..entries import read_manifest
    from ..parallel.plan import Plan

    if entry.error:
        return f"CORRUPT: {entry.error}"
    try:
        return Plan.from_dict(read_manifest(store, entry.digest)["plan"]).describe()
    except SpmdAotError as exc:
        return f"CORRUPT: {exc}"

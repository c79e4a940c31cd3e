"""``push``, ``pull``, ``export``, ``import``: artifacts copied between caches, object storage and bundles."""

from __future__ import annotations

import contextlib

from ..errors import SpmdAotError
from .report import EXIT_ERROR, EXIT_OK, error, print_table
from .stores import existing_store, open_location, resolve_ref, select, store_at


def cmd_push(args) -> int:
    """Copy artifacts from the cache to a remote store."""
    src = existing_store(args.cache_dir)
    return _transfer(src, open_location(args.remote), args.refs, "pushed", "to")


def cmd_pull(args) -> int:
    """Copy artifacts from a remote store into the cache."""
    return _transfer(open_location(args.remote), store_at(args.cache_dir, create=True), args.refs,
                     "pulled", "from")


def _transfer(src, dst, refs: list[str], verb: str, preposition: str) -> int:
    from ..store import local_files
    from ..store.transfer import copy_artifact

    entries = select(src, refs)
    remote = dst if verb == "pushed" else src
    if not entries:
        print(f"no artifacts to copy in {src.root}")
        return EXIT_OK
    rows, failures = [], []
    blobs = copied = written = 0
    for key, digest in entries:
        try:
            # into a local cache under the key's build lock, as every writer (gc relies on it)
            with dst.lock(key) if local_files(dst) is not None else contextlib.nullcontext():
                result = copy_artifact(src, dst, key, digest)
        except SpmdAotError as exc:
            failures.append(f"{key[:12]}: {exc}")
            rows.append([key[:12], digest[:12], "-", "-", "-", "FAILED"])
            continue
        blobs, copied, written = blobs + result.blobs, copied + result.copied, written + result.bytes
        rows.append([key[:12], digest[:12], result.blobs, result.copied, result.bytes, "ok"])
    print_table(["KEY", "DIGEST", "BLOBS", "COPIED", "BYTES", "STATUS"], rows, right={2, 3, 4})
    done = len(entries) - len(failures)
    print(f"{verb} {done} artifact{'s' if done != 1 else ''} {preposition} {remote.root}: "
          f"{copied} of {blobs} blobs copied ({written} bytes), the rest were already there")
    for line in failures:
        error(line)
    return EXIT_ERROR if failures else EXIT_OK


def cmd_export(args) -> int:
    from ..store.bundle import export_bundle

    store = existing_store(args.cache_dir)
    refs = dict(resolve_ref(store, ref) for ref in args.refs)
    summary = export_bundle(store, refs, args.output)
    print(f"exported {len(summary.refs)} artifact{'s' if len(summary.refs) != 1 else ''} "
          f"({summary.blobs} blobs, {summary.bytes} bytes) to {summary.path}")
    for key, digest in summary.refs.items():
        print(f"  {key[:12]}  {digest[:12]}")
    return EXIT_OK


def cmd_import(args) -> int:
    from ..store.bundle import import_bundle

    store = store_at(args.cache_dir, create=True)
    summary = import_bundle(store, args.bundle)
    print(f"imported {len(summary.refs)} artifact{'s' if len(summary.refs) != 1 else ''} "
          f"({summary.blobs} blobs, {summary.written} new, {summary.bytes} bytes) into {store.root}")
    for key, digest in summary.refs.items():
        print(f"  {key[:12]}  {digest[:12]}")
    return EXIT_OK

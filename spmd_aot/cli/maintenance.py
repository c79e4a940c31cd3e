"""``rm`` and ``gc``: refs removed, least recently used artifacts evicted, unreferenced blobs freed."""

from __future__ import annotations

from .report import EXIT_OK, print_table
from .stores import existing_store, resolve_ref


def cmd_rm(args) -> int:
    """Remove refs; their blobs stay until gc (which spares any a job is loading)."""
    from ..store.leases import forget_used

    store = existing_store(args.cache_dir)
    for key, digest in list(dict.fromkeys(resolve_ref(store, ref) for ref in args.refs)):
        store.delete_ref(key)
        forget_used(store, key)
        print(f"removed {key} (manifest {digest[:12]})")
    print("its blobs stay until `spmd-aot gc` removes them" if len(args.refs) == 1
          else "their blobs stay until `spmd-aot gc` removes them")
    return EXIT_OK


def cmd_gc(args) -> int:
    """Evict by age and LRU under the size bound, then remove unreferenced blobs."""
    import datetime

    from ..store.eviction import collect_garbage, format_size
    from ..store.leases import last_used

    store = existing_store(args.cache_dir)
    used = {}
    if args.dry_run or args.max_size is not None or args.max_age is not None:
        from ..store import local_files

        if local_files(store) is not None:  # else collect_garbage says gc needs a local cache
            used = {key: last_used(store, key) for key in store.refs()}
    report = collect_garbage(store, max_size=args.max_size, max_age=args.max_age, grace=args.grace,
                             dry_run=args.dry_run)
    would = "would be " if report.dry_run else ""
    if report.evicted:
        rows = []
        for key, digest, reason in report.evicted:
            when = used.get(key)
            stamp = (datetime.datetime.fromtimestamp(when).strftime("%Y-%m-%d %H:%M:%S")
                     if when else "?")
            rows.append([key[:12], digest[:12], reason, stamp])
        print(f"{would}evicted:")
        print_table(["KEY", "DIGEST", "REASON", "LAST USED"], rows)
    for key in report.skipped_leased:
        print(f"kept {key[:12]}: a job is loading it (reader lease)")
    if report.builds_running:
        print(f"a build is running ({', '.join(k[:12] for k in report.builds_running)}): unreferenced "
              "part blobs are kept until the next gc")
    bound = f" (bound {format_size(args.max_size)})" if args.max_size is not None else ""
    print(f"gc{' (dry run)' if report.dry_run else ''}: {report.artifacts_before} artifacts, "
          f"{format_size(report.bytes_before)} -> {report.artifacts_after} artifacts, "
          f"{format_size(report.bytes_after)}{bound}; {would}removed {report.blobs_removed} blobs "
          f"({format_size(report.bytes_removed)}), kept {report.kept_unreferenced} unreferenced")
    if args.max_size is not None and report.bytes_after > args.max_size and not report.dry_run:
        print("still over the bound: the rest is held by artifacts jobs are loading or by a running build")
    return EXIT_OK

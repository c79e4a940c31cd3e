"""``ls``, ``show``, ``verify``, ``ops``: read the cache, change nothing."""

from __future__ import annotations

import os
import shlex

from ..errors import SpmdAotError
from .report import EXIT_OK, EXIT_PROBLEMS, human_bytes, print_table, safe, say
from .stores import cache_root, existing_store, list_refs, resolve_ref


def cmd_ls(args) -> int:
    """One row per ref: key, digest, plan, stats and total blob size (damaged ones flagged)."""
    store = existing_store(args.cache_dir)
    entries = list_refs(store)
    root = cache_root(args.cache_dir)
    if not entries:
        print(f"no artifacts in {root}; build some with: "
              f"spmd-aot build TARGET --world-size N --cache-dir {shlex.quote(str(root))}")
        return EXIT_OK
    rows, columns = [], {}
    for entry in entries:  # each manifest read once, however many refs name it
        if entry.error or entry.digest not in columns:
            columns[entry.digest] = _ls_columns(store, entry)
        rows.append([entry.key[:12], (entry.digest or "?")[:12], *columns[entry.digest]])
    print_table(["KEY", "DIGEST", "WORLD", "PLACEMENT", "DEVICE", "NODES", "COLLECTIVES", "BYTES"],
                 rows, right={2, 5, 6, 7})
    print(f"{len(entries)} artifact{'s' if len(entries) != 1 else ''} in {root}")
    return EXIT_OK


def _ls_columns(store, entry) -> list:
    from ..entries import manifest_blobs
    from ..entries.pipeline_artifact import read_any_manifest

    if entry.error:
        return [f"CORRUPT: {entry.error}"]
    try:
        manifest, is_pipeline = read_any_manifest(store, entry.digest)
        pipeline = manifest if is_pipeline else None
        size = 0
        for name, digest in manifest_blobs(manifest, entry.digest):
            blob_size = store.size(digest)
            if blob_size is None:
                return [f"CORRUPT: {name} blob {digest[:12]} is missing"]
            size += blob_size
    except SpmdAotError as exc:
        return [f"CORRUPT: {exc}"]
    if pipeline is not None:
        from .pipeline_show import ls_columns

        return ls_columns(pipeline, size)
    plan, stats = manifest["plan"], manifest["stats"]
    return [plan["world_size"], plan["placement"], plan["device_type"], stats.get("nodes", "?"),
            stats.get("collectives", "?"), size]


def cmd_show(args) -> int:
    """Print one artifact's manifest summary, and with ``--code`` its readable graph code."""
    from ..entries import read_artifact, read_manifest

    from ..entries.pipeline_artifact import pipeline_manifest_or_none

    store = existing_store(args.cache_dir)
    key, digest = resolve_ref(store, args.ref)
    pipeline = pipeline_manifest_or_none(store, digest)
    if pipeline is not None:  # a pipeline-parallel entry: stages and schedule (pipeline_show.py)
        from .pipeline_show import print_pipeline

        print_pipeline(store, key, digest, pipeline)
        return EXIT_OK
    manifest = read_manifest(store, digest)
    _print_manifest(store, key, digest, manifest)
    _print_kernels(store, manifest)
    if args.code:
        code = read_artifact(store, digest).code
        print()
        print("code:")
        print(safe(code.rstrip("\n"), keep="\n\t"))
    return EXIT_OK


def _print_manifest(store, key: str, digest: str, m: dict) -> None:
    """Every line escaped (``safe``): every field is stored data."""
    from ..entries import manifest_blobs
    from ..parallel.plan import Plan

    stats = m["stats"]
    plan = Plan.from_dict(m["plan"])
    by_kind = ", ".join(f"{k} {v}" for k, v in sorted((stats.get("by_kind") or {}).items()))
    say(f"key:          {key}")
    if m["key"] != key:
        say(f"              (the manifest says key {m['key']})")
    say(f"digest:       {digest}")
    say(f"format:       {m['format']}")
    say(f"plan:         {plan.describe()}")
    for field, value in plan.to_dict().items():
        say(f"  {field + ':':<24}{value}")
    say(f"nodes:        {stats.get('nodes', '?')}")
    say(f"collectives:  {stats.get('collectives', '?')}" + (f" ({by_kind})" if by_kind else ""))
    say(f"bytes/step:   {stats.get('bytes_per_step', '?')} (each rank sends into collectives)")
    say(f"trace time:   {stats.get('trace_seconds', '?')} s")
    if "peak_bytes" in stats:
        say(f"peak memory:  {human_bytes(stats['peak_bytes'])} of live tensors per rank, estimated from the "
              "graph (inputs, state and intermediates until their last use; tools/bench/bench_memory.py "
              "measures eager FSDP2 the same way)")
    if stats.get("micro_batches", 1) > 1:
        say(f"micro-batches: {stats['micro_batches']} backward() per optimizer step; gradients accumulate "
             "locally (shard: unsharded, per group) and are reduced once, after the last; their memory is "
             "in the peak above")
    _print_communication(stats.get("comm"))
    say("blobs:")
    for name, d in manifest_blobs(m, digest):
        blob_size = store.size(d)
        size = "MISSING" if blob_size is None else f"{blob_size} bytes"
        say(f"  {name:<12}{d}  {size}")
    say("ingredients:")
    width = max((len(n) for n in m["ingredients"]), default=0) + 2
    for name, d in m["ingredients"].items():
        say(f"  {name:<{width}}{d}")


def _print_kernels(store, manifest: dict) -> None:
    """The compiled kernels blob (``building/kernels.py``), decoded as data: what built it, how much."""
    from ..format.manifest import blob_limit
    from ..format.kernels_blob import describe

    status = manifest["stats"].get("kernels")
    if "kernels" not in manifest["blobs"]:
        if status:
            say(f"kernels:      {status}")
        return
    try:  # read within the load's limit: a writer of the cache may have put any size there
        d = describe(store.get(manifest["blobs"]["kernels"], limit=blob_limit("kernels")), "kernels")
    except SpmdAotError as exc:
        say(f"kernels:      CORRUPT: {exc}")
        return
    count = d["libraries"]
    say(f"kernels:      {count} {'library' if count == 1 else 'libraries'} in {d['calls']} "
        f"call{'s' if d['calls'] != 1 else ''}, {human_bytes(d['bytes'])}, compiled in "
        f"{manifest['stats'].get('kernel_seconds', '?')} s (native code: runs only from a signed entry or a "
        "trusted cache)")
    say(f"  torch {d['torch']}, {d['cxx']}, cpu capability {d['cpu_capability']}, options {d['options']}")


def _print_communication(comm) -> None:
    """One row per collective of a step, in issue order: buckets (replicate) and groups (shard).

    The stats are manifest content, so anything malformed is shown as such, not trusted."""
    if not isinstance(comm, list) or not comm:
        return
    say(f"communication per step ({len(comm)} collectives, in issue order):")
    rows = []
    for entry in comm:
        if not isinstance(entry, dict):
            rows.append(["?", "(malformed entry)", "", ""])
            continue
        params = entry.get("params") if isinstance(entry.get("params"), list) else []
        shown = ", ".join(str(p) for p in params[:4]) + (f", ... (+{len(params) - 4})" if len(params) > 4 else "")
        rows.append([str(entry.get("kind", "?"))[:40], str(entry.get("label", ""))[:60],
                     human_bytes(entry.get("bytes")), f"{len(params)}: {shown}" if params else ""])
    print_table(["  KIND", "BUCKET/GROUP", "BYTES", "PARAMS"], [["  " + r[0]] + r[1:] for r in rows],
                 right={2})


def cmd_verify(args) -> int:
    """Re-hash every blob, then run every check a load runs on every referenced artifact (read and
    hash every part, decode the graph against the op allowlist and load limits, run it on meta
    tensors against its layout: ``Artifact.check``); exit 1 on any problem.

    Read-only: an artifact whose blobs the re-hash already found damaged is reported without
    being read, since reading a corrupt blob moves it to quarantine/. Decoding runs with Python's
    cyclic collector paused, as a job's load does (``entries/gc_pause.py``).
    """
    from ..entries import gc_pause

    with gc_pause.paused():
        return _verify(args)


def _verify(args) -> int:
    from ..entries import check_entry
    from ..keying.lookup import MAX_ENTRIES

    store = existing_store(args.cache_dir)
    n_blobs = sum(1 for _ in store.blobs())
    blob_problems = store.verify()
    problems = [f"blob {p.digest}: {p.reason} ({p.path})" if p.digest else f"{p.reason} ({p.path})"
                for p in blob_problems]
    bad = {p.digest for p in blob_problems if p.digest}
    reported_paths = {os.path.abspath(p.path) for p in blob_problems}
    try:
        entries = list_refs(store)
    except SpmdAotError as exc:  # refs/ cannot be listed at all (e.g. it is a planted link)
        problems.append(str(exc))
        entries = []
    for entry in entries:
        if os.path.abspath(entry.path) in reported_paths:
            continue  # a damaged ref, or one to a missing manifest: store.verify reported it
        if entry.error:
            problems.append(f"ref {entry.key}: {entry.error}")
            continue
        digest, seen = entry.digest, set()
        while digest is not None and digest not in seen and len(seen) < MAX_ENTRIES:  # what lookups walk
            seen.add(digest)
            problem = _entry_problem(store, entry.key, digest, bad, check_entry)
            if problem is not None:
                problems.append(f"artifact {entry.key[:12]} (manifest {digest[:12]}): {problem}")
                break
            digest = _previous(store, digest)  # an older entry gc removed ends the chain, as in lookups
    for line in problems:
        print(safe(line))
    from ..format.allowlist import chosen_list
    print(f"# graphs checked against the op allowlist {chosen_list().describe()}")
    n = len(problems)
    print(f"{n_blobs} blobs, {len(entries)} artifacts checked, {n} problem{'s' if n != 1 else ''}")
    return EXIT_PROBLEMS if problems else EXIT_OK


def _entry_problem(store, key: str, digest: str, bad: set, check_entry) -> str | None:
    """Why the entry ``digest`` of ``key`` would not load, or None; read-only (a blob the re-hash
    found damaged is reported, not read: reading it would move it to quarantine/)."""
    from ..entries import manifest_blobs, read_manifest

    from ..entries.pipeline_artifact import check_pipeline_entry, pipeline_manifest_or_none

    if digest in bad:
        return "its manifest blob is damaged"
    try:
        pipeline = pipeline_manifest_or_none(store, digest)
        if pipeline is not None:  # a pipeline-parallel entry: every stage checked as its rank loads it
            damaged = [f"{name} blob {d}" for name, d in sorted(pipeline["blobs"].items()) if d in bad]
            if damaged:
                return f"{', '.join(damaged)} damaged"
            check_pipeline_entry(store, digest)
            return None
        damaged = [f"{name} blob {d}" for name, d in manifest_blobs(read_manifest(store, digest), digest)[1:] if d in bad]
        if damaged:
            return f"{', '.join(damaged)} damaged"
        check_entry(store, key, digest)
    except SpmdAotError as exc:
        return str(exc)
    return None


def _previous(store, digest: str) -> str | None:
    from ..entries import read_manifest
    from ..entries.pipeline_artifact import pipeline_manifest_or_none

    if pipeline_manifest_or_none(store, digest) is not None:
        return None  # a pipeline entry replaces none
    previous = read_manifest(store, digest)["previous"]
    return previous if previous is not None and store.has(previous) else None


def cmd_ops(args) -> int:
    """Print the op allowlist this torch release uses (``allowlist.choose_list``), one overload per line."""
    from ..format.allowlist import PYTHON_CALLABLES, allowed_ops, chosen_list

    ops = sorted(allowed_ops()) + list(PYTHON_CALLABLES)
    print(f"# {len(ops)} call targets a stored graph may name (list: {chosen_list().describe()})")
    for op in ops:
        print(op)
    return EXIT_OK

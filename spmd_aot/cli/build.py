"""``build`` and ``explain``: a job's configurations traced into the cache, or looked up without tracing."""

from __future__ import annotations

import os
import sys
import traceback
from typing import Iterable

from ..errors import SpmdAotError, TargetError
from ..parallel.dims import cli_fields
from .report import EXIT_ERROR, EXIT_OK, EXIT_PROBLEMS, Failed, error, print_table
from .stores import cache_root, store_at


def _tp_plan(entries: list) -> tuple | str:
    """The --tp-plan options as ``Plan`` takes them: pairs, or the model's own plan alone."""
    named = [e for e in entries if isinstance(e, str)]
    if named and len(entries) > 1:
        raise SpmdAotError(f"--tp-plan {named[0]} takes the model's own plan; it cannot be combined with "
                           "other --tp-plan entries")
    return named[0] if named else tuple(entries)


def plan_for(args, world_size: int, placement: str):
    """One configuration; a placement's own options (``parallel.dims.cli_fields``) apply to it alone."""
    from ..schema import Schema

    options = {"mesh_shape": args.mesh_shape, "param_placements": tuple(args.param_placement),
               "shard_groups": tuple(args.shard_group),
               "reshard_after_forward": not args.keep_params_after_forward}
    own = cli_fields(placement, bool(args.tp_plan))
    schema = Schema(placement, bucket_cap_mb=args.bucket_cap_mb, first_bucket_cap_mb=args.first_bucket_cap_mb,
                    tp_plan=_tp_plan(args.tp_plan), mixed_precision=_mixed_precision(args),
                    **{k: v for k, v in options.items() if k in own})
    return schema.plan(world_size, args.device)


def _mixed_precision(args):
    from ..parallel.mixed_precision import MixedPrecisionPolicy

    return MixedPrecisionPolicy(args.param_dtype, args.reduce_dtype, args.output_dtype,
                                not args.no_cast_forward_inputs)


def cmd_build(args) -> int:
    """Build the cross product of world sizes x placements and print one row per config."""
    from ..building.builder import build
    from .progress import Progress

    plans = _unique(plan_for(args, w, p) for w in args.world_size for p in (args.placement or ["replicate"]))
    job = load_job(args.target)
    from ..store import local_files, open_store

    store = open_store(args.cache_dir)  # as the job opens it: s3:// behind a local cache, written through
    local = local_files(store)
    if local is not None:
        local.clean_tmp()  # temp files older than an hour, left by killed writers
    results = []
    try:
        with Progress(len(plans)) as bar:
            for plan in plans:
                bar.start(plan.describe())
                result = build(job, plan=plan, store=store, kernels=args.kernels)
                results.append(result)
                bar.finish("built" if result.traced else "cached")
    except (SpmdAotError, OSError) as exc:
        from ..errors import os_error

        _print_build_table(results)
        error(f"{plan.describe()}: {exc if isinstance(exc, SpmdAotError) else os_error(exc, exc.filename, 'write')}")
        raise Failed(EXIT_ERROR) from exc
    except Exception:
        _print_build_table(results)
        error(f"building {plan.describe()} failed with an unexpected error (traceback below)")
        raise
    _print_build_table(results)
    return EXIT_OK


def _print_build_table(results) -> None:
    if not results:
        return
    rows = [[r.plan.describe(), r.key[:12], r.digest[:12], r.stats.get("nodes", "?"),
             r.stats.get("collectives", "?"), f"{r.seconds:.2f}", "built" if r.traced else "cached"]
            for r in results]
    print_table(["CONFIG", "KEY", "DIGEST", "NODES", "COLLECTIVES", "SECONDS", "STATUS"], rows,
                 right={3, 4, 5})


def load_job(target: str):
    """``load_target``; when the user's own code raised, show its traceback too."""
    from ..job import load_target

    _cwd_importable()
    try:
        return load_target(target)
    except TargetError as exc:
        cause = exc.__cause__
        if cause is not None and not isinstance(cause, (SpmdAotError, ModuleNotFoundError)):
            traceback.print_exception(type(cause), cause, cause.__traceback__)
        raise


def _cwd_importable() -> None:
    """Make 'module:job' targets importable from the current directory, as under `python -m`
    (the `spmd-aot` script's own sys.path starts with its bin directory instead)."""
    cwd = os.getcwd()
    if not any(entry in ("", ".") or os.path.abspath(entry) == cwd for entry in sys.path):
        sys.path.insert(0, cwd)


def _unique(items: Iterable) -> list:
    seen: dict = {}
    for item in items:
        seen.setdefault(item, None)
    return list(seen)


def cmd_explain(args) -> int:
    """Compute the key of TARGET for one configuration without tracing; say hit or why not."""
    from ..keying.explain import explain_miss
    from ..hints import build_command

    plan = plan_for(args, args.world_size, args.placement)
    job = load_job(args.target)
    from ..building.builder import job_key

    key = job_key(job, plan)
    store = store_at(args.cache_dir)
    root = cache_root(args.cache_dir)
    digest = None
    if store is not None:  # a hit needs an entry whose guards hold here, not only a ref
        from ..errors import SpmdAotError
        from ..keying.lookup import find_entry

        try:
            digest = find_entry(store, key).digest
        except SpmdAotError:
            digest = None
    if digest is not None:
        print(f"hit: {plan.describe()} is cached in {root}")
        print(f"  key     {key.key}")
        print(f"  digest  {digest}")
        return EXIT_OK
    print(f"miss: {plan.describe()} is not cached in {root}")
    print(f"  key     {key.key}")
    why = explain_miss(store, key) if store is not None else f"The cache directory {root} does not exist."
    print(f"  {why}")
    print(f"  build it with: {build_command(plan, target=args.target, cache_dir=root)}")
    return EXIT_PROBLEMS

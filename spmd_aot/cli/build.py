"""``build`` and ``explain``: a job's configurations traced into the cache, or looked up without tracing."""

from __future__ import annotations

import dataclasses
import os
import sys
import traceback
from collections.abc import Iterable

from ..errors import SpmdAotError, TargetError
from .option_flags import check_read, parallel_from_args, run_from_args
from .report import EXIT_ERROR, EXIT_OK, EXIT_PROBLEMS, Failed, error, print_table
from .stores import cache_root, store_at


def plan_for(args, world_size: int, placement: str):
    """One configuration: the command line's options for ``placement`` (only those it reads,
    ``ParallelOptions.for_placement``) at ``world_size`` ranks of ``--device``; with
    ``--pipeline-stages`` a ``PipelineConfig`` (a pipeline is its own entry kind, not a plan)."""
    options = parallel_from_args(args, placement)
    if options.pipeline_stages > 1:
        options.pipeline(world_size)  # a world the pipeline cannot use fails before any build
        return PipelineConfig(options, world_size, args.device)
    return options.plan(world_size, args.device)


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    """A pipeline-parallel configuration of ``spmd-aot build``: its options at one world size."""

    options: object
    world_size: int
    device: str

    def describe(self) -> str:
        return f"world={self.world_size} {self.options.pipeline(self.world_size).describe()}"


def cmd_build(args) -> int:
    """Build the cross product of world sizes x placements and print one row per config."""
    from ..building.builder import build
    from .progress import Progress

    check_read(args, _unique(args.placement or ["replicate"]))
    plans = _unique(plan_for(args, w, p) for w in args.world_size for p in (args.placement or ["replicate"]))
    run = run_from_args(args)
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
                where = dataclasses.replace(run, store=store)
                result = build(job, plan=plan, run=where) if not isinstance(plan, PipelineConfig) else \
                    build(job, parallel=plan.options, world_size=plan.world_size, device=plan.device, run=where)
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
    rows = [[(r.plan if hasattr(r, "plan") else r).describe(), r.key[:12], r.digest[:12], r.stats.get("nodes", "?"),
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

    check_read(args, [args.placement or "replicate"])
    plan = plan_for(args, args.world_size, args.placement or "replicate")
    job = load_job(args.target)
    from ..building.builder import job_key

    key = job_key(job, plan, kernels=run_from_args(args).kernels)
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

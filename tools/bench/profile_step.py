"""Where a loaded step's time goes, against eager: communication, compute, and op by op.

    python tools/bench/profile_step.py --world 2 --layers 12 --d-model 256            # replicate
    python tools/bench/profile_step.py --world 2 --layers 2 --d-model 64 --profile   # + op tables
    python tools/bench/profile_step.py --world 2 --placement shard

``tools/bench/bench_step.py`` says how fast the loaded step is; this says why. It builds one
configuration of the bench transformer + AdamW offline, then on real gloo ranks times, in
interleaved blocks (the ratios are taken within each block, as in bench_step):

  loaded        the loaded step (``spmd_aot.compile(..., require_hit=True)``)
  eager         eager DDP (replicate) or FSDP2 (shard): the oracle
  local         (world > 1) the same eager model and optimizer without DDP/FSDP2: eager compute,
                no communication
  loaded-local  (replicate) the loaded program with its collectives and waits skipped: the loaded
                step's compute alone (its results are not synchronized; timing only)

so ``eager - local`` is what DDP's communication costs a step and ``loaded - loaded-local``
what the loaded step's buckets cost. With ``--profile``, rank 0 also prints torch profiler
tables (self CPU time per op over 5 steps) for the loaded step and the eager oracle.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_step as bench  # noqa: E402  (a sibling file: the same model, batches and oracles)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import spmd_aot  # noqa: E402
from spmd_aot.examples.models import train_step  # noqa: E402

_c10d = torch.ops._c10d_functional
_COLLECTIVES = {_c10d.all_reduce_.default, _c10d.all_reduce.default, _c10d.wait_tensor.default}


def _without_collectives(program) -> int:
    """Make every all_reduce and wait of a loaded ``Program`` return its input: the step's
    compute alone. Only for ``replicate``, whose collectives keep their input's shape."""
    handles = {op._op: op for op in _COLLECTIVES}
    skipped = 0
    steps = []
    for fn, *rest in program._steps:
        if fn in handles:
            fn, skipped = (lambda x, *args: x), skipped + 1
        steps.append((fn, *rest))
    program._steps = steps
    return skipped


def _rank_main(rank, world, port, job, s, cache_dir, results):
    """One rank: ``job`` is (bench config, profile?, rows per table)."""
    cfg, with_profile, rows = job
    torch.set_num_threads(1)
    try:
        if world > 1:
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        batch = bench._batch(s, rank)

        def loaded():
            model, optim = bench._model_and_optim(cfg, s)
            step = spmd_aot.compile(train_step, placement=cfg.spmd_placement, cache_dir=cache_dir,
                                    require_hit=True)
            step(model, optim, batch)  # binds: the program exists from here on
            return step, model, optim

        variants = {}
        step, model, optim = loaded()
        variants["loaded"] = lambda: step(model, optim, batch)
        eager, eager_optim = bench._eager_model(cfg, world, s)
        variants["eager"] = lambda: train_step(eager, eager_optim, batch)
        if world > 1:  # at world 1 the eager oracle is already local
            local, local_optim = bench._model_and_optim(cfg, s)
            variants["local"] = lambda: train_step(local, local_optim, batch)
        if cfg.spmd_placement == "replicate" and world > 1:
            bare, bare_model, bare_optim = loaded()
            _without_collectives(bare._bound.program)
            variants["loaded-local"] = lambda: bare(bare_model, bare_optim, batch)

        for fn in variants.values():
            for _ in range(s.warmup):
                fn()
        times = bench.timed_blocks(variants, s.blocks, s.steps, lambda: bench._sync(world))
        tables = {}
        if with_profile:
            from torch.profiler import ProfilerActivity, profile
            for name in ("loaded", "eager"):
                bench._sync(world)
                with profile(activities=[ProfilerActivity.CPU]) as prof:
                    for _ in range(5):
                        variants[name]()
                bench._sync(world)
                tables[name] = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)
        results.put((rank, "ok", (times, tables) if rank == 0 else None))
    except BaseException as exc:  # report, never hang the parent
        import traceback
        results.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        if world > 1 and dist.is_initialized():
            dist.destroy_process_group()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--placement", default="replicate", choices=("replicate", "shard"))
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=4, help="steps per timed block")
    parser.add_argument("--blocks", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--profile", action="store_true", help="also print op tables (rank 0)")
    parser.add_argument("--rows", type=int, default=20, help="rows per op table")
    parser.add_argument("--timeout", type=float, default=1800)
    args = parser.parse_args(argv)
    placement = "single" if args.world == 1 else args.placement
    cfg = bench.Config(args.world, placement, args.layers, args.d_model)
    s = bench.Settings(seq=args.seq, batch=args.batch, steps=args.steps, blocks=args.blocks,
                       warmup=max(1, args.warmup), with_compile=False, comm={})
    print(f"# python tools/bench/profile_step.py {' '.join(sys.argv[1:] if argv is None else argv)}".rstrip())
    print(f"# torch {torch.__version__}, world {args.world} {placement}, {args.layers} layers, d_model "
          f"{args.d_model}, context {args.seq}, batch {args.batch} per rank, AdamW; {args.blocks} blocks x "
          f"{args.steps} steps", flush=True)
    with tempfile.TemporaryDirectory(prefix="profile_step_") as cache_dir:
        bench.build(cfg, s, cache_dir)
        times, tables = bench.run_world(args.world, (cfg, args.profile, args.rows), s, cache_dir, args.timeout,
                                        rank_main=_rank_main)
    median = {n: statistics.median(v) for n, v in times.items()}
    ratio = lambda a, b: bench.median_ratio(times[a], times[b])  # noqa: E731
    local = "local" in times
    print("| variant | ms/step | / eager |" + (" / local |" if local else ""))
    print("|---|---|---|" + ("---|" if local else ""))
    for name in times:
        print(f"| {name} | {median[name]:.2f} | {ratio(name, 'eager'):.3f} |"
              + (f" {ratio(name, 'local'):.3f} |" if local else ""))
    if "loaded-local" in times:
        print(f"# communication per step: eager {median['eager'] - median['local']:.1f} ms "
              f"(eager - local), loaded {median['loaded'] - median['loaded-local']:.1f} ms "
              f"(loaded - loaded-local)")
    for name, text in tables.items():
        print(f"\n## {name}: self CPU time per op, 5 steps, rank 0\n{text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Build every supported-feature configuration the tests and examples use and print the operator
overloads their graphs call, one per line (what seeds ``spmd_aot/allowed_ops.txt``).

    PYTHONPATH=. python tools/collect_ops.py [--cache-dir DIR] [--missing]

``--missing`` prints only overloads that are not on the allowlist yet.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import msgpack

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

import spmd_aot  # noqa: E402
from spmd_aot.artifact import read_manifest  # noqa: E402
from spmd_aot.store import LocalStore  # noqa: E402


def configurations():
    from features import FEATURES, VARIANTS
    from jobs import MODELS, OPTIMIZERS, make_job

    for name, (model, optim, step, batch, _) in FEATURES.items():
        job = spmd_aot.Job(step=step, model=model, optimizer=optim, batch=lambda b=batch: b(0, 0))
        for variant, (options, _) in VARIANTS.items():
            world = 4 if "mesh_shape" in options else 2
            yield f"{name}/{variant}", job, dict(world_size=world, **options)
        yield f"{name}/world1", job, dict(world_size=1)
    for model in MODELS:
        for optim in OPTIMIZERS:
            for placement in ("replicate", "shard"):
                yield f"{model}/{optim}/{placement}", make_job(model, optim), dict(world_size=2, placement=placement)
    import test_tensor_parallel as tp

    for world, configs in tp.CONFIGS.items():
        for config in configs:
            for optim in tp.OPTIMIZERS:
                job = spmd_aot.Job(step=tp.step, model=tp.TPNet, optimizer=tp.OPTIMIZERS[optim], batch=tp.make_batch)
                yield f"tp/{config}/{world}/{optim}", job, dict(world_size=world, **tp._options(config, world))


def graph_ops(store: LocalStore, digest: str) -> set[str]:
    graph = store.get(read_manifest(store, digest)["blobs"]["graph"])
    doc = msgpack.unpackb(graph, raw=False)
    return {n["target"] for n in doc["nodes"] if n["op"] == "call_function"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache-dir")
    parser.add_argument("--missing", action="store_true")
    args = parser.parse_args()
    cache = args.cache_dir or tempfile.mkdtemp(prefix="spmd_aot_ops_")
    store = LocalStore(cache)
    ops: set[str] = set()
    for name, job, options in configurations():
        try:
            result = spmd_aot.build(job, store=store, **options)
        except spmd_aot.SpmdAotError as exc:
            print(f"# {name}: {exc}", file=sys.stderr)
            continue
        ops |= graph_ops(store, result.digest)
        print(f"# {name}: {result.stats.get('nodes')} nodes", file=sys.stderr)
    if args.missing:
        from spmd_aot.allowlist import ALLOWED_OPS

        ops -= set(ALLOWED_OPS)
    for op in sorted(ops):
        print(op)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Build every supported-feature configuration the tests and examples use and print the operator
overloads their graphs call, one per line (what seeds ``spmd_aot/allowed_ops.txt``).

    PYTHONPATH=. python tools/ops/collect_ops.py [--cache-dir DIR] [--missing]

``--missing`` prints only overloads that are not on the allowlist yet.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import msgpack
import torch

_TESTS = os.path.join(os.path.dirname(__file__), "..", "..", "tests")
sys.path[:0] = [_TESTS, os.path.join(_TESTS, "parallel")]  # support.*, and test_tensor_parallel's configurations

import spmd_aot  # noqa: E402
from spmd_aot.entries import read_manifest  # noqa: E402
from spmd_aot.store import LocalStore  # noqa: E402


def configurations():
    from support.features import FEATURES, VARIANTS
    from support.jobs import MODELS, OPTIMIZERS, make_job

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


#: Built-in optimizers whose initial state is zeros (what a first compiled step supports), each
#: traced in every implementation a user can ask for: the per-tensor loop, foreach, and torch's
#: default (None: the traced step picks fused or foreach, see docs/models.md "Optimizer implementation").
OPTIMIZER_FACTORIES = {
    "SGD": lambda ps, **kw: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01, **kw),
    "Adam": lambda ps, **kw: torch.optim.Adam(ps, lr=1e-2, amsgrad=True, **kw),
    "AdamW": lambda ps, **kw: torch.optim.AdamW(ps, lr=1e-2, **kw),
    "Adamax": lambda ps, **kw: torch.optim.Adamax(ps, lr=1e-2, **kw),
    "RAdam": lambda ps, **kw: torch.optim.RAdam(ps, lr=1e-2, **kw),
    "NAdam": lambda ps, **kw: torch.optim.NAdam(ps, lr=1e-2, **kw),
    "RMSprop": lambda ps, **kw: torch.optim.RMSprop(ps, lr=1e-2, momentum=0.9, **kw),
    "Adadelta": lambda ps, **kw: torch.optim.Adadelta(ps, **kw),
    "Adagrad": lambda ps, **kw: torch.optim.Adagrad(ps, lr=1e-2, **kw),
}


def optimizer_configurations():
    from support.jobs import make_job

    for name, factory in OPTIMIZER_FACTORIES.items():
        for impl in (False, True, None):
            job = make_job("mlp", "sgd")
            job.optimizer = lambda m, f=factory, i=impl: f(m.parameters(), foreach=i)
            for world, placement in ((1, "replicate"), (2, "replicate"), (2, "shard")):
                yield f"mlp/{name}/foreach={impl}/{placement}/world{world}", job, \
                    dict(world_size=world, placement=placement)


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
    for name, job, options in (*configurations(), *optimizer_configurations()):
        try:
            result = spmd_aot.build(job, store=store, **options)
        except spmd_aot.SpmdAotError as exc:
            print(f"# {name}: {exc}", file=sys.stderr)
            continue
        ops |= graph_ops(store, result.digest)
        print(f"# {name}: {result.stats.get('nodes')} nodes", file=sys.stderr)
    if args.missing:
        from spmd_aot.format.allowlist import ALLOWED_OPS

        ops -= set(ALLOWED_OPS)
    for op in sorted(ops):
        print(op)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Cost of the cache key and its guards at job start, for a 12-layer transformer step.

Prints: key computation (the first call in the process, then the median of repeats) on real
objects (job start) and on fake ones (build), the guard check of the stored entry (cold: files
hashed; warm: one stat per file), the whole lookup (ref, manifest, guards), and what recording
the files that ran costs a trace.

    PYTHONPATH=. python tools/bench/bench_key.py [--layers 12] [--repeats 20]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
import time

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import spmd_aot
from spmd_aot.keying import fingerprint
from spmd_aot.keying import guards
from spmd_aot.building import pipeline
from spmd_aot.examples.models import Transformer, train_step
from spmd_aot.keying.key import compute_key
from spmd_aot.keying.lookup import find_entry
from spmd_aot.parallel.plan import Plan
from spmd_aot.state import TrainState, initialize_optimizer_state
from spmd_aot.store import open_store


def objects(layers: int):
    model = Transformer(vocab=1024, d_model=256, n_heads=8, n_layers=layers, max_len=64)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    initialize_optimizer_state(optim)
    batch = (torch.randint(0, 1024, (4, 64)), torch.randint(0, 1024, (4, 64)))
    return model, optim, batch


def timed(fn, repeats: int) -> tuple[float, float]:
    """(first call, median of the following ``repeats``) in milliseconds."""
    start = time.perf_counter()
    fn()
    first = (time.perf_counter() - start) * 1e3
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        runs.append((time.perf_counter() - start) * 1e3)
    return first, statistics.median(runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)
    plan = Plan(2)

    model, optim, batch = objects(args.layers)
    real = TrainState(model, optim, batch, plan)
    first, median = timed(lambda: compute_key(train_step, real, plan), args.repeats)
    print(f"key, real objects (job start), {args.layers} layers: first {first:.1f} ms, median {median:.1f} ms")
    with FakeTensorMode():
        fake = TrainState(*objects(args.layers), plan)
    first, median = timed(lambda: compute_key(train_step, fake, plan), args.repeats)
    print(f"key, fake objects (build):               first {first:.1f} ms, median {median:.1f} ms")

    cache = tempfile.mkdtemp(prefix="bench_key_")
    job = spmd_aot.Job(step=train_step, model=lambda: objects(args.layers)[0],
                       optimizer=lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.1),
                       batch=lambda: objects(0)[2])
    warm_up = spmd_aot.Job(step=train_step, model=lambda: objects(1)[0], optimizer=job.optimizer, batch=job.batch)
    spmd_aot.build(warm_up, world_size=2, cache_dir=tempfile.mkdtemp(prefix="bench_key_"))
    built = spmd_aot.build(job, world_size=2, cache_dir=cache)
    store = open_store(cache)
    key = compute_key(train_step, real, plan)
    assert key.key == built.key, "build and job start computed different keys"
    manifest = spmd_aot.entries.read_manifest(store, built.digest)
    recorded = manifest["guards"]
    fingerprint._DIGESTS.clear()
    start = time.perf_counter()
    assert guards.check(recorded, key) is None
    cold = (time.perf_counter() - start) * 1e3
    _, warm = timed(lambda: guards.check(recorded, key), args.repeats)
    print(f"guard check, {len(recorded['files'])} files, {len(recorded['distributions'])} distributions, "
          f"{len(recorded['tensors'])} tensors: cold {cold:.2f} ms, warm {warm:.2f} ms")
    _, lookup = timed(lambda: find_entry(store, key), args.repeats)
    print(f"lookup (ref, manifest, guards): {lookup:.2f} ms")

    traced = built.stats["trace_seconds"]

    @contextlib.contextmanager
    def not_recording():
        yield set()

    recording = guards.recording_sources
    pipeline.guards.recording_sources = not_recording
    try:
        plain = spmd_aot.build(job, world_size=2, cache_dir=tempfile.mkdtemp(prefix="bench_key_")).stats["trace_seconds"]
    finally:
        pipeline.guards.recording_sources = recording
    print(f"trace + expand with the file recorder {traced:.2f} s, without {plain:.2f} s")


if __name__ == "__main__":
    main()

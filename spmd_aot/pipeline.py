"""trace -> passes -> encode: the one path from live (or fake) objects to artifact blobs.

Both the offline builder and a job-start cache miss go through ``trace_to_blobs``, so what a
job traces for itself is the graph ``spmd-aot build`` would have stored (the blobs are
identical; the manifest differs only in the measured ``trace_seconds``).
"""

from __future__ import annotations

import time
from typing import Callable, Iterable

import torch

from .artifact import encode_artifact, store_artifact
from .errors import UnsupportedError
from .key import CacheKey
from .passes import collective_stats, strip_profiler_ops
from .plan import Plan
from .state import TrainState
from .trace import device_mesh, trace_step

__all__ = ["trace_to_blobs", "trace_and_store"]


def trace_to_blobs(step: Callable, state: TrainState, plan: Plan, key: CacheKey,
                   transformations: Iterable[Callable] = ()) -> dict[str, bytes]:
    start = time.perf_counter()
    traced = trace_step(step, state, plan, device_mesh(plan))
    strip_profiler_ops(traced.gm)
    for transform in transformations:
        result = transform(traced.gm)
        if isinstance(result, torch.fx.GraphModule):
            traced.gm = result
        traced.gm.recompile()
    stats = {"nodes": len(traced.gm.graph.nodes), **collective_stats(traced.gm)}
    grads = sum(1 for _, p in state.params if p.requires_grad)
    if plan.placement == "replicate" and plan.world_size > 1 and stats["by_kind"].get("all_reduce", 0) > grads:
        raise UnsupportedError(
            f"the expanded graph has {stats['by_kind']['all_reduce']} all_reduces for {grads} gradients; "
            "a DDP step needs at most one per gradient (is a parameter used as a DTensor in the step?)"
        )
    stats["trace_seconds"] = round(time.perf_counter() - start, 4)
    return encode_artifact(traced, key, plan, state.slots(), stats)


def trace_and_store(store, step: Callable, state: TrainState, plan: Plan, key: CacheKey,
                    transformations: Iterable[Callable] = ()) -> tuple[str, bool]:
    """Trace and store unless another process stored the key first. Returns (digest, traced)."""
    with store.lock(key.key):
        existing = store.get_ref(key.key)
        if existing is not None and store.has(existing):
            return existing, False
        blobs = trace_to_blobs(step, state, plan, key, transformations)
        return store_artifact(store, key.key, blobs), True

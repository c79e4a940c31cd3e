"""trace -> passes -> user transformations -> encode: the one path from live (or fake)
objects to artifact blobs.

Both the offline builder and a job-start cache miss go through ``trace_to_blobs``, so what a
job traces for itself is the graph ``spmd-aot build`` would have stored (the blobs are
identical; the manifest differs only in the measured ``trace_seconds`` and in its guards,
which record what ran in the tracing process).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable

import torch

from ..keying import guards
from ..format.allowlist import extra_ops
from ..entries import check_entry, gc_pause, store_artifact
from ..format.artifact import amended, encode_artifact, layout_entries
from ..errors import CorruptArtifactError, UnsupportedError
from ..keying.key import CacheKey
from .kernels import kernel_parts
from .load_check import check_before_storing
from ..keying.lookup import find_entry
from .peak_memory import graph_peak_bytes
from ..tracing.causal_masks import masks_used_as_given
from ..format.numpy_absent import numpy_lookups_skipped
from ..tracing.override import Transforms, swapped_submodules
from ..passes import (ask_conv_weight_grads, collective_stats, dedupe_collectives, fold_views, prefetch_groups,
                     remove_detach, rewrite_inplace_views, sink_waits, strip_profiler_ops)
from ..parallel import axes
from ..parallel.plan import Plan
from ..state import TrainState
from ..tracing.trace import trace_step

__all__ = ["trace_to_blobs", "trace_and_store", "UnstoredTrace"]

log = logging.getLogger(__name__)


def trace_to_blobs(step: Callable, state: TrainState, plan: Plan, key: CacheKey, mesh,
                   inputs: list[torch.Tensor], transforms: Transforms = Transforms(),
                   previous: str | None = None) -> dict[str, bytes]:
    """``previous``: the manifest this entry replaces under the same key (see ``lookup``)."""
    start = time.perf_counter()
    gc_pause.keep()  # the fake model and state stay to the end of a build (entries/gc_pause.py)
    swap = functools.partial(swapped_submodules, state.model, transforms.module_override) \
        if transforms.module_override else None
    # every file that runs is guarded; torch's transformer modules use an unhinted mask as given
    with numpy_lookups_skipped(), masks_used_as_given(), guards.recording_sources() as ran:
        traced = trace_step(step, state, plan, mesh, inputs, transform_model=swap)
    gm = traced.gm
    gc_pause.keep()  # so does the traced graph
    # Not recorded: this package's passes over the graph (no user code; the guards skip its files
    # and torch's), which the recorder's hook on every call made 2.5x slower (0.6 CPU-s at 80 layers)
    with gc_pause.paused():  # the passes rewrite a graph that stays: no garbage cycles (entries/gc_pause.py)
        strip_profiler_ops(gm)
        remove_detach(gm)
        dedupe_collectives(gm)
        prefetch_groups(gm)
        if plan.world_size > 1:
            axes.graph_passes(gm, plan, traced)
        slots = state.slots()
        layout = layout_entries(slots, plan)
    if transforms.module_override or transforms.gm_transformation is not None:
        with numpy_lookups_skipped(), masks_used_as_given(), guards.recording_sources() as transformed:
            gm.recompile()  # user transformations may read gm.code or call gm
            for override in transforms.module_override:
                gm = _checked(override.transform(gm, layout), gm, type(override).__qualname__)
            if transforms.gm_transformation is not None:
                gm = _checked(transforms.gm_transformation(gm), gm, "gm_transformation")
        ran |= transformed  # the user's transformations are guarded as the trace is
    with gc_pause.paused():  # the passes, then acyclic containers from here to the blobs
        rewrite_inplace_views(gm)  # after user transformations too: a stored graph never changes geometry in place
        ask_conv_weight_grads(gm)  # after user transformations too: the load refuses a bias-only conv gradient
        sink_waits(gm)  # after user transformations too: they may add collectives
        fold_views(gm)  # last: the passes above add views too
        gm.recompile()  # passes edit gm.graph only; the stored code is generated once, here
        traced.gm = gm
        blobs = _encoded(traced, state, slots, plan, key, start, ran, previous)
    if "kernels" in key.values:  # the key asks for compiled kernels (``kernels.py``)
        blobs = amended(blobs, *kernel_parts(blobs, plan, key.values["kernels"]))
    return blobs


def _encoded(traced, state: TrainState, slots, plan: Plan, key: CacheKey, start: float, ran,
             previous) -> dict[str, bytes]:
    """The entry's blobs for the traced, passed graph (``traced.gm``): its statistics, guards and
    encoding."""
    gm = traced.gm
    stats = {"nodes": len(gm.graph.nodes), **collective_stats(gm, traced.gradient_collectives),
             "peak_bytes": graph_peak_bytes(gm)}
    if traced.micro_batches > 1:  # only then: entries without accumulation keep the stats they had
        stats["micro_batches"] = traced.micro_batches
    if traced.blocks:  # a deep stack of identical blocks: stamped from three, or why not (tracing/repeated.py)
        stats["blocks"] = traced.blocks
    if plan.tp_skipped:  # patterns of the model's own tp_plan that name modules it lacks (skipped)
        stats["tp_plan_skipped"] = list(plan.tp_skipped)
    _check_collectives(stats, slots, plan, traced.groups, traced.axis_budget, state.forward_only)
    opted = extra_ops(_op_names(gm))
    if opted:  # only when there are: entries without an opt-in keep the stats they always had
        stats["opted_in_ops"] = opted
    stats["trace_seconds"] = round(time.perf_counter() - start, 4)
    recorded = guards.record(ran, key)
    log.debug("key %s: guarding %d files, %d distributions, %d tensor values", key.key[:12],
              len(recorded["files"]), len(recorded["distributions"]), len(recorded["tensors"]))
    return encode_artifact(traced, key, plan, slots, stats, recorded, previous)


def _checked(result, gm, who: str) -> torch.fx.GraphModule:
    out = gm if result is None else result
    if not isinstance(out, torch.fx.GraphModule):
        raise UnsupportedError(f"{who} returned a {type(result).__name__}, expected a GraphModule or None")
    out.graph.lint()
    out.recompile()
    return out


def _op_names(gm) -> set[str]:
    """``"namespace::op.overload"`` of every operator the graph calls."""
    return {f"{t.namespace}::{t._opname}.{t._overloadname}" for node in gm.graph.nodes
            if node.op == "call_function" and isinstance((t := node.target), torch._ops.OpOverload)}


def _check_collectives(stats: dict, slots, plan: Plan, groups=(), axis_budget=None, forward_only: bool = False) -> None:
    """Refuse graphs with more collectives than the axes need (``axes.collective_limits``: what
    each allows for the parameters plus what the traced calls of its layers added)."""
    kinds = stats["by_kind"]
    limits = axes.collective_limits(plan, slots, groups, axis_budget or {}, forward_only)
    for kind, limit in limits.items():
        if kinds.get(kind, 0) > limit:
            raise UnsupportedError(
                f"the expanded graph has {kinds[kind]} {kind} collectives where "
                f"{'a forward-only step under ' if forward_only else ''}{plan.describe()} needs "
                f"at most {limit}; is a parameter used as a DTensor in the step?"
            )


class UnstoredTrace(Exception):
    """The step was traced but the store refused the entry: the blobs (the job runs from them,
    in memory, instead of tracing again) and why."""

    def __init__(self, blobs: dict[str, bytes], cause: BaseException):
        super().__init__(str(cause))
        self.blobs, self.cause = blobs, cause


def trace_and_store(store, step: Callable, state: TrainState, plan: Plan, key: CacheKey, mesh,
                    inputs: list[torch.Tensor], transforms: Transforms = Transforms(),
                    store_failures: tuple[type[BaseException], ...] = ()) -> tuple[str, bool]:
    """Trace and store unless an entry for the key whose guards hold here exists (another
    process may have stored it while this one waited for the lock). Returns (digest, traced).

    An existing entry counts only if it passes the checks a load runs (``check_entry``: it reads
    back whole, is the entry for this key, and its graph passes the load check); a damaged one (a
    missing part, a corrupt blob, a ref to another key's manifest, a graph a load refuses) is
    rebuilt. An entry whose guards fail stays reachable behind the new one (``previous``). A new
    entry is checked as a load checks it before anything is stored (``load_check.py``). So a build
    that returns leaves under the key an entry that every load accepts.
    ``store_failures``: the errors of storing that raise ``UnstoredTrace`` (holding the blobs).
    """
    from ..store.leases import reading

    with store.lock(key.key):
        previous = None
        try:
            found = find_entry(store, key)
            previous = found.head
            if found.digest is not None:
                with reading(store, found.digest):  # a lease: gc must not delete it while it is read
                    check_entry(store, key.key, found.digest)  # intact, and what a load accepts
                return found.digest, False
        except CorruptArtifactError as exc:
            log.warning("cache entry for key %s is damaged (%s); rebuilding it", key.key[:12], exc)
        blobs = trace_to_blobs(step, state, plan, key, mesh, inputs, transforms, previous)
        with gc_pause.paused():
            check_before_storing(blobs, key)  # what a load would refuse is never stored
        try:
            return store_artifact(store, key.key, blobs), True
        except store_failures as exc:
            raise UnstoredTrace(blobs, exc) from exc

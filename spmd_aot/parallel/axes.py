"""The axes registry, and how the axes compose in a step.

``AXES`` lists every parallelism axis in the order they apply (torchtitan: ``apply_tp``, then
``apply_fsdp``): tensor parallelism splits what modules compute with, data parallelism then
averages (or shards) what TP left. Adding an axis is one module defining an ``Axis`` (and its
role in ``dims.py``) plus one line here.
"""

from __future__ import annotations

import contextlib

from . import context_parallel
from . import data_parallel
from . import expert_parallel
from . import tensor_parallel

__all__ = ["AXES", "active_axes", "Tracing", "traced_buffers", "graph_passes", "collective_limits",
           "prepare_live_state", "state_zeros", "rehome_state"]

AXES = (
    tensor_parallel.AXIS,
    context_parallel.AXIS,
    expert_parallel.AXIS,
    data_parallel.AXIS,
)


def active_axes(plan) -> list:
    return [axis for axis in AXES if axis.active(plan)]


class Tracing:
    """Every active axis' tracing context, made (and so checked) before tracing starts and
    entered around the step; ``budget()`` sums the collectives their calls added."""

    def __init__(self, plan, model, mesh):
        made = (axis.tracing(plan, model, mesh) for axis in active_axes(plan)) if mesh is not None else ()
        self.contexts = [c for c in made if c is not None]

    def __enter__(self):
        self._stack = contextlib.ExitStack()
        for context in self.contexts:
            self._stack.enter_context(context)
        return self

    def __exit__(self, *exc):
        return self._stack.__exit__(*exc)

    def batch(self, leaves: list) -> list:
        """The batch's flattened leaves as the step sees them: each context with a ``batch``
        method (context parallel: cut to this rank's tokens) applied in turn."""
        for context in self.contexts:
            if hasattr(context, "batch"):
                leaves = context.batch(leaves)
        return leaves

    def buffers(self, names: list[list[str]], buffers: list) -> list:
        """The buffers (each with its module attribute names) as the step sees them: each context
        with a ``buffers`` method applied in turn (context parallel: sequence buffers cut)."""
        for context in self.contexts:
            if hasattr(context, "buffers"):
                buffers = context.buffers(names, buffers)
        return buffers

    def budget(self) -> dict[str, int]:
        total: dict[str, int] = {}
        for context in self.contexts:
            for kind, n in context.budget().items():
                total[kind] = total.get(kind, 0) + n
        return total


def traced_buffers(plan, buffers, mesh):
    for axis in active_axes(plan):
        buffers = axis.traced_buffers(plan, buffers, mesh)
    return buffers


def graph_passes(gm, plan, traced) -> None:
    for axis in active_axes(plan):
        axis.graph_passes(gm, plan, traced)


def collective_limits(plan, slots, groups, traced_budget: dict[str, int], forward_only: bool) -> dict[str, int]:
    """The most collectives of each kind the step may hold: what every axis allows for its
    parameters plus what the calls traced under the axes' contexts added. Gathers and
    reduce_scatters are bounded by default; a kind an axis leaves unbounded (None) is not."""
    limits = {"all_gather_into_tensor": 0, "reduce_scatter_tensor": 0}
    unbounded = set()
    for part in [axis.budget(plan, slots, groups, forward_only) for axis in active_axes(plan)] + [traced_budget]:
        for kind, n in part.items():
            if n is None:
                unbounded.add(kind)
            else:
                limits[kind] = limits.get(kind, 0) + n
    return {kind: n for kind, n in limits.items() if kind not in unbounded}


# ---------------------------------------------------------------------------- job start
# The live state takes the form of the graph's leaves: with DTensor leaves, parameters and
# optimizer state become DTensors over padded local storage (``sharding.py``).
def prepare_live_state(model, optim, plan, mesh) -> None:
    """Turn the live parameters and optimizer state into the leaves' form, in place, once per
    model (after rank 0's values were broadcast), as ``fully_shard`` / ``parallelize_module`` do."""
    from .sharding import shard_model_and_optimizer

    if plan.dtensor_leaves:
        shard_model_and_optimizer(model, optim, plan, mesh)


def state_zeros(param, shape, dtype, device):
    """Missing optimizer state for ``param``, created in the parameter's form."""
    from .sharding import sharded_zeros

    return sharded_zeros(param, shape, dtype, device)


def rehome_state(optim) -> None:
    """Bring optimizer state replaced since the last step (``load_state_dict``) back into the
    leaves' form (nothing to do for plain parameters)."""
    from .sharding import ensure_sharded_state

    ensure_sharded_state(optim)

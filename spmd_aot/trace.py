"""Trace a whole train step (forward, backward, optimizer step) into one FX graph.

Parameters, buffers, optimizer state and batch leaves become graph inputs in ``TrainState``
order. The optimizer's in-place updates stay in-place ops on those inputs, so running the
graph on the user's real tensors updates ``model`` and ``optim`` exactly as eager would.
Tracing always uses fake tensors: it needs no parameter memory and never communicates.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections import defaultdict
from typing import Any, Callable
from unittest import mock

import torch
import torch.utils._pytree as pytree
from torch.fx.experimental.proxy_tensor import make_fx
from torch.nn.utils import stateless

from .errors import UnsupportedError
from .expand import parameter_boundary
from .plan import Plan
from .state import TrainState

__all__ = ["TracedStep", "trace_step", "device_mesh", "fake_world"]


@dataclasses.dataclass
class TracedStep:
    gm: torch.fx.GraphModule
    out_spec: pytree.TreeSpec
    out_constants: dict[int, Any]  # output leaf index -> non-tensor value returned by the step
    group_names: dict[str, int]  # process-group name seen while tracing -> mesh dimension


def device_mesh(plan: Plan):
    """The mesh over the default process group (fake at build time, live at job start)."""
    if plan.world_size == 1:
        return None
    from torch.distributed.device_mesh import DeviceMesh

    ranks = torch.arange(plan.world_size).reshape(plan.mesh_shape)
    return DeviceMesh(plan.device_type, ranks)


@contextlib.contextmanager
def fake_world(world_size: int):
    """A fake default process group of ``world_size`` ranks, so a CPU box can build for 64."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("spmd-aot build needs no process group; one is already initialized")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def trace_step(step: Callable, state: TrainState, plan: Plan, mesh) -> TracedStep:
    """Trace ``step(model, optim, batch)`` over ``state``; inputs may be real or fake tensors."""
    slots = state.slots()
    n_params, n_buffers = len(state.params), len(state.buffers)
    opt_slots = state.optimizer_slots()
    boundary = parameter_boundary(plan, mesh)
    out_info: dict[str, Any] = {}

    def flat_step(*flat):
        params = flat[:n_params]
        buffers = flat[n_params:n_params + n_buffers]
        opt_tensors = flat[n_params + n_buffers:n_params + n_buffers + len(opt_slots)]
        batch_leaves = flat[n_params + n_buffers + len(opt_slots):]
        leaves = [p.detach().requires_grad_(s.requires_grad) for p, s in zip(params, slots)]
        bindings = {}
        for (names, _), leaf in zip(state.params, leaves):
            compute = boundary(leaf)
            bindings.update(dict.fromkeys(names, compute))
        for (names, _), buf in zip(state.buffers, buffers):
            bindings.update(dict.fromkeys(names, buf))
        by_real = {id(real): leaf for (_, real), leaf in zip(state.params, leaves)}
        traced_state = defaultdict(dict)
        for real, entries in state.optim.state.items():
            traced_state[by_real[id(real)]] = dict(entries)
        for (real, key), t in zip(opt_slots, opt_tensors):
            traced_state[by_real[id(real)]][key] = t
        batch = pytree.tree_unflatten(list(batch_leaves), state.batch_spec)
        with stateless._reparametrize_module(state.model, bindings), \
                _optimizer_swapped(state.optim, by_real, traced_state):
            result = step(state.model, state.optim, batch)
        stale = [names[0] for (names, _), leaf in zip(state.params, leaves) if leaf.grad is not None]
        if stale:
            raise UnsupportedError(
                f"the step leaves gradients on {len(stale)} parameter(s) (first: {stale[0]}); "
                "a compiled step must end with optim.zero_grad() (set_to_none=True, the default)"
            )
        out_leaves, out_info["spec"] = pytree.tree_flatten(result)
        out_info["constants"] = {i: v for i, v in enumerate(out_leaves) if not isinstance(v, torch.Tensor)}
        for i, v in out_info["constants"].items():
            if not isinstance(v, (int, float, bool, str, type(None))):
                raise UnsupportedError(
                    f"the step returns a {type(v).__name__} at output leaf {i}; return tensors, "
                    "numbers, strings or None"
                )
        return [v for v in out_leaves if isinstance(v, torch.Tensor)]

    inputs = state.state_tensors() + list(state.batch_leaves)
    try:
        gm = make_fx(flat_step, tracing_mode="fake")(*inputs)
    except UnsupportedError:
        raise
    except Exception as exc:
        raise UnsupportedError(
            f"tracing the step failed for {plan.describe()}: {type(exc).__name__}: {exc}"
        ) from exc
    group_names = {}
    if mesh is not None:
        for dim in range(mesh.ndim):
            group_names[mesh.get_group(dim).group_name] = dim
    return TracedStep(gm, out_info["spec"], out_info["constants"], group_names)


@contextlib.contextmanager
def _optimizer_swapped(optim, by_real: dict, traced_state):
    """Point the optimizer at the traced leaves and take its compile-friendly path.

    With ``torch.compiler.is_compiling()`` true and ``capturable=True`` the built-in optimizers
    keep step counters as tensors instead of calling ``.item()`` (impossible on fake tensors).
    """
    saved_params = [g["params"] for g in optim.param_groups]
    saved_capturable = [g.get("capturable") for g in optim.param_groups]
    saved_state = optim.state
    original_step = optim.step

    def compile_path_step(*args, **kwargs):
        for g in optim.param_groups:
            if "capturable" in g:
                g["capturable"] = True
        try:
            with mock.patch("torch.compiler.is_compiling", lambda: True):
                return original_step(*args, **kwargs)
        finally:
            for g, c in zip(optim.param_groups, saved_capturable):
                if c is not None:
                    g["capturable"] = c

    try:
        for g in optim.param_groups:
            g["params"] = [by_real[id(p)] for p in g["params"]]
        optim.state = traced_state
        optim.step = compile_path_step
        yield
    finally:
        del optim.step
        optim.state = saved_state
        for g, params in zip(optim.param_groups, saved_params):
            g["params"] = params

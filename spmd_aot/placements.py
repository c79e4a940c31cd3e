"""Placements: how a step spreads parameters, gradients, optimizer state and buffers over the
data-parallel dimensions of the device mesh (every dimension but the tensor-parallel one,
when the plan has a ``tp_plan``: see ``tensor_parallel.py``).

One class per placement owns everything that depends on it: its text form (``name``, what
``Plan.placement`` and the manifest, the key and the CLI say), which meshes and per-parameter
overrides it accepts, the layout of its parameters, the tensor a module computes with, how
buffers are treated in the step, the graph passes it needs, its collective budget, and what
happens to the live model and optimizer at job start. ``Plan.strategy`` is the plan's
placement object. Adding a placement means adding one class here (subclasses register
themselves in ``PLACEMENTS``).
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch

from .errors import SpmdAotError
from .layout import TensorLayout
from .passes import bucket_gradient_all_reduces
from .sharding import ensure_sharded_state, shard_model_and_optimizer, sharded_zeros

__all__ = ["Placement", "PLACEMENTS", "Replicate", "Shard"]

PLACEMENTS: dict[str, "Placement"] = {}  # name -> placement object, in definition order


class Placement:
    """The interface; every method takes the ``Plan`` it serves (a placement holds no state)."""

    name: ClassVar[str]
    summary: ClassVar[str]
    # Plan fields that only this placement reads: the CLI applies their options to it alone,
    # and build hints print them only for it.
    cli_fields: ClassVar[tuple[str, ...]] = ()

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        PLACEMENTS[cls.name] = cls()

    # ------------------------------------------------------------------ the plan
    def check(self, plan) -> None:
        """Raise ``SpmdAotError`` if this placement cannot serve ``plan`` (its mesh, overrides)."""

    def check_override(self, pattern: str, name: str) -> None:
        """Raise ``SpmdAotError`` if a parameter may not take placement ``name`` under this one."""

    def dtensor_leaves(self, plan) -> bool:
        """Graph leaves (what the optimizer and ``model.parameters()`` see in the step) are
        DTensors (on a mesh of more than one rank)."""
        return bool(plan.tp)

    # ------------------------------------------------------------------ layout
    def layout(self, plan, shape: tuple[int, ...], tp_dim: int | None = None) -> TensorLayout:
        """The layout of a parameter (and of optimizer state shaped like it) that has this
        placement; ``tp_dim``: its dimension split over the TP ranks, if any."""
        raise NotImplementedError

    # ------------------------------------------------------------------ trace
    def compute(self, expander, leaf: torch.Tensor, layout: TensorLayout) -> torch.Tensor:
        """The tensor a module computes with, whose backward performs the gradient collective."""
        raise NotImplementedError

    def traced_buffers(self, plan, buffers: list[torch.Tensor], mesh) -> list[torch.Tensor]:
        """Buffers as the step sees them (on a mesh of more than one rank)."""
        return buffers

    # ------------------------------------------------------------------ after tracing
    def graph_passes(self, gm: torch.fx.GraphModule, plan, traced) -> None:
        """Placement-specific passes over the expanded graph (more than one rank)."""

    def budget(self, plan, slots, groups) -> dict[str, int]:
        """The most collectives of each kind the step may have for its gradients; a graph with
        more has a parameter used as a DTensor somewhere (``pipeline._check_collectives``)."""
        return {}

    # ------------------------------------------------------------------ job start (world > 1)
    # The live state takes the form of the graph's leaves: with DTensor leaves, parameters and
    # optimizer state become DTensors over padded local storage (``sharding.py``).
    def prepare(self, model: torch.nn.Module, optim: torch.optim.Optimizer, plan, mesh) -> None:
        """Turn the live parameters and optimizer state into this placement's form, in place,
        once per model (after rank 0's values were broadcast)."""
        if self.dtensor_leaves(plan):
            shard_model_and_optimizer(model, optim, plan, mesh)  # as fully_shard / parallelize_module do

    def state_zeros(self, param, shape, dtype, device) -> torch.Tensor:
        """Missing optimizer state for ``param``, created in the parameter's form (plain zeros
        for a plain parameter)."""
        return sharded_zeros(param, shape, dtype, device)

    def rehome_state(self, optim: torch.optim.Optimizer) -> None:
        """Bring optimizer state replaced since the last step (``load_state_dict``) back into
        this placement's form (nothing to do for plain parameters)."""
        ensure_sharded_state(optim)


def _tp_local(shape, plan, tp_dim) -> tuple[int, ...]:
    shape = tuple(shape)
    if tp_dim is None:
        return shape
    return shape[:tp_dim] + (shape[tp_dim] // plan.tp,) + shape[tp_dim + 1:]


def _whole_compute(leaf, layout):
    """A DTensor leaf whole over the data-parallel dimensions (TP-split or not): its gradient,
    exact on every TP rank, is averaged over the data-parallel dimensions only (one all_reduce
    over each; none for TP alone)."""
    if not leaf.requires_grad:
        return leaf.to_local()
    if not layout.dp_mesh_dims:
        return leaf.to_local(grad_placements=leaf.placements)
    from torch.distributed.tensor import DTensor, Partial

    grads = [Partial("avg")] * len(layout.dp_mesh_dims) + list(leaf.placements[len(layout.dp_mesh_dims):])
    dt = DTensor.from_local(leaf.to_local(), leaf.device_mesh, leaf.placements, run_check=False)
    return dt.to_local(grad_placements=grads)


class Replicate(Placement):
    name = "replicate"
    summary = "DDP: parameters and optimizer state Replicate, batch Shard(0), gradients averaged"

    def check(self, plan) -> None:
        if len(plan.mesh_shape) > 1:
            tp = (" With a tp_plan, placement 'replicate' runs TP alone on a 1-D mesh; for data parallel "
                  "x TP use placement 'shard' with mesh_shape=(dp, tp).") if plan.tp_plan else ""
            raise SpmdAotError(
                f"mesh shape {plan.mesh_shape} with placement 'replicate' is not supported; 2-D meshes "
                f"(replicas, shards) are for placement 'shard' (HSDP).{tp}"
            )

    def check_override(self, pattern: str, name: str) -> None:
        if name != self.name:
            raise SpmdAotError(
                f"param_placements[{pattern!r}] asks for {name!r} under placement 'replicate'; use "
                f"placement={name!r} and mark the parameters to keep whole as 'replicate'"
            )

    def layout(self, plan, shape, tp_dim=None) -> TensorLayout:
        return TensorLayout(self.name, shape, _tp_local(shape, plan, tp_dim), len(plan.mesh_shape),
                            tp=plan.tp, tp_dim=tp_dim)

    def compute(self, expander, leaf, layout):
        """Under DDP the leaf is the plain local tensor: one ``all_reduce(avg)`` per gradient
        (over every mesh dimension), which the bucket pass packs into buckets. Under TP alone
        the leaf is a DTensor over the TP dimension and its gradient needs no collective."""
        if expander.dtensor_leaves:
            return _whole_compute(leaf, layout)
        if not leaf.requires_grad:
            return leaf
        from torch.distributed.tensor import DTensor, Partial
        from torch.distributed.tensor import Replicate as ReplicateDT

        ndim = expander.mesh.ndim
        dt = DTensor.from_local(leaf, expander.mesh, [ReplicateDT()] * ndim, run_check=False)
        return dt.to_local(grad_placements=[Partial("avg")] * ndim)

    def traced_buffers(self, plan, buffers, mesh):
        """DDP's ``broadcast_buffers=True``: rank 0's buffers are everyone's before each step.
        TP alone has no data-parallel dimension: TP ranks see one batch and keep their own."""
        from torch.distributed._functional_collectives import broadcast

        if plan.tp:
            return buffers
        out = []
        for buffer in buffers:
            buffer.copy_(broadcast(buffer, 0, mesh.get_group(0)))
            out.append(buffer)
        return out

    def graph_passes(self, gm, plan, traced) -> None:
        if not plan.tp:  # TP alone averages no gradient
            bucket_gradient_all_reduces(gm, plan.bucket_cap_mb, plan.first_bucket_cap_mb,
                                        traced.gradient_collectives)

    def budget(self, plan, slots, groups) -> dict[str, int]:
        """One all_reduce per gradient (buckets make fewer). Under TP the optimizer and
        ``clip_grad_norm_`` run on DTensors, whose norms reduce over TP: no all_reduce bound."""
        if plan.tp:
            return {}
        return {"all_reduce": sum(1 for s in slots if s.kind == "param" and s.requires_grad)}


class Shard(Placement):
    name = "shard"
    summary = ("FSDP/ZeRO-3: parameters and optimizer state Shard(0) (HSDP on a 2-D mesh: Replicate "
               "on dim 0, Shard(0) on dim 1), all-gather for compute, reduce-scatter for gradients")
    cli_fields = ("mesh_shape", "param_placements", "shard_groups", "reshard_after_forward")

    def dtensor_leaves(self, plan) -> bool:
        return True

    def check(self, plan) -> None:
        if len(plan.mesh_shape) > 2:
            raise SpmdAotError(
                f"mesh shape {plan.mesh_shape} with placement 'shard' is not supported; 2-D meshes "
                "(replicas, shards) are for placement 'shard' (HSDP, or FSDP x TP with a tp_plan)"
            )
        if plan.tp_plan and plan.world_size > 1 and len(plan.mesh_shape) != 2:
            raise SpmdAotError(
                f"placement 'shard' with a tp_plan needs a mesh dimension for each: mesh_shape=(dp, tp) "
                f"(FSDP over dp, TP over tp), got {plan.mesh_shape}; TP alone is placement 'replicate'"
            )

    def layout(self, plan, shape, tp_dim=None) -> TensorLayout:
        """Dim 0 of the TP-local tensor split over the last data-parallel dimension, padded."""
        local = _tp_local(shape, plan, tp_dim)
        shards = plan.mesh_shape[-2 if plan.tp else -1]
        chunk = math.ceil(local[0] / shards)
        return TensorLayout(self.name, shape, (chunk,) + local[1:], len(plan.mesh_shape), shards,
                            tp=plan.tp, tp_dim=tp_dim)

    def compute(self, expander, leaf, layout):
        """Only for parameters kept whole (a sharded one computes through its group,
        ``groups.py``): a Replicate DTensor leaf, one all_reduce over every rank when its
        Partial gradient returns to the leaf (on a 2-D mesh, a 1-D view of the world: one
        collective, not two; under FSDP x TP, over the data-parallel dimension only)."""
        if layout.sharded:
            raise AssertionError("a sharded parameter's compute tensor comes from its group (groups.py)")
        if layout.tp:
            return _whole_compute(leaf, layout)
        if not leaf.requires_grad:
            return leaf.to_local()
        from torch.distributed.tensor import DTensor, Partial
        from torch.distributed.tensor import Replicate as ReplicateDT

        dt = DTensor.from_local(leaf.to_local(), expander.world_mesh, [ReplicateDT()], run_check=False)
        return dt.to_local(grad_placements=[Partial("avg")])

    def budget(self, plan, slots, groups) -> dict[str, int]:
        """One all_gather per group (two when it is gathered again in backward), one reduce_scatter."""
        return {"all_gather_into_tensor": sum(2 if g.reshard else 1 for g in groups),
                "reduce_scatter_tensor": len(groups)}

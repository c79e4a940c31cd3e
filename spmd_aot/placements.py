"""Placements: how a step spreads parameters, gradients, optimizer state and buffers over the
data-parallel dimensions of the device mesh.

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
    # Graph leaves (what the optimizer and ``model.parameters()`` see in the step) are DTensors.
    dtensor_leaves: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        PLACEMENTS[cls.name] = cls()

    # ------------------------------------------------------------------ the plan
    def check(self, plan) -> None:
        """Raise ``SpmdAotError`` if this placement cannot serve ``plan`` (its mesh, overrides)."""

    def check_override(self, pattern: str, name: str) -> None:
        """Raise ``SpmdAotError`` if a parameter may not take placement ``name`` under this one."""

    # ------------------------------------------------------------------ layout
    def layout(self, plan, shape: tuple[int, ...]) -> TensorLayout:
        """The layout of a parameter (and of optimizer state shaped like it) that has this
        placement."""
        raise NotImplementedError

    # ------------------------------------------------------------------ trace
    def compute(self, expander, leaf: torch.Tensor, layout: TensorLayout) -> torch.Tensor:
        """The tensor a module computes with, whose backward performs the gradient collective."""
        raise NotImplementedError

    def traced_buffers(self, buffers: list[torch.Tensor], mesh) -> list[torch.Tensor]:
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
    def prepare(self, model: torch.nn.Module, optim: torch.optim.Optimizer, plan, mesh) -> None:
        """Turn the live parameters and optimizer state into this placement's form, in place,
        once per model (after rank 0's values were broadcast)."""

    def state_zeros(self, param, shape, dtype, device) -> torch.Tensor:
        """Missing optimizer state for ``param``, created in the parameter's form."""
        return torch.zeros(shape, dtype=dtype, device=device)

    def rehome_state(self, optim: torch.optim.Optimizer) -> None:
        """Bring optimizer state replaced since the last step (``load_state_dict``) back into
        this placement's form."""


class Replicate(Placement):
    name = "replicate"
    summary = "DDP: parameters and optimizer state Replicate, batch Shard(0), gradients averaged"

    def check(self, plan) -> None:
        if len(plan.mesh_shape) > 1:
            raise SpmdAotError(
                f"mesh shape {plan.mesh_shape} with placement 'replicate' is not supported; 2-D meshes "
                "(replicas, shards) are for placement 'shard' (HSDP)"
            )

    def check_override(self, pattern: str, name: str) -> None:
        if name != self.name:
            raise SpmdAotError(
                f"param_placements[{pattern!r}] asks for {name!r} under placement 'replicate'; use "
                f"placement={name!r} and mark the parameters to keep whole as 'replicate'"
            )

    def layout(self, plan, shape) -> TensorLayout:
        return TensorLayout(self.name, shape, shape, len(plan.mesh_shape))

    def compute(self, expander, leaf, layout):
        """Under DDP the leaf is the plain local tensor: one ``all_reduce(avg)`` per gradient
        (over every mesh dimension), which the bucket pass packs into buckets."""
        if not leaf.requires_grad:
            return leaf
        from torch.distributed.tensor import DTensor, Partial
        from torch.distributed.tensor import Replicate as ReplicateDT

        ndim = expander.mesh.ndim
        dt = DTensor.from_local(leaf, expander.mesh, [ReplicateDT()] * ndim, run_check=False)
        return dt.to_local(grad_placements=[Partial("avg")] * ndim)

    def traced_buffers(self, buffers, mesh):
        """DDP's ``broadcast_buffers=True``: rank 0's buffers are everyone's before each step."""
        from torch.distributed._functional_collectives import broadcast

        out = []
        for buffer in buffers:
            buffer.copy_(broadcast(buffer, 0, mesh.get_group(0)))
            out.append(buffer)
        return out

    def graph_passes(self, gm, plan, traced) -> None:
        bucket_gradient_all_reduces(gm, plan.bucket_cap_mb, plan.first_bucket_cap_mb, traced.gradient_collectives)

    def budget(self, plan, slots, groups) -> dict[str, int]:
        return {"all_reduce": sum(1 for s in slots if s.kind == "param" and s.requires_grad)}


class Shard(Placement):
    name = "shard"
    summary = ("FSDP/ZeRO-3: parameters and optimizer state Shard(0) (HSDP on a 2-D mesh: Replicate "
               "on dim 0, Shard(0) on dim 1), all-gather for compute, reduce-scatter for gradients")
    cli_fields = ("mesh_shape", "param_placements", "shard_groups", "reshard_after_forward")
    dtensor_leaves = True

    def check(self, plan) -> None:
        if len(plan.mesh_shape) > 2:
            raise SpmdAotError(
                f"mesh shape {plan.mesh_shape} with placement 'shard' is not supported; 2-D meshes "
                "(replicas, shards) are for placement 'shard' (HSDP)"
            )

    def layout(self, plan, shape) -> TensorLayout:
        shards = plan.mesh_shape[-1]
        chunk = math.ceil(shape[0] / shards)
        return TensorLayout(self.name, shape, (chunk,) + tuple(shape[1:]), len(plan.mesh_shape), shards)

    def compute(self, expander, leaf, layout):
        """Only for parameters kept whole (a sharded one computes through its group,
        ``groups.py``): a Replicate DTensor leaf, one all_reduce over every rank when its
        Partial gradient returns to the leaf (on a 2-D mesh, a 1-D view of the world: one
        collective, not two)."""
        if layout.sharded:
            raise AssertionError("a sharded parameter's compute tensor comes from its group (groups.py)")
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

    def prepare(self, model, optim, plan, mesh) -> None:
        shard_model_and_optimizer(model, optim, plan, mesh)  # as fully_shard does

    def state_zeros(self, param, shape, dtype, device):
        return sharded_zeros(param, shape, dtype, device)

    def rehome_state(self, optim) -> None:
        ensure_sharded_state(optim)

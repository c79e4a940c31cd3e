"""Expansion into the per-rank SPMD program, with DTensor at the parameter boundary.

The model computes on plain local tensors. Each parameter enters the step as a *leaf* (what
the optimizer, ``model.parameters()`` and gradient clipping see) and is turned into a
*compute* tensor when a module reads it; the plan's placement object (``placements.py``) says
how:

- ``replicate`` (DDP): the leaf is the plain local tensor; compute is
  ``DTensor.from_local(leaf, [Replicate()]).to_local(grad_placements=[Partial("avg")])``, so
  autograd emits exactly one ``all_reduce(avg)`` per gradient and the optimizer runs on
  plain tensors.
- ``shard`` (FSDP2/ZeRO-3; HSDP on a 2-D mesh): the leaf is a ``Shard(0)`` DTensor over a
  *padded* local shard (dim 0 rounded up to a multiple of the shard count, as FSDP2 pads),
  so every rank runs the same graph even when dim 0 does not divide; its compute tensor comes
  from its communication group (``groups.py``: one all_gather per group, gradients
  reduce-scattered per group). The optimizer
  and ``clip_grad_norm_`` run on DTensors, which makes the norm global with one all_reduce.
  Parameters kept whole under ``shard`` are Replicate DTensors whose gradient is averaged
  with one all_reduce.

A "DTensor everywhere" trace re-reduces a Partial gradient at every use and fails on ordinary
model code (masks from ``torch.ones``, CPU attention kernels).
"""

from __future__ import annotations

import torch

from .layout import TensorLayout
from .mesh import device_mesh
from .plan import Plan

__all__ = ["Expander"]


class Expander:
    """Builds leaves, compute tensors and optimizer-state views inside the traced step."""

    def __init__(self, plan: Plan, mesh):
        self.plan = plan
        self.mesh = mesh
        self.dtensor_leaves = plan.world_size > 1 and plan.strategy.dtensor_leaves(plan)
        self.world_mesh = mesh
        if mesh is not None and mesh.ndim > 1:  # made before tracing: meshes cannot be traced
            self.world_mesh = device_mesh(Plan(plan.world_size, "replicate", plan.device_type))

    def wrap(self, local: torch.Tensor, layout: TensorLayout) -> torch.Tensor:
        """A graph input (local storage) as the tensor the optimizer sees."""
        if not self.dtensor_leaves:
            return local
        from torch.distributed.tensor import DTensor

        shape = layout.dtensor_shape
        # computed, not read off a meta tensor: a factory call here would be traced (a dead node)
        stride = torch._prims_common.make_contiguous_strides_for(shape)
        return DTensor.from_local(local, self.mesh, layout.dtensor_placements(), run_check=False,
                                  shape=torch.Size(shape), stride=stride)

    def leaf(self, local: torch.Tensor, layout: TensorLayout, requires_grad: bool) -> torch.Tensor:
        return self.wrap(local.detach(), layout).requires_grad_(requires_grad)

    def compute(self, leaf: torch.Tensor, layout: TensorLayout) -> torch.Tensor:
        """The tensor a module computes with, whose backward performs the gradient collective."""
        if self.plan.world_size == 1 or self.mesh is None:
            return leaf
        return self.plan.strategy.compute(self, leaf, layout)

"""Expansion into the per-rank SPMD program, with DTensor at the parameter boundary.

The model computes on plain local tensors. Each parameter enters the step as a *leaf* (what
the optimizer, ``model.parameters()`` and gradient clipping see) and is turned into a
*compute* tensor when a module reads it:

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
model code (masks from ``torch.ones``, CPU attention kernels); see shared/DESIGN.md.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from .mesh import device_mesh
from .plan import Plan

__all__ = ["TensorLayout", "layout_for", "Expander"]


@dataclasses.dataclass(frozen=True)
class TensorLayout:
    """How one parameter (or optimizer state shaped like it) is laid out over the mesh."""

    placement: str  # "replicate" | "shard"
    global_shape: tuple[int, ...]
    local_shape: tuple[int, ...]  # the graph input: padded shard, or the whole tensor
    mesh_ndim: int
    shards: int = 1

    @property
    def placements(self) -> list[str]:
        """DTensor placements per mesh dimension, as text (for the layout and schema map)."""
        if self.placement == "shard":
            return ["Replicate()"] * (self.mesh_ndim - 1) + ["Shard(0)"]
        return ["Replicate()"] * self.mesh_ndim

    def shard_rows(self) -> list[int]:
        """Real (unpadded) dim-0 rows each shard holds; the rest of its storage is padding."""
        if self.placement != "shard":
            return []
        chunk, n = self.local_shape[0], self.global_shape[0]
        return [max(0, min(chunk, n - i * chunk)) for i in range(self.shards)]


def layout_for(plan: Plan, fqn: str, shape) -> TensorLayout:
    shape = tuple(shape)
    placement = plan.placement_for(fqn, shape) if plan.world_size > 1 else "replicate"
    if placement == "shard":
        chunk = math.ceil(shape[0] / plan.shards)
        return TensorLayout("shard", shape, (chunk,) + shape[1:], len(plan.mesh_shape), plan.shards)
    return TensorLayout("replicate", shape, shape, len(plan.mesh_shape))


class Expander:
    """Builds leaves, compute tensors and optimizer-state views inside the traced step."""

    def __init__(self, plan: Plan, mesh):
        self.plan = plan
        self.mesh = mesh
        self.dtensor_leaves = plan.world_size > 1 and plan.placement == "shard"
        self.world_mesh = mesh
        if mesh is not None and mesh.ndim > 1:  # made before tracing: meshes cannot be traced
            self.world_mesh = device_mesh(Plan(plan.world_size, "replicate", plan.device_type))

    def _placements(self, layout: TensorLayout):
        from torch.distributed.tensor import Replicate, Shard

        return [Shard(0) if p == "Shard(0)" else Replicate() for p in layout.placements]

    def wrap(self, local: torch.Tensor, layout: TensorLayout) -> torch.Tensor:
        """A graph input (local storage) as the tensor the optimizer sees."""
        if not self.dtensor_leaves:
            return local
        from torch.distributed.tensor import DTensor

        shape = (layout.local_shape[0] * layout.shards,) + tuple(layout.local_shape[1:]) \
            if layout.placement == "shard" else tuple(layout.global_shape)
        # computed, not read off a meta tensor: a factory call here would be traced (a dead node)
        stride = torch._prims_common.make_contiguous_strides_for(shape)
        return DTensor.from_local(local, self.mesh, self._placements(layout), run_check=False,
                                  shape=torch.Size(shape), stride=stride)

    def leaf(self, local: torch.Tensor, layout: TensorLayout, requires_grad: bool) -> torch.Tensor:
        return self.wrap(local.detach(), layout).requires_grad_(requires_grad)

    def compute(self, leaf: torch.Tensor, layout: TensorLayout) -> torch.Tensor:
        """The tensor a module computes with, whose backward performs the gradient collective."""
        if self.plan.world_size == 1 or self.mesh is None:
            return leaf
        from torch.distributed.tensor import DTensor, Partial, Replicate

        ndim = self.mesh.ndim
        avg = [Partial("avg")] * ndim if leaf.requires_grad else None
        if not self.dtensor_leaves:
            if not leaf.requires_grad:
                return leaf
            dt = DTensor.from_local(leaf, self.mesh, [Replicate()] * ndim, run_check=False)
            return dt.to_local(grad_placements=avg)
        if layout.placement == "shard":
            raise AssertionError("a sharded parameter's compute tensor comes from its group (groups.py)")
        if not leaf.requires_grad:
            return leaf.to_local()
        # Replicate DTensor leaf: one all_reduce over every rank when its Partial gradient
        # returns to the leaf (on a 2-D mesh, a 1-D view of the world: one collective, not two).
        dt = DTensor.from_local(leaf.to_local(), self.world_mesh, [Replicate()], run_check=False)
        return dt.to_local(grad_placements=[Partial("avg")])

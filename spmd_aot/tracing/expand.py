"""Expansion into the per-rank SPMD program, with DTensor at the parameter boundary.

The model computes on plain local tensors. Each parameter enters the step as a *leaf* (what
the optimizer, ``model.parameters()`` and gradient clipping see) and is turned into a
*compute* tensor when a module reads it:

- DDP alone (``replicate`` over ``dp_replicate`` only): the leaf is the plain local tensor;
  compute is ``DTensor.from_local(leaf, [Replicate()]).to_local(grad_placements=[Partial("avg")])``,
  so autograd emits exactly one ``all_reduce(avg)`` per gradient and the optimizer runs on
  plain tensors.
- Any other mesh (a ``dp_shard`` or ``tp`` dimension): leaves are DTensors laid out as
  ``Plan.layout_for`` says. A sharded leaf (``shard``: a ``Shard(0)`` DTensor over a *padded*
  local shard, dim 0 rounded up to a multiple of the shard count as FSDP2 pads, so every rank
  runs the same graph) gets its compute tensor from its communication group (``groups.py``:
  one all_gather per group, gradients reduce-scattered per group). A leaf whole over the
  data-parallel dimensions computes on its local tensor (TP-local when TP splits it) whose
  gradient is averaged over those dimensions (one all_reduce over the world when the mesh has
  no other dimension; one per data-parallel dimension otherwise). The optimizer and
  ``clip_grad_norm_`` run on DTensors, which makes the norm global.

A "DTensor everywhere" trace re-reduces a Partial gradient at every use and fails on ordinary
model code (masks from ``torch.ones``, CPU attention kernels).
"""

from __future__ import annotations

import torch

from ..parallel.layout import TensorLayout
from ..parallel.mesh import flat_mesh
from ..parallel.plan import Plan

__all__ = ["Expander"]


class Expander:
    """Builds leaves, compute tensors and optimizer-state views inside the traced step."""

    def __init__(self, plan: Plan, mesh):
        self.plan = plan
        self.mesh = mesh
        self.dtensor_leaves = plan.dtensor_leaves
        # made before tracing (meshes cannot be traced); the mesh itself when it is 1-D
        self.world_mesh = flat_mesh(plan) if mesh is not None else None
        self.deferred = False  # gradient accumulation: no average in backward (accumulation.py)

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
        """The tensor a module computes with for a leaf whole over the data-parallel dimensions
        (a sharded one's comes from its group), whose backward averages its gradient over them.
        Under a mixed-precision policy it is cast to ``param_dtype`` after the average's boundary,
        which itself sees ``reduce_dtype`` (so the gradient is averaged in it, then cast back)."""
        policy = self.plan.mixed_precision
        if policy is None:
            return self._averaged(leaf, layout, lambda t: t)
        reduced = self._averaged(leaf, layout, lambda t: t.to(policy.gradient_dtype(t.dtype)))
        return reduced.to(policy.compute_dtype(leaf.dtype))

    def _averaged(self, leaf: torch.Tensor, layout: TensorLayout, to_reduce) -> torch.Tensor:
        """``leaf``'s local tensor, passed through ``to_reduce``, with its gradient averaged over
        the data-parallel dimensions."""
        if self.plan.world_size == 1 or self.mesh is None:
            return to_reduce(leaf)
        if layout.sharded:
            raise AssertionError("a sharded parameter's compute tensor comes from its group (groups.py)")
        from torch.distributed.tensor import DTensor, Partial, Replicate

        # traced once, when used
        local = (lambda: to_reduce(leaf.to_local())) if self.dtensor_leaves else (lambda: to_reduce(leaf))
        if not leaf.requires_grad:
            return local()
        dp_dims = len(layout.dp_mesh_dims)
        if self.deferred and dp_dims == self.mesh.ndim:  # averaged once, at the sync point
            return local()
        if self.deferred and dp_dims:
            from ..errors import UnsupportedError

            raise UnsupportedError(
                "gradient accumulation (several backward() before one optimizer step) is not "
                "supported with tensor or expert parallel yet (parameters whole over the data-parallel ranks); call "
                "optim.step() after each backward()"
            )
        if dp_dims == self.mesh.ndim:  # data parallel alone: one all_reduce over the world
            dt = DTensor.from_local(local(), self.world_mesh, [Replicate()], run_check=False)
            return dt.to_local(grad_placements=[Partial("avg")])
        if not dp_dims:  # no data-parallel dimension: the gradient is the leaf's as it is
            return to_reduce(leaf.to_local(grad_placements=leaf.placements))
        # averaged over each data-parallel dimension; as the leaf is over the others (TP, and
        # ``ep`` for an expert's parameter: its ranks hold different experts)
        averaged = set(layout.dp_mesh_dims)
        grads = [Partial("avg") if d in averaged else p for d, p in enumerate(leaf.placements)]
        dt = DTensor.from_local(local(), leaf.device_mesh, leaf.placements, run_check=False)
        return dt.to_local(grad_placements=grads)

"""Data parallelism: how a step averages gradients and treats buffers over the data-parallel
mesh dimensions (``dp_replicate``, ``dp_shard``), whatever other axes (TP) split.

One class per placement owns its mechanics: the buffers the step sees, its graph passes and
its collective budget. Its text form, the mesh dimensions it takes and the layout of its
parameters are the plan value's (``parallel/dims.py``, ``plan.py``); a kept-whole leaf's
gradient average is the expansion's (``expand.py``); sharded parameters communicate through
their groups (``groups.py``). ``DataParallelAxis`` serves the plan's placement among the axes.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from .axis_interface import Axis
from .dims import DATA_PARALLEL_ROLES, PLACEMENT_NAMES
from ..passes import bucket_gradient_all_reduces

__all__ = ["DataParallelPlacement", "PLACEMENTS", "ReplicateParams", "ShardParams", "AXIS"]

PLACEMENTS: dict[str, DataParallelPlacement] = {}  # name -> placement object, in definition order


class DataParallelPlacement:
    """The interface; every method takes the ``Plan`` it serves (a placement holds no state)."""

    name: ClassVar[str]
    summary: ClassVar[str]

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        PLACEMENTS[cls.name] = cls()

    def traced_buffers(self, plan, buffers: list[torch.Tensor], mesh) -> list[torch.Tensor]:
        """Buffers as the step sees them (on a mesh of more than one rank)."""
        return buffers

    def graph_passes(self, gm: torch.fx.GraphModule, plan, traced) -> None:
        """Placement-specific passes over the expanded graph (more than one rank)."""

    def budget(self, plan, slots, groups, forward_only: bool) -> dict[str, int | None]:
        """The most collectives of each kind the step may have for its gradients; a graph with
        more has a parameter used as a DTensor somewhere (``pipeline._check_collectives``)."""
        return {}


class ReplicateParams(DataParallelPlacement):
    name = "replicate"
    summary = "DDP: parameters and optimizer state Replicate, batch Shard(0), gradients averaged"

    def traced_buffers(self, plan, buffers, mesh):
        """DDP's ``broadcast_buffers=True``: rank 0's buffers are everyone's (over the replicas)
        before each step. Without a ``dp_replicate`` dimension (TP alone) ranks see one batch
        and keep their own."""
        from torch.distributed._functional_collectives import broadcast

        dim = plan.mesh_dim("dp_replicate")
        if dim is None:
            return buffers
        out = []
        for buffer in buffers:
            buffer.copy_(broadcast(buffer, 0, mesh.get_group(dim)))
            out.append(buffer)
        return out

    def graph_passes(self, gm, plan, traced) -> None:
        """Gradient all_reduces packed into DDP's buckets. With DTensor leaves (another axis, tensor
        parallel, splits them) only the all_reduces that produce a gradient: the graph's others
        (tensor parallel's activations, the optimizer's norms) are not gradients'."""
        bucket_gradient_all_reduces(gm, plan.bucket_cap_mb, plan.first_bucket_cap_mb,
                                    traced.gradient_collectives, only_named=bool(plan.dtensor_leaves))

    def budget(self, plan, slots, groups, forward_only):
        """One all_reduce per gradient (buckets make fewer); none forward-only. With DTensor
        leaves the optimizer and ``clip_grad_norm_`` reduce norms too: no all_reduce bound."""
        if forward_only:
            return {"all_reduce": 0}
        if plan.dtensor_leaves:
            return {"all_reduce": None}
        return {"all_reduce": sum(1 for s in slots if s.kind == "param" and s.requires_grad)}


class ShardParams(DataParallelPlacement):
    name = "shard"
    summary = ("FSDP/ZeRO-3: parameters and optimizer state Shard(0) (HSDP on a 2-D mesh: Replicate "
               "on dim 0, Shard(0) on dim 1), all-gather for compute, reduce-scatter for gradients")

    def budget(self, plan, slots, groups, forward_only):
        """One all_gather per group (two when it is gathered again in backward), one
        reduce_scatter; forward-only: one all_gather per group, nothing reduced. Parameters kept
        whole average with all_reduces, and DTensor norms reduce: no all_reduce bound."""
        if forward_only:
            return {"all_gather_into_tensor": len(groups), "reduce_scatter_tensor": 0, "all_reduce": 0}
        return {"all_gather_into_tensor": sum(2 if g.reshard else 1 for g in groups),
                "reduce_scatter_tensor": len(groups), "all_reduce": None}


assert tuple(PLACEMENTS) == PLACEMENT_NAMES, "parallel/dims.py names the placements defined here"


class DataParallelAxis(Axis):
    """The data-parallel mesh dimensions, served by the plan's placement. Always active: with no
    data-parallel dimension (TP alone) the placement has nothing to average."""

    name = "data_parallel"
    roles = DATA_PARALLEL_ROLES

    def active(self, plan) -> bool:
        return True

    def traced_buffers(self, plan, buffers, mesh):
        return PLACEMENTS[plan.placement].traced_buffers(plan, buffers, mesh)

    def graph_passes(self, gm, plan, traced) -> None:
        PLACEMENTS[plan.placement].graph_passes(gm, plan, traced)

    def budget(self, plan, slots, groups, forward_only):
        return PLACEMENTS[plan.placement].budget(plan, slots, groups, forward_only)


AXIS = DataParallelAxis()

"""Expansion into the per-rank SPMD program, with DTensor at the parameter boundary only.

The model computes on plain local tensors; each parameter enters as a Replicate DTensor that
is turned back into a local tensor whose gradient is declared ``Partial("avg")``. Autograd
then emits exactly one ``all_reduce(avg)`` per gradient, and everything else (masks built with
``torch.ones``, CPU attention kernels, the optimizer) runs on ordinary tensors. This is the
SimpleFSDP style; a "DTensor everywhere" trace re-reduces a Partial gradient at every use and
fails on ordinary model code (see shared/DESIGN.md).
"""

from __future__ import annotations

from typing import Callable

import torch

from .plan import Plan

__all__ = ["parameter_boundary"]


def parameter_boundary(plan: Plan, mesh) -> Callable[[torch.Tensor], torch.Tensor]:
    """Return ``f(local_param) -> tensor the model computes with`` for this plan."""
    if plan.world_size == 1 or mesh is None:
        return lambda p: p  # one rank: no communication at all

    from torch.distributed.tensor import DTensor, Partial, Replicate

    if plan.placement == "replicate":

        def replicate(p: torch.Tensor) -> torch.Tensor:
            if not p.requires_grad:
                return p
            dt = DTensor.from_local(p, mesh, [Replicate()], run_check=False)
            return dt.to_local(grad_placements=[Partial("avg")])

        return replicate
    raise AssertionError(plan.placement)  # Plan validates placements

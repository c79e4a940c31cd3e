"""The forward-boundary casts of a mixed-precision policy, traced into the step.

FSDP2 casts the floating-point inputs of every ``fully_shard`` module's forward to
``param_dtype`` (``cast_forward_inputs``) and its floating-point outputs to ``output_dtype``;
DDP's ``_MixedPrecision`` casts the root module's inputs. So the casts sit at the root module
and, under ``shard`` with the default groups (one per block, as ``fully_shard`` per block), at
each block. Integer inputs (token ids) and non-tensors pass unchanged. The parameter and
gradient casts are where parameters become compute tensors (``expand.py``, ``groups.py``).
"""

from __future__ import annotations

import contextlib

import torch
import torch.utils._pytree as pytree

from ..parallel.groups import block_prefixes
from ..parallel.plan import Plan

__all__ = ["forward_casts", "cast_modules"]


def _cast_floating(dtype: torch.dtype | None, tree):
    """``tree`` with every floating-point tensor of another dtype cast to ``dtype``."""
    if dtype is None:
        return tree

    def cast(x):
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype:
            return x.to(dtype)
        return x

    return pytree.tree_map(cast, tree)


def cast_modules(model: torch.nn.Module, plan: Plan) -> list[torch.nn.Module]:
    """The modules whose forward boundary casts: the root and, under ``shard`` with one group per
    block (FSDP2's ``fully_shard`` per block), each block; blocks first, the root last."""
    modules = []
    if plan.placement == "shard" and plan.world_size > 1 and not plan.shard_groups:
        modules = [model.get_submodule(prefix) for prefix in block_prefixes(model)]
    return modules + [model]


@contextlib.contextmanager
def forward_casts(model: torch.nn.Module, plan: Plan):
    """While tracing: the policy's input and output casts on ``cast_modules``' forwards."""
    policy = plan.mixed_precision
    if policy is None:
        yield
        return
    inputs = policy.param_dtype if policy.cast_forward_inputs else None

    def before(module, args, kwargs):
        return _cast_floating(inputs, args), _cast_floating(inputs, kwargs)

    def after(module, args, output):
        return _cast_floating(policy.output_dtype, output)

    handles = []
    try:
        for module in cast_modules(model, plan):
            handles.append(module.register_forward_pre_hook(before, with_kwargs=True))
            handles.append(module.register_forward_hook(after))
        yield
    finally:
        for handle in handles:
            handle.remove()

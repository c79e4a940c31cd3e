"""The cache key of a pipeline-parallel step: the whole-step key's ingredients that apply, plus the
loss function, the pipeline (split points and the schedule's actions, as data) and the mesh.

Every rank computes it from the whole model (the key does not depend on which stage a rank
runs), so the ranks agree on one key and rank 0 decides hit or miss for all of them.
"""

from __future__ import annotations

import hashlib
import logging
import types

import torch

from . import key as whole_step
from .fingerprint import Fingerprinter
from ..state import dtype_name

__all__ = ["pipeline_key"]

log = logging.getLogger(__name__)

PIPELINE_FORMAT = 1


def pipeline_key(model: torch.nn.Module, loss_fn, batch, pipeline, plan: dict) -> whole_step.CacheKey:
    """``batch``: the step's whole batch on one data-parallel rank (before micro-batching)."""
    params = _named_unique(model.named_parameters(remove_duplicate=False))
    buffers = _named_unique(model.named_buffers(remove_duplicate=False))
    state = types.SimpleNamespace(model=model, params=params, buffers=buffers, forward_only=False)
    tensors: dict[str, torch.Tensor] = {}
    inputs = frozenset(id(t) for _, t in params + buffers)
    common = dict(state=state, tensors=tensors, inputs=inputs)
    values = {
        "format_version": [whole_step.format_version(), PIPELINE_FORMAT],
        "torch_release": whole_step.torch_release(),
        "global_state": whole_step.global_state(**common),
        "spmd_aot_code": whole_step.spmd_aot_code(),
        "loss_code": Fingerprinter(tensors, inputs=inputs).of(loss_fn, "loss_fn"),
        "model_code": whole_step.model_code(**common),
        "module_structure": whole_step.module_structure(**common),
        "parameters": whole_step.parameters(state=state),
        "buffers": whole_step.buffers(state=state),
        "batch": [[list(t.shape), dtype_name(t.dtype)] if isinstance(t, torch.Tensor) else repr(type(t))
                  for t in (batch if isinstance(batch, (tuple, list)) else [batch])],
        "pipeline": pipeline.to_dict(),
        "parallel": plan,
    }
    digests = {name: whole_step._digest(value) for name, value in values.items()}
    for name, d in digests.items():
        log.debug("pipeline key ingredient %s = %s", name, d)
    key = hashlib.sha256("".join(f"{n}={d}\n" for n, d in digests.items()).encode()).hexdigest()
    return whole_step.CacheKey(key, digests, values, tensors)


def _named_unique(named) -> list[tuple[tuple[str, ...], torch.Tensor]]:
    by_id: dict[int, tuple[list[str], torch.Tensor]] = {}
    for name, t in named:
        by_id.setdefault(id(t), ([], t))[0].append(name)
    return [(tuple(names), t) for names, t in by_id.values()]

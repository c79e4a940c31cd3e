"""Gradient accumulation: several ``backward()`` calls before one optimizer step, reduced once.

A step that calls ``backward()`` on several micro-batches before ``optim.step()`` (HF
Trainer's ``gradient_accumulation_steps``, torchtitan) would reduce every micro-batch's
gradients if traced as it runs. Eager users avoid that with DDP's ``no_sync()`` or FSDP2's
``set_requires_gradient_sync(False)`` on all but the last micro-batch; here it is detected from
the step itself: the step is traced once recording its ``backward()`` and optimizer-step calls
(``Accumulation()``), and when a backward is followed by another backward before a step, it is
traced again with the reduction deferred (``Accumulation(sync_points)``):

- ``replicate``: a parameter's gradient accumulates locally (no collective in backward); after
  the last backward before a step (a *sync point*) a post-accumulate-grad hook all-reduces
  (avg) the accumulated gradient, in gradient order, so the buckets pass packs them as usual;
- ``shard``: a group's unsharded gradients accumulate in the group (as FSDP2 keeps unsharded
  gradients under ``set_requires_gradient_sync(False)``) and are reduce-scattered once, in the
  sync point's backward. Gathers are not deferred: a resharded group is gathered in every
  micro-batch's forward and backward, as FSDP2 with ``reshard_after_forward=True`` does; the
  root group stays gathered (one gather for the whole step).

So the stored graph has the reductions of one micro-batch whatever the number of micro-batches.
What it costs is memory: the local gradients live across micro-batches (``peak_bytes``).
"""

from __future__ import annotations

import contextlib
from unittest import mock

import torch

__all__ = ["Accumulation"]

_c10d = torch.ops._c10d_functional


class Accumulation:
    """The backward/step calls of one trace, and (``sync_points`` given) which backward calls
    reduce gradients: their index among the step's ``backward()`` calls."""

    def __init__(self, sync_points: frozenset[int] | None = None):
        self.sync = sync_points
        self.events: list[str] = []
        self.backwards = 0
        self.syncing = True  # the backward now running reduces its gradients

    @property
    def deferred(self) -> bool:
        return self.sync is not None

    @property
    def micro_batches(self) -> int:
        """The most backward calls before one step (1: no accumulation)."""
        most = run = 0
        for event in self.events:
            run = run + 1 if event == "backward" else 0
            most = max(most, run)
        return max(most, 1)

    def sync_points(self) -> frozenset[int] | None:
        """The backward calls not followed by another backward, or None when every backward is
        (no accumulation: the step is traced as it ran)."""
        indices = [i for i, e in enumerate(self.events) if e == "backward"]
        points = frozenset(n for n, i in enumerate(indices)
                           if i + 1 >= len(self.events) or self.events[i + 1] != "backward")
        return points if len(points) < len(indices) else None

    def note_step(self) -> None:
        self.events.append("step")

    @contextlib.contextmanager
    def recording(self):
        """Count ``backward()`` calls (``Tensor.backward`` goes through ``torch.autograd.backward``)."""
        original = torch.autograd.backward

        def backward(*args, **kwargs):
            index = self.backwards
            self.backwards += 1
            self.events.append("backward")
            self.syncing = self.sync is None or index in self.sync
            try:
                return original(*args, **kwargs)
            finally:
                self.syncing = True

        with mock.patch("torch.autograd.backward", backward):
            yield

    def reduce_at_sync(self, leaf: torch.Tensor, group_name: str, note) -> None:
        """``replicate``: all-reduce (avg) ``leaf``'s accumulated gradient after the sync
        point's backward accumulated into it; ``note(reduced)`` names the collective."""

        def hook(param):
            if not self.syncing or param.grad is None:
                return
            grad = param.grad
            local = grad.to_local() if hasattr(grad, "to_local") else grad
            reduced = _c10d.wait_tensor(_c10d.all_reduce(local, "avg", group_name))
            note(reduced)
            if hasattr(grad, "to_local"):
                from torch.distributed.tensor import DTensor

                reduced = DTensor.from_local(reduced, grad.device_mesh, grad.placements, run_check=False)
            param.grad = reduced

        leaf.register_post_accumulate_grad_hook(hook)

"""``spmd_aot.SPMD``: a module wrapper whose forward runs a stored distributed forward.

The counterpart of the seed's ``SPMD(module, schema, input_schemas)``: the wrapped module's
forward is compiled as a forward-only step (``module_forward``), expanded for the options'
placement (parameters replicated, sharded, or HSDP) and found, loaded and bound through the
same cache as ``spmd_aot.compile``; ``SPMD.job`` is the ``Job`` that builds it offline.

Inputs are local, as with DDP: each rank passes its own tensors and the module computes on
them, so a ``Shard(d)`` input is this rank's piece along ``d`` and the output is this rank's
output (a reduction over a sharded dimension is per rank). Input placements say how the
global example inputs of ``SPMD.job`` are split over the ranks to give those local inputs.

Forward only: no autograd, no training through the wrapper (compile the whole train step
with ``spmd_aot.compile`` for that). Calling it with autograd enabled on a module whose
parameters require gradients is an error, not a silently detached output.
"""

from __future__ import annotations

import dataclasses
from typing import Any
from collections.abc import Callable, Sequence

import torch
from torch import nn

from .errors import UnsupportedError
from .job import Job, input_placements as _input_placements
from .runtime.step import CompiledStep
from .options import ParallelOptions, RunOptions

__all__ = ["SPMD", "module_forward"]


def module_forward(module: nn.Module, inputs: tuple):
    """The forward-only step every ``SPMD`` wrapper compiles: the module on this rank's inputs."""
    return module(*inputs)


class SPMD(nn.Module):
    """Wrap ``module`` so that calling the wrapper runs its forward as a stored SPMD program.

    ``parallel``: a ``ParallelOptions`` (default: replicated parameters, as DDP).
    ``input_placements``: one ``Replicate()`` or ``Shard(dim)`` (``torch.distributed.tensor``)
    per positional input; default ``Shard(0)`` for every input (each rank passes its own batch).
    ``run``: a ``RunOptions`` (``cache_dir``, ``require_hit``, ``store``, ``module_override``,
    ...), or its fields as keywords; as for ``spmd_aot.compile`` (``docs/options.md``).
    ``schema`` is the earlier name of ``parallel``.

    ``wrapper(*inputs)`` returns the module's output on this rank, computed without autograd.
    The module's parameters and buffers are the wrapped module's own (under "shard" they become
    sharded DTensors at the first call, as after ``fully_shard``); ``wrapper.module`` is it,
    and its train/eval mode (part of the key) is what ``wrapper.eval()`` sets.
    """

    def __init__(self, module: nn.Module, parallel: ParallelOptions | None = None,
                 input_placements: Sequence[Any] | None = None, *, run: RunOptions | None = None,
                 schema: ParallelOptions | None = None, **options):
        super().__init__()
        if schema is not None:
            if parallel is not None:
                raise TypeError("SPMD takes parallel= or its earlier name schema=, not both")
            parallel = schema
        if parallel is not None and not isinstance(parallel, ParallelOptions):
            raise TypeError(f"SPMD parallel options must be a spmd_aot.ParallelOptions, got {type(parallel).__name__}")
        clash = sorted(set(options) - {f.name for f in dataclasses.fields(RunOptions)})
        if clash:
            raise TypeError(f"SPMD: pass {', '.join(clash)} in the ParallelOptions, not as options")
        self.module = module
        self.parallel = parallel if parallel is not None else ParallelOptions()
        self.input_placements = (_input_placements(input_placements, "SPMD input_placements")
                                 if input_placements is not None else None)
        self._step = CompiledStep(module_forward, parallel=self.parallel, run=run, **options)

    @property
    def cache_info(self):
        """The ``CacheInfo`` of the latest resolution (hit, key, digest, ...); None before the first call."""
        return self._step.cache_info

    def forward(self, *inputs):
        placements = self.input_placements
        if placements is not None and len(placements) != len(inputs):
            raise TypeError(f"SPMD was given {len(placements)} input placement(s) and called with "
                            f"{len(inputs)} input(s); pass one placement per positional input")
        for i, x in enumerate(inputs):
            dim = getattr(placements[i], "dim", None) if placements is not None else 0
            if dim is not None and isinstance(x, torch.Tensor) and not -x.dim() <= dim < x.dim():
                raise UnsupportedError(f"SPMD input {i} has {x.dim()} dimension(s) and is placed "
                                       f"Shard({dim}); pass this rank's piece along dim {dim}")
        if torch.is_grad_enabled() and any(p.requires_grad for p in self.module.parameters()):
            raise UnsupportedError(
                "spmd_aot.SPMD runs the module's forward only, without autograd: call it under "
                "torch.no_grad() or torch.inference_mode() (or freeze the parameters with "
                "requires_grad_(False)); to train, compile the whole train step with spmd_aot.compile")
        return self._step(self.module, tuple(inputs))

    @staticmethod
    def job(model: Callable[[], nn.Module], inputs: Callable[[], Any],
            input_placements: Sequence[Any] | None = None) -> Job:
        """The ``Job`` that builds what an ``SPMD`` wrapper with these input placements loads
        (``spmd-aot build`` / ``spmd_aot.build`` with the wrapper's ``ParallelOptions``).

        ``model``: zero-argument factory, returning the module in the mode it will run in
        (``MyModel().eval()``). ``inputs``: zero-argument factory returning the GLOBAL example
        inputs, a tuple (or one tensor): each ``Shard(d)`` input is split over the ranks on
        dim ``d`` (it must divide), each ``Replicate()`` one reaches every rank whole.
        """
        def global_inputs():
            made = inputs()
            return tuple(made) if isinstance(made, (tuple, list)) else (made,)

        # no placements: every input split on dim 0 (the default input placement, Shard(0))
        return Job(step=module_forward, model=model, optimizer=None, batch=global_inputs,
                   global_batch=input_placements is None, batch_placements=input_placements)

"""Tensor parallelism's collectives as autograd functions: what a TP style's forward calls, and
what each one becomes in backward (Megatron's ``f`` and ``g``, plus the sequence-parallel pair).

Why a module of their own: each is one collective in forward and its dual in backward, nothing
about plans or styles; ``tensor_parallel.py`` decides which one a module calls. Each takes the
tracing ``TensorParallel`` (``tp``), whose methods issue the labelled collective, so the stored
graph names the module and the direction of every TP collective.
"""

from __future__ import annotations

import torch

__all__ = ["CopyToTP", "ReduceFromTP", "GatherSeq", "ScatterSeq", "SumGradsOverTP"]


class CopyToTP(torch.autograd.Function):
    """Identity in forward; the gradient summed over the TP ranks in backward."""

    @staticmethod
    def forward(ctx, x, tp, readers):
        ctx.tp, ctx.readers = tp, readers
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return ctx.tp.all_reduce(grad, ctx.readers, "input gradient"), None, None


class ReduceFromTP(torch.autograd.Function):
    """The partial sums of the TP ranks added up in forward; identity in backward."""

    @staticmethod
    def forward(ctx, partial, tp, modules):
        return tp.all_reduce(partial, modules, "output")

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class GatherSeq(torch.autograd.Function):
    """Shards of dim ``dim`` (the sequence, or features) all_gathered in forward; in backward
    the gradient reduce_scattered: summed (``grad_op="sum"``: partial over TP, from colwise
    readers) or cut to the shard (``"max"``: the same on every TP rank, so the max of the copies
    is the value)."""

    @staticmethod
    def forward(ctx, x, tp, modules, grad_op, dim=1, what="input"):
        ctx.tp, ctx.modules, ctx.grad_op, ctx.dim, ctx.what = tp, modules, grad_op, dim, what
        return tp.gather_sequence(x, modules, what, dim)

    @staticmethod
    def backward(ctx, grad):
        cut = ctx.tp.scatter_sequence(grad, ctx.modules, f"{ctx.what} gradient", ctx.grad_op, ctx.dim)
        return cut, None, None, None, None, None


class ScatterSeq(torch.autograd.Function):
    """``x`` reduce_scattered over the sequence (``op``: ``"sum"`` of partial sums, ``"max"``
    to cut identical copies), plus ``bias``; in backward the gradient all_gathered, and the
    bias gradient summed from the gathered one (the same on every TP rank, no collective)."""

    @staticmethod
    def forward(ctx, x, bias, tp, fqn, op, dim=1, what="output"):
        ctx.tp, ctx.fqn, ctx.has_bias, ctx.dim, ctx.what = tp, fqn, bias is not None, dim, what
        out = tp.scatter_sequence(x, [fqn], what, op, dim)
        return out if bias is None else out + bias

    @staticmethod
    def backward(ctx, grad):
        whole = ctx.tp.gather_sequence(grad, [ctx.fqn], f"{ctx.what} gradient", ctx.dim)
        grad_bias = whole.reshape(-1, whole.shape[-1]).sum(0) if ctx.has_bias else None
        return whole, grad_bias, None, None, None, None, None


class SumGradsOverTP(torch.autograd.Function):
    """Parameters as they are in forward; in backward their gradients (partial over TP: each
    rank saw its sequence shard) summed over the TP ranks with one all_reduce."""

    @staticmethod
    def forward(ctx, tp, fqn, names, *params):
        ctx.tp, ctx.fqn, ctx.names = tp, fqn, names
        ctx.shapes = [p.shape for p in params]
        return tuple(p.view_as(p) for p in params)

    @staticmethod
    def backward(ctx, *grads):
        flat = torch.cat([g.reshape(-1) for g in grads])
        summed = ctx.tp.all_reduce(flat, [ctx.fqn], "parameter gradients", [f"{ctx.fqn}.{n}" for n in ctx.names])
        parts = summed.split([s.numel() for s in ctx.shapes])
        return (None, None, None, *(part.view(shape) for part, shape in zip(parts, ctx.shapes)))

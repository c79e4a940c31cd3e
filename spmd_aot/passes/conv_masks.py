"""Ask every convolution backward that computes a bias gradient for the weight's gradient too.

Why: with a trainable bias beside a frozen weight (BitFit-style fine-tuning) autograd asks
``convolution_backward`` for ``output_mask=[.., False, True]``. CPU's oneDNN path then returns a
weight gradient anyway, where the meta kernel returns none, so the load's check could not say
what the kernel really returns and the op's contract refuses that mask. Asking for the weight's
gradient as well makes the two agree; nothing reads it, and it costs one weight-gradient
computation per such layer.
"""

from __future__ import annotations

import torch

__all__ = ["ask_conv_weight_grads"]

_CONV_BACKWARD = torch.ops.aten.convolution_backward.default
_MASK = 10  # convolution_backward's output_mask argument


def ask_conv_weight_grads(gm: torch.fx.GraphModule) -> int:
    """Turn each ``output_mask=[i, False, True]`` into ``[i, True, True]``; returns how many."""
    changed = 0
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is not _CONV_BACKWARD:
            continue
        args = list(node.args)
        mask = node.kwargs.get("output_mask", args[_MASK] if len(args) > _MASK else None)
        if not (isinstance(mask, (list, tuple)) and len(mask) == 3 and mask[2] and not mask[1]):
            continue
        wanted = [bool(mask[0]), True, True]
        if "output_mask" in node.kwargs:
            node.kwargs = {**node.kwargs, "output_mask": wanted}
        else:
            args[_MASK] = wanted
            node.args = tuple(args)
        val = node.meta.get("val")
        weight = node.args[2].meta.get("val") if isinstance(node.args[2], torch.fx.Node) else None
        if isinstance(val, (tuple, list)) and weight is not None:
            node.meta["val"] = (val[0], torch.empty_like(weight), val[2])
        changed += 1
    return changed

"""Rewrite ops that change a tensor's shape or strides in place into their out-of-place views.

Why: a loaded graph is checked node by node on meta tensors, and that check relies on a tensor
keeping its geometry once made (``format/validate.py``), so the load refuses every op that
changes it in place (``allowlist.REFUSED``). Ordinary code emits some: ``nn.AdaptiveAvgPool1d``
on a transposed input calls ``as_strided_`` in its forward, ``x.t_()`` or ``x.unsqueeze_(0)``
in a model call the others. In a traced graph each value is one node, so ``y = x.op_(...)`` is
exactly ``y = x.op(...)`` with every later use of ``x`` reading ``y``: the graph computes the
same values and never stores the in-place op.

A graph input is the exception: its new geometry would be visible to the caller (a parameter
or a batch tensor whose shape the step changes), which a stored step cannot reproduce; the
build refuses it and says how to write the step.
"""

from __future__ import annotations

import torch

from ..errors import SpmdAotError

__all__ = ["OUT_OF_PLACE", "rewrite_inplace_views"]

_aten = torch.ops.aten

#: In-place geometry op -> the view with the same arguments that returns the new geometry.
OUT_OF_PLACE = {
    _aten.as_strided_.default: _aten.as_strided.default,
    _aten.t_.default: _aten.t.default,
    _aten.transpose_.default: _aten.transpose.int,
    _aten.swapdims_.default: _aten.transpose.int,
    _aten.swapaxes_.default: _aten.transpose.int,
    _aten.squeeze_.default: _aten.squeeze.default,
    _aten.squeeze_.dim: _aten.squeeze.dim,
    _aten.squeeze_.dims: _aten.squeeze.dims,
    _aten.unsqueeze_.default: _aten.unsqueeze.default,
}


def rewrite_inplace_views(gm: torch.fx.GraphModule) -> int:
    """Replace each in-place geometry op (``OUT_OF_PLACE``) by its view; later readers of the
    tensor it changed read the view. Returns how many nodes were rewritten."""
    graph = gm.graph
    targets = [n for n in graph.nodes if n.op == "call_function" and n.target in OUT_OF_PLACE]
    if not targets:
        return 0
    order = {n: i for i, n in enumerate(graph.nodes)}
    for node in targets:
        changed = node.args[0]
        if not isinstance(changed, torch.fx.Node) or changed.op == "placeholder":
            name = getattr(changed, "name", changed)
            raise SpmdAotError(
                f"node {node.name} calls {node.target} on the step's input {name}, changing its shape or "
                "strides in place for the caller too, which a stored step cannot do. Use the out-of-place "
                "view and keep the result (e.g. `x = x.transpose(0, 1)` instead of `x.transpose_(0, 1)`)")
        with graph.inserting_before(node):
            view = graph.call_function(OUT_OF_PLACE[node.target], node.args, dict(node.kwargs))
        view.meta = dict(node.meta)
        position = order[node]
        for user in list(changed.users):
            if user is not node and order.get(user, -1) > position:
                user.replace_input_with(changed, view)
        node.replace_all_uses_with(view)
        graph.erase_node(node)
        order[view] = position
    return len(targets)

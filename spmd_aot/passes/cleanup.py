"""Remove nodes that only matter for eager execution."""

from __future__ import annotations

import torch

from .ops import FOLDABLE_VIEWS

__all__ = ["strip_profiler_ops", "remove_detach", "fold_views"]


def strip_profiler_ops(gm: torch.fx.GraphModule) -> int:
    """Drop ``profiler._record_function_*`` nodes the optimizer's step hook records.

    They label a profiler range in eager mode; in a stored graph they would only add a
    namespace to the allowlist. Returns how many nodes were removed.
    """
    removed = 0
    # Walking backwards erases an exit node before the enter node it refers to.
    for node in reversed(list(gm.graph.nodes)):
        if node.op == "call_function" and getattr(node.target, "namespace", None) == "profiler":
            if node.users:
                raise AssertionError(f"profiler node {node.name} feeds {list(node.users)}")
            gm.graph.erase_node(node)
            removed += 1
    return removed


def remove_detach(gm: torch.fx.GraphModule) -> int:
    """Replace ``aten.detach(x)`` by ``x``.

    The stored step runs under ``no_grad``, where a detached alias and its source are the same
    storage with the same values: in-place updates through either are the same update. Each
    removed node is one op call less per step. Returns how many were removed.
    """
    removed = 0
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is torch.ops.aten.detach.default:
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)
            removed += 1
    return removed


def _meta(node) -> torch.Tensor | None:
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return val if isinstance(val, torch.Tensor) else None


def fold_views(gm: torch.fx.GraphModule) -> int:
    """Drop views that change nothing and collapse chains of views into one.

    Expanding DTensor at the parameter boundary leaves two ``view(p, p.shape)`` per parameter
    and use, and bucketing flattens and reshapes every gradient: on a small model about half the
    step's ops are views, each an op call the loaded step pays for every step. Under ``no_grad``
    ``view(x, x.shape)`` is ``x`` (same storage, sizes and strides), and on a contiguous ``x``
    ``view(view(x, a), b)`` is ``view(x, b)``. A view the step returns is kept, so an output
    is never the very tensor object of an input. Returns how many view nodes were removed.
    """
    graph = gm.graph
    outputs = set(graph.output_node().all_input_nodes) if any(n.op == "output" for n in graph.nodes) else set()
    removed = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in FOLDABLE_VIEWS or node in outputs:
            continue
        source, out = node.args[0], _meta(node)
        src = _meta(source)
        if src is None or out is None:
            continue
        if tuple(src.shape) == tuple(out.shape) and src.stride() == out.stride():
            node.replace_all_uses_with(source)
            graph.erase_node(node)
            removed += 1
            continue
        # view(view(x, a), b) -> view(x, b) on a contiguous x; the inner one goes when unused
        if isinstance(source, torch.fx.Node) and source.op == "call_function" and source.target in FOLDABLE_VIEWS:
            base = source.args[0]
            base_val = _meta(base)
            if base_val is not None and base_val.is_contiguous():
                node.args = (base,) + tuple(node.args[1:])
                if not source.users and source not in outputs:
                    graph.erase_node(source)
                    removed += 1
    return removed

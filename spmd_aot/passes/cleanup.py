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
    replaced: dict[torch.fx.Node, torch.fx.Node] = {}
    for node in gm.graph.nodes:
        _rewire(node, replaced)
        if node.op == "call_function" and node.target is torch.ops.aten.detach.default:
            replaced[node] = node.args[0]
    for node in reversed(list(replaced)):
        gm.graph.erase_node(node)
    return len(replaced)


def _rewire(node: torch.fx.Node, replaced: dict) -> None:
    """``node`` reads what the nodes it reads were replaced by.

    Replacing as each node is met (``replace_all_uses_with``) rewrites every user's whole
    argument list at once per replaced node: a multi-tensor optimizer call lists every
    parameter, so a deep model's step paid (parameters x replaced views) there, seconds at 80
    layers. Each node's arguments are rewritten once, when the walk reaches it, instead."""
    if not replaced or not any(a in replaced for a in node.all_input_nodes):
        return
    hits = []

    def swap(a):
        b = replaced.get(a)
        if b is None:
            return a
        hits.append(a)
        return b

    # only what changes is assigned: an assignment re-indexes the node and re-registers its uses
    args = torch.fx.node.map_arg(node.args, swap)
    if hits:
        node.args = args
    if node.kwargs:
        hits.clear()
        kwargs = torch.fx.node.map_arg(node.kwargs, swap)
        if hits:
            node.kwargs = kwargs


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
    replaced: dict[torch.fx.Node, torch.fx.Node] = {}  # identity views -> their source (``_rewire``)
    into: dict[torch.fx.Node, list[torch.fx.Node]] = {}  # source -> the views replaced by it
    dead: dict[torch.fx.Node, None] = {}  # erased once no node reads them, in the order found
    for node in list(graph.nodes):
        _rewire(node, replaced)
        if node.op != "call_function" or node.target not in FOLDABLE_VIEWS or node in outputs:
            continue
        source, out = node.args[0], _meta(node)
        src = _meta(source)
        if src is None or out is None:
            continue
        if tuple(src.shape) == tuple(out.shape) and src.stride() == out.stride():
            replaced[node] = source
            into.setdefault(source, []).append(node)
            dead[node] = None
            continue
        # view(view(x, a), b) -> view(x, b) on a contiguous x; the inner one goes when unused
        if isinstance(source, torch.fx.Node) and source.op == "call_function" and source.target in FOLDABLE_VIEWS:
            base = source.args[0]
            base_val = _meta(base)
            if base_val is not None and base_val.is_contiguous():
                node.args = (base,) + tuple(node.args[1:])
                if not _read(source, dead, into) and source not in outputs:
                    dead[source] = None
    for node in reversed(list(dead)):
        graph.erase_node(node)
    return len(dead)


def _read(node: torch.fx.Node, dead: dict, into: dict) -> bool:
    """Whether a live node reads ``node``, counting the readers of the views replaced by it that
    the walk has not rewired yet (what reading it as each view was replaced would have found)."""
    if any(user not in dead for user in node.users):
        return True
    return any(view.users for view in into.get(node, ()))

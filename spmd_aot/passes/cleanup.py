"""Remove nodes that only matter for eager execution."""

from __future__ import annotations

import torch

__all__ = ["strip_profiler_ops", "remove_detach"]


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

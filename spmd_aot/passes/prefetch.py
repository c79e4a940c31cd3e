"""Issue each group's all_gather while the previous group computes (FSDP2's prefetch).

As traced, a group's all_gather sits right before its first use, so the step would wait for
every gather. This pass moves the all_gather of group k+1 (with the copy-in ``cat`` that feeds
it) to right after the ``wait_tensor`` of group k, in forward and, among the re-gathers of
resharded groups, in backward; its own ``wait_tensor`` stays before its first use, so the
transfer runs while group k computes. One group ahead, as FSDP2 (wait for group k, issue
k+1, compute k): at most two groups' gathered parameters are alive at once. The first
backward re-gather is not hoisted into forward.
"""

from __future__ import annotations

import torch

from .ops import is_wait

__all__ = ["prefetch_groups", "group_gathers"]


def group_gathers(gm: torch.fx.GraphModule, phase: str) -> list[torch.fx.Node]:
    """The labelled group all_gathers of one phase ("forward" or "backward"), in graph order."""
    return [n for n in gm.graph.nodes
            if n.op == "call_function" and getattr(n.target, "__name__", "").startswith("all_gather_into_tensor")
            and n.meta.get("comm", {}).get("phase") == phase]


def prefetch_groups(gm: torch.fx.GraphModule) -> int:
    """Hoist each group all_gather to right after the previous one's wait. Returns how many moved."""
    nodes = list(gm.graph.nodes)
    # Positions, kept valid as nodes move: moved nodes get fractions between their wait (waits
    # never move, so keep integer positions) and its successor; no pass over the graph per
    # move (80 layers: 160 moves over 35k nodes).
    order: dict[torch.fx.Node, float] = {n: float(i) for i, n in enumerate(nodes)}
    moved = 0
    moved_nodes: list[torch.fx.Node] = []
    for phase in ("forward", "backward"):
        gathers = group_gathers(gm, phase)
        for prev, nxt in zip(gathers, gathers[1:]):
            waits = [u for u in prev.users if is_wait(u)]
            if len(waits) != 1:
                continue
            anchor = wait = waits[0]
            if order[nxt] < order[wait]:
                continue
            closure = _dependencies_after(nxt, order, order[wait])
            if _written_between(nodes[int(order[wait]) + 1: int(order[nxt])], closure):
                continue
            for k, node in enumerate(sorted(closure, key=order.__getitem__)):
                anchor.append(node)
                anchor = node
                order[node] = order[wait] + (k + 1) / (len(closure) + 1)
                moved_nodes.append(node)
            moved += 1
    _check_order(moved_nodes, order)
    return moved


def _check_order(moved: list[torch.fx.Node], order: dict) -> None:
    """Every moved node still comes after what it reads and before what reads it (what
    ``Graph.lint`` would check of them; the nodes that did not move kept their order, so a
    whole-graph lint per build is not needed)."""
    for node in moved:
        if any(order[i] >= order[node] for i in node.all_input_nodes) or \
                any(order.get(u, float("inf")) <= order[node] for u in node.users):
            raise AssertionError(f"prefetching moved {node.name} out of dependency order")


def _dependencies_after(node: torch.fx.Node, order: dict, start: int) -> set[torch.fx.Node]:
    """``node`` and every node it depends on that comes after position ``start``."""
    closure, stack = set(), [node]
    while stack:
        n = stack.pop()
        if n in closure or order[n] <= start:
            continue
        if n.op != "call_function":
            raise AssertionError(f"{n.name} ({n.op}) feeds a group all_gather after the previous one")
        closure.add(n)
        stack.extend(n.all_input_nodes)
    return closure


def _root(node: torch.fx.Node) -> torch.fx.Node:
    """The tensor ``node`` is a view of (following view ops back to their source)."""
    while node.op == "call_function":
        schema = getattr(node.target, "_schema", None)
        if schema is None or not schema.returns or schema.returns[0].alias_info is None \
                or not node.args or not isinstance(node.args[0], torch.fx.Node):
            break
        node = node.args[0]
    return node


def _written_between(between, closure: set) -> bool:
    """Whether an in-place op among ``between`` writes to what the moved nodes read."""
    read = {_root(i) for n in closure for i in n.all_input_nodes if i not in closure}
    for n in between:
        schema = getattr(n.target, "_schema", None)
        if schema is None or not schema.is_mutable:
            continue
        for arg, value in zip(schema.arguments, n.args):
            if arg.alias_info is not None and arg.alias_info.is_write:
                values = value if isinstance(value, (list, tuple)) else [value]
                if any(isinstance(v, torch.fx.Node) and _root(v) in read for v in values):
                    return True
    return False

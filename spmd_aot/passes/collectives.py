"""Find, deduplicate and measure the collectives of an expanded graph."""

from __future__ import annotations

import torch

from .ops import is_wait

__all__ = ["is_collective", "collective_kind", "collective_stats", "dedupe_collectives", "label_collective"]


def is_collective(node: torch.fx.Node) -> bool:
    """A node that communicates (``wait_tensor`` only waits for one, so it is not counted)."""
    target = node.target
    return (
        node.op == "call_function"
        and getattr(target, "namespace", None) == "_c10d_functional"
        and not is_wait(node)
    )


def label_collective(tensor: torch.Tensor, comm: dict) -> None:
    """While tracing, attach ``comm`` (label, parameters, ...) to the graph node that produced
    ``tensor``: the statistics, ``show`` and the passes read ``node.meta["comm"]``."""
    from torch.fx.experimental.proxy_tensor import get_proxy_mode, get_proxy_slot

    mode = get_proxy_mode()
    if mode is None:
        return
    slot = get_proxy_slot(tensor, mode.tracer, None)
    if slot is not None:
        slot.proxy.node.meta["comm"] = dict(comm)


def _wait_of(node: torch.fx.Node):
    waits = [u for u in node.users if is_wait(u)]
    return waits[0] if len(waits) == 1 and len(node.users) == 1 else None


def dedupe_collectives(gm: torch.fx.GraphModule) -> int:
    """Drop a collective identical to an earlier one (same op, input and arguments).

    DTensor can emit the same reduction twice (e.g. a Partial scalar redistributed at each
    use); the seed deduplicated such all_reduces too. Returns how many were removed.
    """
    nodes = list(gm.graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    seen: dict[tuple, torch.fx.Node] = {}
    removed = 0
    for node in nodes:
        if not is_collective(node):
            continue
        wait = _wait_of(node)
        if wait is None:
            continue
        signature = (node.target, node.args, tuple(sorted(node.kwargs.items())))
        first = seen.get(signature)
        if first is None or order[first] > order[node] or _mutated_between(nodes, order[first], order[node], node):
            seen[signature] = wait
            continue
        wait.replace_all_uses_with(first)
        gm.graph.erase_node(wait)
        gm.graph.erase_node(node)
        removed += 1
    return removed


def _mutated_between(nodes, start: int, end: int, collective: torch.fx.Node) -> bool:
    """Whether an in-place op between two positions writes to the collective's inputs."""
    inputs = {a for a in collective.args if isinstance(a, torch.fx.Node)}
    for n in nodes[start:end]:
        schema = getattr(n.target, "_schema", None)
        if schema is not None and schema.is_mutable and inputs.intersection(
                a for a in n.args if isinstance(a, torch.fx.Node)):
            return True
    return False


def collective_kind(node: torch.fx.Node) -> str:
    """``all_reduce`` for both ``all_reduce`` and its in-place form ``all_reduce_``."""
    return node.target.__name__.split(".")[0].rstrip("_")


def collective_stats(gm: torch.fx.GraphModule, names: dict[str, str] | None = None) -> dict:
    """Count collectives by kind, the bytes each rank sends into them per step, and list each
    one in graph order (``comm``: kind, label, bytes, the parameters it serves) for ``show``.

    Labels come from ``node.meta["comm"]`` (set by the bucket and group passes); ``names``
    maps a collective's node name to a parameter FQN for collectives no pass labelled."""
    by_kind: dict[str, int] = {}
    total_bytes = 0
    comm = []
    for node in gm.graph.nodes:
        if not is_collective(node):
            continue
        kind = collective_kind(node)
        by_kind[kind] = by_kind.get(kind, 0) + 1
        val = node.args[0].meta.get("val") if isinstance(node.args[0], torch.fx.Node) else None
        nbytes = val.numel() * val.element_size() if isinstance(val, torch.Tensor) else 0
        total_bytes += nbytes
        meta = node.meta.get("comm") or {}
        param = (names or {}).get(node.name)
        comm.append({"kind": kind, "label": str(meta.get("label", param or "")), "bytes": nbytes,
                     "params": [str(p) for p in meta.get("params", [param] if param else [])]})
    return {"collectives": sum(by_kind.values()), "by_kind": by_kind, "bytes_per_step": total_bytes,
            "comm": comm}

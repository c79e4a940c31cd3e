"""Find and measure the collectives of an expanded graph."""

from __future__ import annotations

import torch

__all__ = ["is_collective", "collective_stats"]


def is_collective(node: torch.fx.Node) -> bool:
    """A node that communicates (``wait_tensor`` only waits for one, so it is not counted)."""
    target = node.target
    return (
        node.op == "call_function"
        and getattr(target, "namespace", None) == "_c10d_functional"
        and target.__name__.split(".")[0] != "wait_tensor"
    )


def collective_stats(gm: torch.fx.GraphModule) -> dict:
    """Count collectives by kind and the bytes each rank sends into them per step."""
    by_kind: dict[str, int] = {}
    total_bytes = 0
    for node in gm.graph.nodes:
        if not is_collective(node):
            continue
        kind = node.target.__name__.split(".")[0]
        by_kind[kind] = by_kind.get(kind, 0) + 1
        val = node.args[0].meta.get("val") if isinstance(node.args[0], torch.fx.Node) else None
        if isinstance(val, torch.Tensor):
            total_bytes += val.numel() * val.element_size()
    return {"collectives": sum(by_kind.values()), "by_kind": by_kind, "bytes_per_step": total_bytes}

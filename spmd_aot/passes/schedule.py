"""Let communication overlap computation: wait for a collective only where its result is read.

A functional collective starts when its node runs and ``wait_tensor`` blocks until it is done
(gloo and NCCL both run the work asynchronously). Traced graphs wait right after issuing, which
serialises communication with computation; moving each wait to just before the first node that
reads its result lets backward (or forward) go on computing while the collective runs.
"""

from __future__ import annotations

import torch

from .ops import is_wait

__all__ = ["sink_waits"]

def sink_waits(gm: torch.fx.GraphModule) -> int:
    """Move every ``wait_tensor`` to just before its first user. Returns how many moved.

    Waits of shard group gathers (``meta["comm"]["phase"]``) stay where ``prefetch_groups``
    put them: it bounds how many groups are gathered at once."""
    nodes = list(gm.graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    moved = 0
    for node in nodes:
        if not is_wait(node) or not node.users or _scheduled(node):
            continue
        first = min(node.users, key=order.__getitem__)
        if first.op == "output" or first is node.next:
            continue
        first.prepend(node)  # data dependencies hold: its only input was already computed
        moved += 1
    if moved:
        gm.graph.lint()
    return moved


def _scheduled(wait: torch.fx.Node) -> bool:
    source = wait.args[0] if wait.args else None
    return isinstance(source, torch.fx.Node) and "phase" in (source.meta.get("comm") or {})

"""Gradient buckets for ``replicate``: one all_reduce per bucket instead of one per gradient.

What DDP does at run time, done once on the stored graph. Gradients are taken in the order
backward produces them (their graph order), packed greedily into buckets of at most
``bucket_cap_mb`` (the first one ``first_bucket_cap_mb``, so communication starts early), and
each bucket becomes::

    flat = cat([grad_a.view(-1), grad_b.view(-1), ...])     # copy-in, where the last grad appears
    flat = all_reduce_(flat, "avg", group)                  # in place on the fresh buffer
    flat = wait_tensor(flat)                                # just before the first reader
    grad_a, grad_b, ... = views of flat                     # no copy back

so the all_reduce of a bucket runs while backward computes the next ones. Small collectives are
slow (28 separate all_reduces cost 10.2 ms on gloo where one flat one of the same bytes cost
0.7 ms; see shared/DESIGN.md), which is why the bucket, not the gradient, is the unit.
"""

from __future__ import annotations

import dataclasses
import operator

import torch
from torch.fx import Node

__all__ = ["Bucket", "bucket_gradient_all_reduces", "assign_buckets"]

_aten = torch.ops.aten
_c10d = torch.ops._c10d_functional
_MIB = 1 << 20


@dataclasses.dataclass
class Bucket:
    label: str
    members: list[Node]  # the per-gradient all_reduce nodes, in graph order
    nbytes: int


def _val(node) -> torch.Tensor | None:
    val = node.meta.get("val") if isinstance(node, Node) else None
    return val if isinstance(val, torch.Tensor) else None


def _single_wait(node: Node) -> Node | None:
    users = list(node.users)
    if len(users) == 1 and users[0].target is _c10d.wait_tensor.default:
        return users[0]
    return None


def assign_buckets(sizes: list[int], cap_bytes: int, first_cap_bytes: int) -> list[list[int]]:
    """Greedy, in order: a bucket closes once it holds ``cap`` bytes or more (as DDP's
    ``compute_bucket_assignment_by_size``); the first bucket's cap is ``first_cap_bytes``."""
    buckets: list[list[int]] = []
    current: list[int] = []
    size = 0
    for i, n in enumerate(sizes):
        current.append(i)
        size += n
        if size >= (first_cap_bytes if not buckets else cap_bytes):
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    return buckets


def bucket_gradient_all_reduces(gm: torch.fx.GraphModule, cap_mb: float, first_cap_mb: float,
                                names: dict[str, str] | None = None) -> list[Bucket]:
    """Rewrite per-gradient ``all_reduce`` + ``wait_tensor`` pairs into buckets (see module doc).

    Only all_reduces whose result is read through exactly one wait are bucketed, per
    (reduce op, group, dtype, device); ``names`` maps a collective's node name to the FQN of
    the parameter whose gradient it reduces (for ``spmd-aot show``). Returns the buckets, each
    collective labelled in ``node.meta["comm"]``.
    """
    graph = gm.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    families: dict[tuple, list[Node]] = {}
    for node in graph.nodes:
        if node.target is not _c10d.all_reduce.default or _single_wait(node) is None:
            continue
        val = _val(node.args[0])
        if val is None:
            continue
        family = (node.args[1], node.args[2], val.dtype, val.device.type)
        families.setdefault(family, []).append(node)

    names = names or {}
    buckets: list[Bucket] = []
    for family, members in families.items():
        sizes = [_val(m.args[0]).numel() * _val(m.args[0]).element_size() for m in members]
        for indices in assign_buckets(sizes, int(cap_mb * _MIB), int(first_cap_mb * _MIB)):
            chosen = [members[i] for i in indices]
            bucket = Bucket(f"bucket {len(buckets)}", chosen, sum(sizes[i] for i in indices))
            params = [names.get(m.name, "?") for m in chosen]
            if len(chosen) > 1 and _read_after_last(chosen, order):
                _rewrite(graph, bucket, family, order)
            bucket.members[0].meta["comm"] = {"label": bucket.label, "params": params}
            buckets.append(bucket)
    graph.lint()
    return buckets


def _read_after_last(members: list[Node], order: dict[Node, int]) -> bool:
    """Whether no reduced gradient of the bucket is read before its last gradient exists (a
    step that reads a gradient mid-backward keeps that bucket's all_reduces separate)."""
    last = max(order[m] for m in members)
    return all(order[u] > last for m in members for u in _single_wait(m).users)


def _rewrite(graph: torch.fx.Graph, bucket: Bucket, family: tuple, order: dict[Node, int]) -> None:
    reduce_op, group, dtype, _ = family
    members = bucket.members
    waits = [_single_wait(m) for m in members]
    vals = [_val(m.args[0]) for m in members]
    numels = [v.numel() for v in vals]
    total = sum(numels)
    flat_val = torch.empty(total, dtype=dtype, device="meta")
    last = max(members, key=order.__getitem__)
    first_reader = min((u for w in waits for u in w.users), key=order.__getitem__, default=None)

    with graph.inserting_before(last):
        pieces = []
        for m, v in zip(members, vals):
            flatten = _aten.view.default if v.is_contiguous() else _aten.reshape.default
            piece = graph.call_function(flatten, (m.args[0], [-1]))
            piece.meta["val"] = torch.empty(v.numel(), dtype=dtype, device="meta")
            pieces.append(piece)
        flat = graph.call_function(_aten.cat.default, (pieces,))
        flat.meta["val"] = flat_val
        reduced = graph.call_function(_c10d.all_reduce_.default, (flat, reduce_op, group))
        reduced.meta["val"] = flat_val
    anchor = first_reader if first_reader is not None else last.next
    with graph.inserting_before(anchor):
        waited = graph.call_function(_c10d.wait_tensor.default, (reduced,))
        waited.meta["val"] = flat_val
        split = graph.call_function(_aten.split_with_sizes.default, (waited, numels))
        split.meta["val"] = [torch.empty(n, dtype=dtype, device="meta") for n in numels]
        for i, (w, v) in enumerate(zip(waits, vals)):
            item = graph.call_function(operator.getitem, (split, i))
            item.meta["val"] = split.meta["val"][i]
            view = graph.call_function(_aten.view.default, (item, list(v.shape)))
            view.meta["val"] = torch.empty(v.shape, dtype=dtype, device="meta")
            w.replace_all_uses_with(view)
    for m, w in zip(members, waits):
        graph.erase_node(w)
        graph.erase_node(m)
    bucket.members = [reduced]


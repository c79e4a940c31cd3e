"""Gradient buckets for ``replicate``: one all_reduce per bucket instead of one per gradient.

What DDP does at run time, done once on the stored graph. Gradients are taken in the order
backward produces them (their graph order), packed greedily into buckets of at most
``bucket_cap_mb`` (the first one ``first_bucket_cap_mb``, so communication starts early), and
each bucket becomes::

    flat = empty(total)                                     # before the bucket's first gradient
    mm.out(x, dy, out=flat[a:b].view(...))                  # a matmul's gradient is written in place
    flat[c:d].view(...).copy_(grad_c)                       # any other gradient is copied in
    flat = all_reduce_(flat, "avg", group)                  # where the last gradient appears
    flat = wait_tensor(flat)                                # just before the first reader
    grad_a, grad_b, ... = views of flat                     # no copy back

so the all_reduce of a bucket runs while backward computes the next ones. Weight gradients,
nearly all of a bucket's bytes, come out of a matmul: writing them straight into the bucket (as
DDP's ``gradient_as_bucket_view``) spares copying the bucket in, which cost 13 ms of a 434 ms
step at 12 layers and d_model 256 on two ranks sharing two cores. Small collectives are
slow (28 separate all_reduces cost 10.2 ms on gloo where one flat one of the same bytes cost
0.7 ms), which is why the bucket, not the gradient, is the unit.
"""

from __future__ import annotations

import dataclasses
import operator

import torch
from torch.fx import Node

from .ops import FLAT_ORDER_VIEWS, is_wait

__all__ = ["Bucket", "bucket_gradient_all_reduces", "assign_buckets"]

_aten = torch.ops.aten
_c10d = torch.ops._c10d_functional
_MIB = 1 << 20
#: Views that always alias their input (never copy), so where they sit does not change what they read.
_ALIASING_VIEWS = frozenset({_aten.alias.default, _aten.view.default, _aten._unsafe_view.default, _aten.detach.default})


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
    if len(users) == 1 and is_wait(users[0]):
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
                                names: dict[str, str] | None = None, only_named: bool = False) -> list[Bucket]:
    """Rewrite per-gradient ``all_reduce`` + ``wait_tensor`` pairs into buckets (see module doc).

    Only all_reduces whose result is read through exactly one wait are bucketed, per
    (reduce op, group, dtype, device); ``names`` maps a collective's node name to the FQN of
    the parameter whose gradient it reduces (for ``spmd-aot show``); with ``only_named``, only those
    are bucketed (a graph whose other all_reduces are not gradients': tensor parallel's activations
    and norms). Returns the buckets, each collective labelled in ``node.meta["comm"]``.
    """
    graph = gm.graph
    candidates = [n for n in graph.nodes if n.target is _c10d.all_reduce.default and _single_wait(n) is not None
                  and (not only_named or n.name in (names or {}))]
    for node in candidates:
        for user in list(_single_wait(node).users):
            _sink_view(user)
    order = {n: i for i, n in enumerate(graph.nodes)}
    families: dict[tuple, list[Node]] = {}
    for node in candidates:
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


def _sink_view(node: Node) -> None:
    """Move a view of a reduced gradient (and the views of it) down to just before its first
    reader. torch 2.14's tracer places the ``alias`` the optimizer reads right after the wait,
    mid-backward; a view computes nothing, so moving it keeps the values and lets the bucket's
    readers all come after its last gradient."""
    if node.op != "call_function" or node.target not in _ALIASING_VIEWS or not node.users:
        return
    for user in list(node.users):
        _sink_view(user)
    users = set(node.users)
    first = next(n for n in _after(node) if n in users)
    if first is not node.next:
        first.prepend(node)


def _after(node: Node):
    """The nodes after ``node``, in graph order."""
    node = node.next
    while node.op != "root":
        yield node
        node = node.next


def _read_after_last(members: list[Node], order: dict[Node, int]) -> bool:
    """Whether no reduced gradient of the bucket is read before its last gradient exists (a
    step that reads a gradient mid-backward keeps that bucket's all_reduces separate)."""
    last = max(order[m] for m in members)
    return all(order[u] > last for m in members for u in _single_wait(m).users)


def _matmul_behind(grad: Node) -> tuple[Node, list[Node]] | None:
    """The ``mm`` whose output ``grad`` is, seen through views nobody else reads, and those views;
    None unless both are contiguous at offset 0 with the same elements (so the same flat order)."""
    chain, node = [], grad
    while node.op == "call_function" and node.target in FLAT_ORDER_VIEWS:
        if len(node.users) != 1:
            return None
        chain.append(node)
        node = node.args[0]
    if node.op != "call_function" or node.target is not _aten.mm.default or len(node.users) != 1:
        return None
    g, p = _val(grad), _val(node)
    if (g is None or p is None or not g.is_contiguous() or not p.is_contiguous() or g.numel() != p.numel()
            or g.storage_offset() or p.storage_offset() or len(grad.users) != 1):
        return None
    return node, chain


def _rewrite(graph: torch.fx.Graph, bucket: Bucket, family: tuple, order: dict[Node, int]) -> None:
    reduce_op, group, dtype, device = family
    members = bucket.members
    waits = [_single_wait(m) for m in members]
    vals = [_val(m.args[0]) for m in members]
    numels = [v.numel() for v in vals]
    offsets = [sum(numels[:i]) for i in range(len(numels))]
    total = sum(numels)
    flat_val = torch.empty(total, dtype=dtype, device="meta")
    last = max(members, key=order.__getitem__)
    first_reader = min((u for w in waits for u in w.users), key=order.__getitem__, default=None)
    matmuls = [_matmul_behind(m.args[0]) for m in members]
    starts = [found[0] if found else m for m, found in zip(members, matmuls)]

    def piece(offset: int, n: int, shape) -> Node:  # flat[offset:offset + n].view(shape)
        sliced = graph.call_function(_aten.slice.Tensor, (flat, 0, offset, offset + n))
        sliced.meta["val"] = flat_val[offset:offset + n]
        view = graph.call_function(_aten.view.default, (sliced, list(shape)))
        view.meta["val"] = sliced.meta["val"].view(shape)
        return view

    with graph.inserting_before(min(starts, key=order.__getitem__)):
        flat = graph.call_function(_aten.empty.memory_format, ([total],),
                                   {"dtype": dtype, "device": torch.device(device)})
        flat.meta["val"] = flat_val
    for m, found, offset, n in zip(members, matmuls, offsets, numels):
        if not found:
            continue
        mm, chain = found
        with graph.inserting_before(mm):
            written = graph.call_function(_aten.mm.out, mm.args, {"out": piece(offset, n, _val(mm).shape)})
            written.meta["val"] = written.kwargs["out"].meta["val"]
        mm.replace_all_uses_with(written)
        graph.erase_node(mm)
        m.args = (flat,) + tuple(m.args[1:])  # the member's gradient is now part of ``flat``
        for view in chain:  # outermost first: each is then unread
            graph.erase_node(view)
    with graph.inserting_before(last):
        for m, found, offset, n, v in zip(members, matmuls, offsets, numels, vals):
            if not found:
                copied = graph.call_function(_aten.copy_.default, (piece(offset, n, v.shape), m.args[0]))
                copied.meta["val"] = flat_val[offset:offset + n].view(v.shape)
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


"""An optimizer's list ops split per block and ordered block by block, so the update repeats too.

Why: a ``foreach`` optimizer (torch's default multi-tensor AdamW, SGD, ...) updates every parameter
in a dozen ops over lists as long as the model has parameters. Compiled whole, that tail grows
with depth (a 6-layer LM spent half its kernel compile there). Every ``_foreach_*`` op is the same
computation on each element of its lists, so it splits into one op per chunk of elements; with the
chunks cut where the parameters' shapes repeat (one chunk per layer), and the step's tail ordered
chunk by chunk, the update of layer ``i`` is a block like the forward and backward ones, which
``kernel_segments`` compiles once and calls per layer.

The order keeps every dependence: values, and the order of each write to a tensor with the reads
and writes of it around it (a foreach op updates its inputs in place). Nodes that read several
chunks (a global norm for clipping) come where their inputs are ready, between chunk phases.
"""

from __future__ import annotations

import heapq
import operator

import torch
import torch.fx as fx

from .kernel_segments import is_list_op, is_view

__all__ = ["split_per_block"]

_SHARED, _MIXED = -1, -2


def split_per_block(gm: fx.GraphModule) -> int:
    """Split and reorder ``gm``'s foreach tail in place (nodes need ``meta["val"]``); the number of
    chunks (0: nothing split)."""
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    first = next((i for i, n in enumerate(nodes) if is_list_op(n)), None)
    if first is None:
        return 0
    list_ops = [n for n in nodes[first:] if is_list_op(n)]
    if len({len(n.args[0]) for n in list_ops}) != 1:  # lists of several lengths (parameter groups): left whole
        return 0
    if any(u.target is not operator.getitem for n in list_ops for u in n.users):
        return 0
    found = [_chunk_bounds(n) for n in list_ops]
    if any(b is None for b in found):
        return 0
    # the op whose elements show the longest repeat (the parameters' shapes, not the steps' scalars)
    chunks = max(found, key=lambda b: len(b[-1]))
    if len(chunks) < 3:
        return 0
    label: dict[fx.Node, int] = {}
    for node in nodes[first:]:
        if is_list_op(node):
            _split(gm.graph, node, chunks, label)
    _reorder(gm.graph, [n for n in gm.graph.nodes if n.op == "call_function"][first:], label)
    gm.graph.lint()
    gm.recompile()
    return len(chunks)


def _chunk_bounds(node: fx.Node) -> list[list[int]] | None:
    """The element positions of each chunk of the op's lists: those outside the longest run of a
    repeating pattern of shapes (before and after it: one chunk, so one segment), then each repeat."""
    elements = node.args[0]
    if not all(isinstance(e, fx.Node) and isinstance(e.meta.get("val"), torch.Tensor) for e in elements):
        return None
    shapes = [(tuple(e.meta["val"].shape), e.meta["val"].dtype) for e in elements]
    n = len(shapes)
    best = (0, 0, 0)  # (covered, -period, start)
    for period in range(1, n // 2 + 1):
        i = 0
        while i + period < n:
            j = i
            while j + period < n and shapes[j] == shapes[j + period]:
                j += 1
            count = (j - i + period) // period
            if count >= 2 and (count * period, -period) > best[:2]:
                best = (count * period, -period, i)
            i = max(j, i + 1)
    covered, period, start = best[0], -best[1], best[2]
    if covered == 0:
        return None
    rest = list(range(start)) + list(range(start + covered, n))
    return ([rest] if rest else []) + [list(range(start + k * period, start + (k + 1) * period))
                                       for k in range(covered // period)]


def _split(graph: fx.Graph, node: fx.Node, chunks: list[list[int]], label: dict) -> None:
    """``node`` -> one op per chunk of its lists (other arguments shared); its ``getitem`` readers
    read the chunk's op."""
    length = len(node.args[0])

    def part(value, chunk):
        return type(value)(value[i] for i in chunk) if isinstance(value, (list, tuple)) and len(value) == length \
            else value

    pieces = []
    with graph.inserting_before(node):
        for c, chunk in enumerate(chunks):
            piece = graph.call_function(node.target, tuple(part(a, chunk) for a in node.args),
                                        {k: part(v, chunk) for k, v in node.kwargs.items()})
            value = node.meta.get("val")
            piece.meta = {"val": part(value, chunk)} if isinstance(value, (list, tuple)) else dict(node.meta)
            label[piece] = c
            pieces.append(piece)
    where = {i: (c, k) for c, chunk in enumerate(chunks) for k, i in enumerate(chunk)}
    for user in list(node.users):
        if user.target is not operator.getitem:
            raise AssertionError(f"{node.name} is read other than by getitem: {user.format_node()}")
        c, k = where[user.args[1]]
        user.args = (pieces[c], k)
    graph.erase_node(node)


def _written(node: fx.Node) -> list[fx.Node]:
    """The nodes whose tensors ``node`` writes in place (its schema's ``!`` arguments)."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        return []
    out = []
    for arg, value in zip(target._schema.arguments, node.args):
        if arg.alias_info is not None and arg.alias_info.is_write:
            out.extend(v for v in (value if isinstance(value, (list, tuple)) else [value]) if isinstance(v, fx.Node))
    for arg in target._schema.arguments:
        if arg.kwarg_only and arg.name in node.kwargs and arg.alias_info is not None and arg.alias_info.is_write:
            value = node.kwargs[arg.name]
            out.extend(v for v in (value if isinstance(value, (list, tuple)) else [value]) if isinstance(v, fx.Node))
    return out


def _base(node: fx.Node) -> fx.Node:
    """The node whose tensor ``node`` is a view of (itself if none): writes and reads through any
    view of one tensor are ordered as writes and reads of that tensor."""
    while is_view(node):
        node = node.args[0]
    return node


def _reorder(graph: fx.Graph, region: list[fx.Node], label: dict) -> None:
    """Order ``region`` chunk by chunk, every value and write-order dependence kept (through views)."""
    inside = set(region)
    deps: dict[fx.Node, set[fx.Node]] = {n: set() for n in region}
    last_write: dict[fx.Node, fx.Node] = {}
    reads_since: dict[fx.Node, list[fx.Node]] = {}
    for node in region:
        read = node.all_input_nodes
        deps[node].update(r for r in read if r in inside)
        for tensor in {_base(r) for r in read}:
            if tensor in last_write:
                deps[node].add(last_write[tensor])
            reads_since.setdefault(tensor, []).append(node)
        for tensor in {_base(w) for w in _written(node)}:
            deps[node].update(reads_since.get(tensor, ()))
            reads_since[tensor] = []
            last_write[tensor] = node
        for d in list(deps[node]):
            if d is node:
                deps[node].discard(d)
        if node not in label:
            found = {label[d] for d in deps[node]}
            chunks = found - {_SHARED, _MIXED}
            label[node] = chunks.pop() if len(chunks) == 1 else _MIXED if chunks or _MIXED in found else _SHARED
    position = {n: i for i, n in enumerate(region)}
    waiting = {n: len(d) for n, d in deps.items()}
    users: dict[fx.Node, list[fx.Node]] = {n: [] for n in region}
    for n, d in deps.items():
        for x in d:
            users[x].append(n)
    ready = [(_rank(label[n]), position[n], n) for n in region if waiting[n] == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        *_, node = heapq.heappop(ready)
        order.append(node)
        for user in users[node]:
            waiting[user] -= 1
            if waiting[user] == 0:
                heapq.heappush(ready, (_rank(label[user]), position[user], user))
    if len(order) != len(region):
        raise AssertionError("the list-op tail has a dependence cycle")
    tail = region[-1].next
    for node in order:
        tail.prepend(node)


def _rank(label: int) -> int:
    return -1 if label in (_SHARED, _MIXED) else label

"""The stored graph cut into segments, one compiled library per distinct segment.

Why: Inductor's compile of a whole step grows with its depth (lowering, scheduling and the C++
of every layer's calls): a 12-layer LM took minutes, an 80-layer model would take a quarter of
an hour per configuration. The layers of a deep model are the same computation on other
tensors, so the graph repeats: the forward of block ``i`` is the forward of block ``i + 1``
with other parameters and activations. This module finds those repeats (``_repeats``: a period
in the sequence of node signatures), cuts the graph at block boundaries, and canonicalizes each
segment (inputs in first-use order, nodes by position): segments whose canonical forms are equal
are one library, compiled once and called once per block. Regions that do not repeat (the
embedding, the loss, the optimizer's list ops) are segments of their own.

A cut is only where a value may cross: views are recomputed in the segment that reads them (a
library may not return an alias of its input: AOTAutograd's Python would have to regenerate it),
``getitem`` of a multi-output op and ``wait_tensor`` of a collective stay with their producer.
Stored constants are inputs of the segments that read them (Inductor would append a constant it
holds to the library's inputs, which a bare call does not pass). Correctness does not depend on
finding the repeats: a graph with none is one segment, the whole step.

The result is a ``Partition``: the distinct segment graphs (each with fake example inputs) and
the calls that run the step, as value references (step inputs first, then the stored constants,
then each call's outputs in order); ``format/kernels_blob.py`` stores it and ``runtime/kernel_load.py`` runs it.
"""

from __future__ import annotations

import collections
import dataclasses
import operator

import torch
import torch.fx as fx

__all__ = ["Partition", "Call", "partition", "is_view", "is_list_op"]

#: Fewest nodes a repeated block needs to be its own library (each library costs a C++ compile).
MIN_PERIOD = 16
#: Candidate periods tried, the most frequent gaps between equal signatures first.
_CANDIDATES = 12


@dataclasses.dataclass
class Call:
    """One call of a library: ``inputs`` are value references; its outputs become the next values."""
    library: int
    inputs: list[int]


@dataclasses.dataclass
class Partition:
    """Distinct segment graphs (``modules``, ``examples``: fake inputs), the ``calls`` that run the
    step, and the references of the step's ``outputs``. References number the step's inputs, then
    its stored ``constants`` (by name: a library never holds one, so Inductor appends none to its
    inputs), then each call's outputs."""
    modules: list[fx.GraphModule]
    examples: list[list]
    calls: list[Call]
    outputs: list[int]
    n_inputs: int
    constants: list[str]

    def describe(self) -> str:
        uses = collections.Counter(c.library for c in self.calls)
        return f"{len(self.calls)} calls of {len(self.modules)} libraries ({dict(sorted(uses.items()))})"


def partition(gm: fx.GraphModule, whole: bool = False) -> Partition:
    """``gm`` (every node with ``meta["val"]``, from a fake run) as segments and calls; with
    ``whole``, as one segment."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    constants = [n for n in gm.graph.nodes if n.op == "get_attr"]
    body = [n for n in gm.graph.nodes if n.op == "call_function"]
    (output,) = [n for n in gm.graph.nodes if n.op == "output"]
    position = {n: i for i, n in enumerate(body)}
    segment_of = dict.fromkeys(body, 0) if whole else _segments(body)
    for node in body:  # a tuple or an in-flight collective never crosses: its reader joins its producer
        source = node.args[0] if node.args else None
        if isinstance(source, fx.Node) and source in position and _stays_with_producer(node, source):
            segment_of[node] = segment_of[source]
    members: dict[int, list[fx.Node]] = collections.defaultdict(list)
    for node in body:
        members[segment_of[node]].append(node)
    order = sorted(members)
    graphs = [_SegmentGraph(gm, members[s]) for s in order]

    needed = set()  # nodes some later segment (or the step's output) reads
    for g in graphs:
        needed.update(g.inputs)
    returned = list(output.args[0]) if isinstance(output.args[0], (list, tuple)) else [output.args[0]]
    if not all(isinstance(n, fx.Node) for n in returned):
        raise ValueError("the step returns a value that is not a tensor of the graph")
    needed.update(returned)

    library_of: dict[tuple, int] = {}  # canonical form -> library number
    distinct: list[_SegmentGraph] = []
    returns: list[set[int]] = []  # per library: positions any of its calls must return
    for g in graphs:
        index = library_of.setdefault(g.key, len(library_of))
        if index == len(distinct):
            distinct.append(g)
            returns.append(set())
        returns[index].update(i for i, n in enumerate(g.members) if n in needed)
    returned_positions = [sorted(r) for r in returns]
    refs = {n: i for i, n in enumerate(placeholders + constants)}
    calls = []
    for g in graphs:
        index = library_of[g.key]
        calls.append(Call(index, [refs[n] for n in g.inputs]))
        for position_in_segment in returned_positions[index]:
            refs[g.members[position_in_segment]] = len(refs)
    return Partition(modules=[g.module(returned_positions[i]) for i, g in enumerate(distinct)],
                     examples=[g.example for g in distinct], calls=calls,
                     outputs=[refs[n] for n in returned], n_inputs=len(placeholders),
                     constants=[n.target for n in constants])


def _stays_with_producer(node: fx.Node, source: fx.Node) -> bool:
    if node.target is operator.getitem:
        return True
    return node.target is torch.ops._c10d_functional.wait_tensor.default


def is_view(node: fx.Node) -> bool:
    """Whether ``node``'s tensor is a view of its first argument's (a view op, ``_unsafe_view``,
    ``alias``, or an element of a view op's list): read across a cut by recomputing it (a library
    returns no alias), and ordered with that tensor's writes (``kernel_list_ops``)."""
    if node.op != "call_function" or not node.args or not isinstance(node.args[0], fx.Node):
        return False
    if node.target is operator.getitem:
        return is_view(node.args[0])
    target = node.target
    return isinstance(target, torch._ops.OpOverload) and (target.is_view or target in _ALIASING)


_ALIASING = {torch.ops.aten._unsafe_view.default, torch.ops.aten.alias.default}


def is_list_op(node: fx.Node) -> bool:
    """An ATen ``_foreach_*`` op: the same computation on each element of its lists (an optimizer's
    update), split per block by ``kernel_list_ops`` and an anchor of a repeated block here."""
    target = node.target
    return node.op == "call_function" and isinstance(target, torch._ops.OpOverload) \
        and target.namespace == "aten" and target.__name__.startswith("_foreach_") \
        and bool(node.args) and isinstance(node.args[0], (list, tuple))


class _SegmentGraph:
    """One segment as a standalone graph: external values (constants too) as placeholders in
    first-use order, views it reads recomputed inside; ``key`` its canonical form."""

    def __init__(self, gm: fx.GraphModule, members: list[fx.Node]):
        self.root, self.members = gm, members
        self.graph = fx.Graph()
        self.inputs: list[fx.Node] = []
        self.env: dict[fx.Node, fx.Node] = {}
        self._local = set(members)
        for node in members:
            self.env[node] = self.graph.node_copy(node, self._arg)
        self.key = _canonical(self.graph)

    def _arg(self, value: fx.Node) -> fx.Node:
        if value in self.env:
            return self.env[value]
        if value not in self._local and is_view(value):
            copied = self.graph.node_copy(value, self._arg)
            copied.meta = dict(value.meta)
        else:
            copied = self.graph.placeholder(f"in{len(self.inputs)}")
            copied.meta["val"] = value.meta["val"]
            self.inputs.append(value)
        self.env[value] = copied
        return copied

    @property
    def example(self) -> list:
        return [n.meta["val"] for n in self.graph.nodes if n.op == "placeholder"]

    def module(self, outputs: list[int]) -> fx.GraphModule:
        graph = fx.Graph()
        remap: dict[fx.Node, fx.Node] = {}
        placeholders = [n for n in self.graph.nodes if n.op == "placeholder"]
        for n in placeholders:  # placeholders first, in input order (they were created as first read)
            remap[n] = graph.node_copy(n)
        for n in self.graph.nodes:
            if n.op != "placeholder":
                remap[n] = graph.node_copy(n, lambda a: remap[a])
        graph.output(tuple(remap[self.env[self.members[i]]] for i in outputs))
        graph.lint()
        return fx.GraphModule(self.root, graph)


def _canonical(graph: fx.Graph) -> tuple:
    """What makes two segments one library: each node's op, target and arguments (other nodes by
    position), and each input's shape, stride, dtype and device (constants are inputs too: blocks
    that read a constant each, one per layer, are one library)."""
    index: dict[fx.Node, int] = {}
    parts = []
    for i, node in enumerate(graph.nodes):
        index[node] = i
        if node.op == "placeholder":
            v = node.meta["val"]
            parts.append(("in", tuple(v.shape), tuple(v.stride()), str(v.dtype), str(v.device)))
        else:
            parts.append((node.op, str(node.target), _form(node.args, index), _form(node.kwargs, index)))
    return tuple(parts)


def _form(value, index):
    if isinstance(value, fx.Node):
        return ("@", index[value])
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_form(v, index) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple((k, _form(v, index)) for k, v in value.items()))
    if isinstance(value, torch.Tensor):  # never in stored graphs' arguments; never merged if it were
        return ("tensor", id(value))
    return (type(value).__name__, repr(value))


def _segments(body: list[fx.Node]) -> dict[fx.Node, int]:
    """Segment number of each node: repeated blocks one segment each, the rest between them one."""
    signatures = [_signature(n) for n in body]
    anchors = [str(n.target) in _ANCHORS or is_list_op(n) for n in body]
    starts = set()
    for start, period, count in _repeats(signatures, anchors):
        starts.update(start + k * period for k in range(count + 1))
    starts.discard(len(body))
    segment_of, segment = {}, -1
    for i, node in enumerate(body):
        if i in starts or i == 0:
            segment += 1
        segment_of[node] = segment
    return segment_of


def _signature(node: fx.Node):
    """A node's local form: its target, constants, and each argument's producer and shape (not
    where the argument is, which differs from block to block for saved activations)."""
    def arg(a):
        if isinstance(a, fx.Node):
            v = a.meta.get("val")
            shape = tuple(v.shape) if isinstance(v, torch.Tensor) else None
            return (a.op, str(a.target) if a.op == "call_function" else "", shape)
        if isinstance(a, (list, tuple)):
            return tuple(arg(x) for x in a)
        return repr(a)
    return (str(node.target), arg(node.args), arg(tuple(node.kwargs.items())))


def _repeats(signatures: list[tuple], anchors: list[bool]) -> list[tuple[int, int, int]]:
    """(start, period, count) of each run of ``count`` equal consecutive blocks of ``period`` nodes
    (compared by signature), not overlapping, found most frequent period first.

    Periods are the gaps between equal anchors (matrix products, convolutions, list ops: the work a
    library is worth its compile for), and every block holds an anchor: a region of small ops repeated per
    parameter (an optimizer's scalar bookkeeping) stays in the segment around it."""
    n = len(signatures)
    last: dict[tuple, int] = {}
    gaps: collections.Counter = collections.Counter()
    for i, s in enumerate(signatures):
        if not anchors[i]:
            continue
        if s in last and i - last[s] >= MIN_PERIOD:
            gaps[i - last[s]] += 1
        last[s] = i
    anchored = [0] * (n + 1)  # anchors before position i
    for i in range(n):
        anchored[i + 1] = anchored[i] + anchors[i]
    taken = [False] * n
    found = []
    for period, _ in gaps.most_common(_CANDIDATES):
        i = 0
        while i + period < n:
            if signatures[i] != signatures[i + period] or taken[i]:
                i += 1
                continue
            j = i
            while j + period < n and signatures[j] == signatures[j + period] and not taken[j + period]:
                j += 1
            count = (j - i + period) // period
            if count >= 2 and anchored[i + period] > anchored[i] and not any(taken[i:i + count * period]):
                found.append((i, period, count))
                for k in range(i, i + count * period):
                    taken[k] = True
            i = j + 1
    return sorted(found)


#: Ops a repeated block must hold to be a library of its own (``_repeats``), with the list ops
#: (``_foreach_*``) of an optimizer's update split per block (``kernel_list_ops``).
_ANCHORS = frozenset(str(op) for op in (
    torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
    torch.ops.aten.baddbmm.default, torch.ops.aten.convolution.default,
    torch.ops.aten.convolution_backward.default, torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default, torch.ops.aten._grouped_mm.default))

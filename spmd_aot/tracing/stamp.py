"""A deep stack of identical blocks, built from a trace of three blocks.

Tracing costs about a millisecond per operator call, so a step over N identical blocks costs N
times one block (``docs/scale.md``). The graph such a trace gives is regular: every node either
belongs to one block (a placeholder of its parameters or optimizer state; the nodes its forward
traced, gathers included; its backward, reduce-scatters included; its share of the optimizer's
per-parameter arithmetic) or to none (the embedding, the head, the loss, a multi-tensor
optimizer call over every parameter). The nodes of the blocks come in *sweeps*: runs of one
chunk per block, in block order or reversed (the forward ascending, the backward descending,
the optimizer ascending), and a list argument of a shared node (``_foreach_*``) lists its
blocks' tensors the same way.

``Template`` reads that structure off a trace of three blocks (first, middle, last; which node
belongs to which block comes from ``BlockLabels``, made from what the trace observed) and
``stamp(n)`` writes the graph of ``n`` blocks node by node in the order the full trace would
create them: block 0 and block ``n - 1`` from the first and last template blocks, every block
between from the middle one; a reference to a neighbouring block stays a reference to the
neighbour. Node names come from the same requests the trace makes (so they are the full trace's
names), fake values are fresh tensors with the template's aliasing, collective labels and
parameter names are renamed to the block. Whether that holds for a model is not assumed: the
caller stamps four blocks and compares the result with a trace of four (``signature``), and
falls back to the full trace on any difference.
"""

from __future__ import annotations

import contextlib
import dataclasses
import operator
import re

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx._lazy_graph_module import _LazyGraphModule

__all__ = ["BlockLabels", "NotRepeatable", "Template", "signature"]

_SUFFIX = re.compile(r"(.*)_(\d+)$")  # torch.fx's own rule for a name's numeric suffix
_CONSTANT = re.compile(r"_tensor_constant\d+")  # make_fx's names of lifted constants
TEMPLATE_DEPTH = 3  # first, middle and last block


class NotRepeatable(Exception):
    """The trace does not have the per-block structure stamping needs; the message says where."""


@dataclasses.dataclass
class BlockLabels:
    """What a template trace observed: node positions (counts of graph nodes when it happened)."""

    prefix: str  # the blocks' FQN prefix, e.g. "layers." (block i is prefix + str(i))
    placeholder_blocks: list[int | None]  # per placeholder: the block whose state it is, or None
    forward_start: dict[int, int]  # block -> position its forward began at
    forward_end: dict[int, int]
    backward_start: dict[int, int]  # block -> position its output's gradient arrived at
    last_leaf_gradient: dict[int, int]  # block -> position its last parameter gradient was stored at
    step_start: int | None  # position the optimizer step began at (None: forward-only)


def _block_spans(labels: BlockLabels, d: int) -> list[tuple[int, int, int, str]]:
    """(start, end, block, "F" or "B"): the positions of each block's forward (up to the next
    block's) and backward (up to the previous block's, for block 0 up to its last parameter
    gradient), in order; refused when they are missing or overlap."""
    spans = []
    for i in range(d):
        if i not in labels.forward_start:
            raise NotRepeatable(f"block {i}'s forward did not run")
        end = labels.forward_start[i + 1] if i + 1 < d else labels.forward_end[i]
        spans.append((labels.forward_start[i], end, i, "F"))
    if labels.backward_start:
        if sorted(labels.backward_start) != list(range(d)) or 0 not in labels.last_leaf_gradient:
            raise NotRepeatable("not every block's backward was observed (a block output or parameter "
                                "without a gradient)")
        for i in range(d):
            end = labels.backward_start[i - 1] if i else labels.last_leaf_gradient[0]
            spans.append((labels.backward_start[i], end, i, "B"))
    spans.sort()
    for (s0, e0, *_), (s1, *_) in zip(spans, spans[1:]):
        if not s0 <= e0 <= s1:
            raise NotRepeatable("the blocks' forwards and backwards overlap in the trace")
    return spans


def _label_nodes(gm: torch.fx.GraphModule, labels: BlockLabels, d: int):
    """node -> (block, region) for a block's node, None for a shared one; and, per shared node
    with a list argument naming blocks' nodes, the block of each list position."""
    spans = _block_spans(labels, d)
    first_forward = labels.forward_start[0]
    label: dict[torch.fx.Node, tuple[int, str] | None] = {}
    elements: dict[torch.fx.Node, list[int | None]] = {}
    placeholders = iter(labels.placeholder_blocks)
    span_index = 0
    for pos, node in enumerate(gm.graph.nodes):
        if node.op == "placeholder":
            block = next(placeholders)
            label[node] = None if block is None else (block, "P")
            continue
        while span_index < len(spans) and spans[span_index][1] <= pos:
            span_index += 1
        if span_index < len(spans) and spans[span_index][0] <= pos < spans[span_index][1]:
            label[node] = spans[span_index][2:]
            continue
        label[node] = None
        listed = _listed_blocks(node, label)
        if listed is not None:
            elements[node] = listed
        if node.op == "call_function" and (pos < first_forward or (labels.step_start is not None
                                                                  and pos >= labels.step_start)):
            label[node] = _dataflow_label(node, label, elements)
            if label[node] is not None:
                elements.pop(node, None)  # a block's own node: its lists are copied as they are
        elif node.target is operator.getitem and node.args[0] in elements:  # an item of a block (clipping's norms)
            label[node] = _dataflow_label(node, label, elements)
    return label, elements


def _listed_blocks(node, label) -> list[int | None] | None:
    """The block of each entry of ``node``'s first list argument that names a block's node."""
    for arg in list(node.args) + list(node.kwargs.values()):
        if isinstance(arg, (list, tuple)) and any(isinstance(a, torch.fx.Node) and label.get(a) for a in arg):
            return [label[a][0] if isinstance(a, torch.fx.Node) and label.get(a) else None for a in arg]
    return None


def _dataflow_label(node, label, elements):
    """Outside the blocks' forward and backward (the leaves made before the forward, the
    optimizer step): a node is a block's when the tensors it reads directly are that block's."""
    blocks = set()
    if node.target is operator.getitem and node.args[0] in elements:
        listed = elements[node.args[0]]
        if node.args[1] < len(listed) and listed[node.args[1]] is not None:
            return (listed[node.args[1]], "R")
        return None
    for arg in list(node.args) + list(node.kwargs.values()):
        if isinstance(arg, torch.fx.Node) and label.get(arg):
            blocks.add(label[arg][0])
    return (blocks.pop(), "R") if len(blocks) == 1 else None


@dataclasses.dataclass
class _Sweep:
    chunks: list[list]  # in block order 0..d-1
    ascending: bool


def _sweeps(items: list, d: int, what: str) -> list:
    """``items``: (key, block, payload), in order; consecutive entries with one key (not None)
    form a block's chunk, and consecutive chunks form sweeps of one chunk per block, in block
    order or reversed. A shared entry (key None) stays as it is. Returns shared payloads and
    ``_Sweep``s, in sequence."""
    out: list = []
    run: list = []  # (block, chunk)
    last_key = None

    def close():
        while run:
            group, rest = run[:d], run[d:]
            blocks = [b for b, _ in group]
            if blocks != list(range(d)) and blocks != list(range(d))[::-1]:
                raise NotRepeatable(f"{what}: the blocks' nodes do not come one block after another "
                                    f"(blocks {blocks[:8]})")
            out.append(_Sweep([c for _, c in sorted(group, key=lambda e: e[0])], blocks[0] == 0))
            run[:] = rest

    for key, block, payload in items:
        if key is None:
            close()
            out.append(payload)
        elif run and key == last_key:
            run[-1][1].append(payload)
        else:
            run.append((block, [payload]))
        last_key = key
    close()
    return out


class Template:
    """The graph of ``TEMPLATE_DEPTH`` blocks, read as shared nodes and sweeps (see module doc)."""

    def __init__(self, gm: torch.fx.GraphModule, labels: BlockLabels):
        d = TEMPLATE_DEPTH
        self.gm, self.prefix = gm, labels.prefix
        self.label, self.elements = _label_nodes(gm, labels, d)
        items = [(self.label[n], self.label[n] and self.label[n][0], n) for n in gm.graph.nodes]
        self.sequence = _sweeps(items, d, "the traced step")
        self.where: dict[torch.fx.Node, tuple[int, int, int]] = {}  # node -> (sweep, block, offset)
        for s, entry in enumerate(self.sequence):
            if isinstance(entry, _Sweep):
                for block, chunk in enumerate(entry.chunks):
                    for offset, node in enumerate(chunk):
                        self.where[node] = (s, block, offset)
        names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
        if names != [f"arg{i}_1" for i in range(len(names))]:
            raise NotRepeatable("the traced inputs are not named argN_1")
        self.owner, self.position = _storage_owners(gm)

    def stamp(self, n: int) -> tuple[torch.fx.GraphModule, dict[torch.fx.Node, list]]:
        """The graph of ``n`` blocks, and per template node its copies: (new node, context),
        the context None for a shared node, else (template block, new block)."""
        if n < TEMPLATE_DEPTH:
            raise ValueError(f"stamping needs at least {TEMPLATE_DEPTH} blocks, got {n}")
        return _Stamper(self, n).run()


class _StampedGraphModule(_LazyGraphModule):
    """A stamped graph's module: its Python code is generated when read and compiled when first
    called (not when made, as a ``GraphModule`` does). A build reads the code once, after its
    passes, to store it as text, and never calls the module; compiling 30,000 lines it does not
    run cost more than generating them."""

    @property
    def code(self) -> str:
        if self._needs_recompile():
            from torch.fx.experimental import _config

            with _unindexed(self.graph):
                return self.graph.python_code(root_module="self", record_func=_config.enrich_profiler_metadata).src
        return super().code


@contextlib.contextmanager
def _unindexed(graph: torch.fx.Graph):
    """The graph's (op, target) index of its nodes set aside while its code is generated.

    Why: code generation sets and then resets an attribute on every node (``_repr_fn``), and
    each assignment to a node attribute takes the node out of that index and puts it back (a
    quarter of generating a stamped graph's 3.7 MB of code). The attribute is not part of the
    index's key and nothing reads the index meanwhile, so it is the same index afterwards. A
    torch without the index generates the code as it is."""
    index = graph.__dict__.pop("_find_nodes_lookup_table", None)
    try:
        yield
    finally:
        if index is not None:
            graph._find_nodes_lookup_table = index


def _create_node(graph: torch.fx.Graph, op: str, target, args: tuple, kwargs: dict, name: str) -> torch.fx.Node:
    """``graph.create_node``, less its walk of every argument for symbolic sizes (a warning
    only, a fifth of a stamp's cost): a stamped node's arguments are its template node's, which
    the trace created through ``create_node``, with nodes exchanged for nodes. The node is
    created bare and given its arguments as a pass rewires them (the ``args``/``kwargs``
    setters, which account for uses), so names, users and the graph's indexes are as
    ``create_node`` leaves them."""
    new = graph.create_node(op, target, name=name)
    if args:
        new.args = args
    if kwargs:
        new.kwargs = kwargs
    return new


def _template_block(k: int, n: int) -> int:
    return 0 if k == 0 else TEMPLATE_DEPTH - 1 if k == n - 1 else 1


def _storage_key(t: torch.Tensor):
    return t.untyped_storage()._cdata


def _tensors(val):
    if isinstance(val, torch.Tensor):
        yield val
    elif isinstance(val, (list, tuple)):
        for v in val:
            yield from _tensors(v)


def _storage_owners(gm) -> tuple[dict, dict]:
    """storage -> the first node whose value uses it (the node that made it), and (that node,
    storage) -> the position of the storage's first tensor in the node's value."""
    owner: dict = {}
    position: dict = {}
    for node in gm.graph.nodes:
        for i, t in enumerate(_tensors(node.meta.get("val"))):
            key = _storage_key(t)
            if key not in owner:
                owner[key] = node
                position[(node, key)] = i
    return owner, position


class _Stamper:
    """One ``Template.stamp``: emits nodes in the full trace's order into a new graph."""

    def __init__(self, template: Template, n: int):
        self.t, self.n = template, n
        self.graph = torch.fx.Graph()
        self.shared: dict[torch.fx.Node, torch.fx.Node] = {}
        self.chunks: dict[tuple[int, int], list[torch.fx.Node]] = {}  # (sweep, new block) -> nodes
        self.index_maps: dict[torch.fx.Node, dict] = {}  # new shared node -> (template index, block) -> index
        self.fresh: dict[tuple[int, int], torch.Tensor] = {}  # (id(new node), template storage) -> tensor
        self.values: dict[int, list[torch.Tensor]] = {}  # id(new node) -> the tensors of its value, in order
        self.copies: dict[torch.fx.Node, list] = {}
        self.placeholders = 0
        self.constants: dict[str, torch.Tensor] = {}  # lifted constants, by their new name
        self.resized: set[torch.fx.Node] = set()  # shared template nodes whose copy has another shape
        self._current: torch.fx.Node | None = None  # the template node being copied

    def run(self):
        for s, entry in enumerate(self.t.sequence):
            if isinstance(entry, _Sweep):
                for k in (range(self.n) if entry.ascending else range(self.n - 1, -1, -1)):
                    tb = _template_block(k, self.n)
                    chunk = self.chunks[(s, k)] = []
                    for node in entry.chunks[tb]:
                        chunk.append(self._emit(node, (tb, k)))
            else:
                self.shared[entry] = self._emit(entry, None)
        # lazy: the build generates the code once, after its passes (a 30,000-node graph takes seconds)
        root = torch.nn.Module()
        for name, value in self.constants.items():
            setattr(root, name, value)
        gm = _StampedGraphModule(root, self.graph)
        return gm, self.copies

    # -- references ---------------------------------------------------------------------
    def ref(self, node: torch.fx.Node, ctx) -> torch.fx.Node:
        """The new node standing for template ``node`` read from a node of context ``ctx``
        ((template block, new block), or None for a shared node)."""
        where = self.t.where.get(node)
        if where is None:
            return self.shared[node]
        s, j, offset = where
        if ctx is None:
            if j not in (0, TEMPLATE_DEPTH - 1):
                raise NotRepeatable(f"shared node reads {node.name} of a middle block")
            k = 0 if j == 0 else self.n - 1
        else:
            k = ctx[1] + j - ctx[0]
        chunk = self.chunks.get((s, k))
        if chunk is None or offset >= len(chunk) or chunk[offset].op != node.op or \
                (node.op == "call_function" and chunk[offset].target != node.target):
            raise NotRepeatable(f"{node.name} has no counterpart in block {k}")
        return chunk[offset]

    def _map(self, value, ctx):
        return torch.fx.node.map_arg(value, lambda node: self.ref(node, ctx))

    def _expansion(self, node) -> list[tuple[int, tuple | None]] | None:
        """For a shared node listing blocks' tensors: per new list position, (template position,
        context); None when its lists do not list blocks."""
        listed = self.t.elements.get(node)
        if listed is None:
            return None
        plan = []
        entries = [(b, b, i) for i, b in enumerate(listed)]
        for entry in _sweeps(entries, TEMPLATE_DEPTH, f"the lists of {node.name}"):
            if isinstance(entry, _Sweep):
                order = range(self.n) if entry.ascending else range(self.n - 1, -1, -1)
                for k in order:
                    tb = _template_block(k, self.n)
                    plan += [(i, (tb, k)) for i in entry.chunks[tb]]
            else:
                plan.append((entry, None))
        return plan

    def _expand(self, value, plan, size):
        if isinstance(value, (list, tuple)) and len(value) == size:
            return type(value)(self._map(value[i], ctx) for i, ctx in plan)
        return self._map(value, None)

    # -- nodes ----------------------------------------------------------------------------
    def _emit(self, node: torch.fx.Node, ctx) -> torch.fx.Node:
        plan = self._expansion(node) if ctx is None else None
        size = len(self.t.elements[node]) if plan is not None else -1
        if plan is not None:
            args = tuple(self._expand(a, plan, size) for a in node.args)
            kwargs = {k: self._expand(v, plan, size) for k, v in node.kwargs.items()}
        else:
            args, kwargs = self._map(node.args, ctx), self._map(node.kwargs, ctx)
        if node.target is operator.getitem and node.args[0] in self.t.elements:
            index_map = self.index_maps[args[0]]
            args = (args[0], index_map[(node.args[1], None if ctx is None else ctx[1])])
        if node.op == "placeholder":
            name = f"arg{self.placeholders}_1"
            self.placeholders += 1
        elif node.op == "get_attr":  # a constant make_fx lifted: named in order, as the trace names them
            if not _CONSTANT.fullmatch(node.target):
                raise NotRepeatable(f"the graph reads attribute {node.target}")
            name = f"_tensor_constant{len(self.constants)}"
            self.constants[name] = getattr(self.t.gm, node.target)
        else:
            match = _SUFFIX.match(node.name)
            name = match.group(1) if match else node.name
        target = name if node.op in ("placeholder", "get_attr") else node.target  # its name, for these
        new = _create_node(self.graph, node.op, target, args, kwargs, name)
        if plan is not None:
            self.index_maps[new] = {(i, None if c is None else c[1]): pos for pos, (i, c) in enumerate(plan)}
        self._current = node
        new.meta.update(self._meta(node, new, ctx, plan, size))  # in place: assigning re-indexes the node
        self.values[id(new)] = list(_tensors(new.meta.get("val")))
        self.copies.setdefault(node, []).append((new, ctx))
        return new

    def _meta(self, node, new, ctx, plan, size) -> dict:
        meta = dict(node.meta)
        val = node.meta.get("val")
        if plan is not None and isinstance(val, (list, tuple)) and len(val) == size:
            meta["val"] = type(val)(self._value(val[i], new, c) for i, c in plan)
            tm = node.meta.get("tensor_meta")
            if isinstance(tm, (list, tuple)) and len(tm) == size:
                meta["tensor_meta"] = type(tm)(tm[i] for i, _ in plan)
        elif ctx is None and isinstance(val, torch.Tensor) and \
                (plan is not None or any(a in self.resized for a in node.all_input_nodes)):
            meta["val"] = self._recomputed(node, new, val)  # e.g. clipping's stacked per-parameter norms
            meta.pop("tensor_meta", None)
            if meta["val"].shape != val.shape:
                self.resized.add(node)
        elif val is not None:
            meta["val"] = self._value(val, new, ctx)
        if ctx is not None and "comm" in meta:
            meta["comm"] = self.rename(meta["comm"], ctx)
        return meta

    def _recomputed(self, node, new, val) -> torch.Tensor:
        """A shared node's value from its new arguments' (its lists grew, or what it reads did):
        the op run on fake tensors, which also gives its aliasing."""
        if not isinstance(node.target, torch._ops.OpOverload):
            raise NotRepeatable(f"{node.name}'s value depends on the number of blocks")
        args, kwargs = torch.fx.node.map_arg((new.args, new.kwargs), lambda n: n.meta.get("val"))
        with self._mode(val):
            out = node.target(*args, **kwargs)
        if not isinstance(out, torch.Tensor):
            raise NotRepeatable(f"{node.name}'s value depends on the number of blocks")
        return out

    def rename(self, value, ctx):
        """FQNs and labels of template block ``ctx[0]`` made block ``ctx[1]``'s: a label names
        its block's modules inside text too (tensor parallel's ``tp layers.1.mlp.2 output``), so
        every whole name of the block in a string is renamed, not only a leading one."""
        if isinstance(value, str):
            old = f"{self.t.prefix}{ctx[0]}"
            new = f"{self.t.prefix}{ctx[1]}"
            if value == old or value.startswith(old + "."):
                value = new + value[len(old):]
            if self.t.prefix and old in value:  # without a prefix a block's name is a bare number
                value = re.sub(rf"(?<![\w.]){re.escape(old)}(?=[.\s]|$)", new, value)
            return value
        if isinstance(value, (list, tuple)):
            return type(value)(self.rename(v, ctx) for v in value)
        if isinstance(value, dict):
            return {k: self.rename(v, ctx) for k, v in value.items()}
        return value

    def _value(self, val, new, ctx):
        if isinstance(val, (list, tuple)):
            return type(val)(self._value(v, new, ctx) for v in val)
        if not isinstance(val, torch.Tensor):
            return val
        key = _storage_key(val)
        owner = self.t.owner[key]
        base = self.fresh.get((id(new), key))
        if base is None:
            if owner is self._current:
                return self._fresh(val, new, key)
            base = self._counterpart(owner, key, ctx)
        if base.dtype != val.dtype:
            raise NotRepeatable(f"a value of {owner.name} is viewed as another dtype")
        if (base.shape, base.stride(), base.storage_offset()) == (val.shape, val.stride(), val.storage_offset()):
            return base
        meta = torch.empty(0, dtype=val.dtype, device="meta").set_(
            base.untyped_storage(), val.storage_offset(), val.shape, val.stride())
        return FakeTensor(self._mode(val), meta, val.device)

    def _counterpart(self, owner, key, ctx) -> torch.Tensor:
        """The tensor standing for ``owner``'s storage ``key`` in the copy a node of ``ctx`` reads."""
        new_owner = self.ref(owner, ctx)
        position = self.t.position[(owner, key)]
        index_map = self.index_maps.get(new_owner)
        if index_map is not None:
            position = index_map.get((position, None if ctx is None else ctx[1]), -1)
        made = self.values.get(id(new_owner), [])
        if not 0 <= position < len(made):
            raise NotRepeatable(f"the storage of {owner.name} has no counterpart")
        return made[position]

    def _fresh(self, val, new, key) -> torch.Tensor:
        """A new fake tensor with ``val``'s geometry over a new storage of its storage's size,
        made on the meta device and wrapped (the fake mode's dispatch costs ~0.3 ms a call)."""
        nbytes = val.untyped_storage().nbytes()
        if val.storage_offset() == 0 and nbytes == val.numel() * val.element_size() and val.is_contiguous():
            meta = torch.empty_strided(val.shape, val.stride(), dtype=val.dtype, device="meta")
        else:
            meta = torch.empty(nbytes // val.element_size(), dtype=val.dtype, device="meta").as_strided(
                val.shape, val.stride(), val.storage_offset())
        made = FakeTensor(self._mode(val), meta, val.device)
        self.fresh[(id(new), key)] = made
        return made

    def _mode(self, val):
        mode = getattr(val, "fake_mode", None)
        if mode is None:
            raise NotRepeatable("a traced value is not a fake tensor")
        return mode


def signature(gm: torch.fx.GraphModule) -> list[tuple]:
    """Every node as comparable data: op, name, target, arguments by name, each value's
    geometry and the node that made its storage, its collective label. Two graphs with equal
    signatures are the same program with the same metadata."""
    owner: dict = {}
    out = []
    for node in gm.graph.nodes:
        vals = []
        for t in _tensors(node.meta.get("val")):
            made_by = owner.setdefault(_storage_key(t), node.name)
            vals.append((tuple(t.shape), t.stride(), t.storage_offset(), str(t.dtype), made_by))
        constant = _constant(getattr(gm, node.target)) if node.op == "get_attr" else None
        out.append((node.op, node.name, str(node.target), _described(node.args), _described(node.kwargs),
                    tuple(vals), repr(node.meta.get("comm")), constant))
    return out


def _described(value):
    if isinstance(value, torch.fx.Node):
        return ("%", value.name)
    if isinstance(value, (list, tuple)):
        return tuple(_described(v) for v in value)
    if isinstance(value, dict):
        return tuple((k, _described(v)) for k, v in value.items())
    return repr(value)


def _constant(value) -> tuple:
    if not isinstance(value, torch.Tensor):
        return (type(value).__name__,)
    import hashlib

    data = value.detach().cpu().clone(memory_format=torch.contiguous_format)  # its own storage, exactly its bytes
    digest = hashlib.sha256(bytes(data.untyped_storage())).hexdigest() if data.numel() else ""
    return (tuple(value.shape), str(value.dtype), digest)

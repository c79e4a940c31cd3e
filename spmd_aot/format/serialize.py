"""An FX graph as plain data (msgpack), and back, without ever running stored code.

Encoding keeps only what execution needs: each node's opcode, its target as an operator name,
and its arguments as tagged values. Node metadata and stack traces are dropped (they hold
paths and object reprs). Decoding reads one node at a time within ``limits.LoadLimits``,
resolves every target against the overload allowlist (``allowlist.py``; encoding refuses the
same ops, so a graph the loader would refuse is never stored), checks every argument against
the op's schema (names, count, and the typed kinds below), validates every name and value,
and raises ``UnsafeArtifactError`` / ``CorruptArtifactError`` otherwise.

Typed kinds: process-group names are stored only as ``{"~group": mesh_dim}`` (or ``"world"``
for a group of every rank), only in a collective's ``group_name`` argument, which accepts
nothing else; devices are stored as their type only (``{"~device": "cuda"}``), only in
``Device`` arguments. So one artifact serves every rank; ``decode_graph`` binds both to the
live job.
"""

from __future__ import annotations

import functools
import keyword
import operator
import re
from typing import Any
from collections.abc import Callable

import msgpack
import torch

from . import bounded
from .allowlist import ENV_ALLOW_OPS, REFUSED_OVERLOADS, is_allowed, refusal
from ..errors import CorruptArtifactError, OpNotAllowedError, UnsafeArtifactError
from .limits import LoadLimits, load_limits

__all__ = ["encode_graph", "decode_graph", "to_fx_graph", "Ref", "refs_in", "has_ref", "DecodedNode", "GRAPH_FORMAT",
           "resolve_target"]

GRAPH_FORMAT = 1
_PYTHON_CALLABLES: dict[str, Callable] = {"operator.getitem": operator.getitem}
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,200}\Z")
_OPCODES = ("placeholder", "call_function", "get_attr", "output")
_NODE_FIELDS = frozenset({"op", "name", "target", "args", "kwargs"})
_ENUMS = {
    "~dtype": (torch.dtype, lambda v: str(v).removeprefix("torch.")),
    "~layout": (torch.layout, lambda v: str(v).removeprefix("torch.")),
    "~memory_format": (torch.memory_format, lambda v: str(v).removeprefix("torch.")),
}


# ---------------------------------------------------------------------------- encode
def encode_graph(graph: torch.fx.Graph, group_names: dict[str, int]) -> bytes:
    """Graph -> msgpack bytes. ``group_names`` maps traced process-group names to mesh dims."""
    nodes = []
    by_target: dict = {}  # id(target) -> (name, argument names, group arguments): checked once per target
    for node in graph.nodes:
        if node.op not in _OPCODES:
            raise UnsafeArtifactError(f"cannot store node {node.name} with opcode {node.op}")
        if node.op == "call_function":
            known = by_target.get(id(node.target))  # the graph holds its targets: ids stay unique
            if known is None:  # a refused target raises here, at its first node
                known = by_target[id(node.target)] = (_target_name(node), _argument_names(node),
                                                  _group_argument_names(node))
            target, schema_names, groups = known
        else:
            target, schema_names, groups = node.target, (), _group_argument_names(node)
        args = [
            _encode_group(v, group_names) if i < len(schema_names) and schema_names[i] in groups
            else _encode(v)
            for i, v in enumerate(node.args)
        ]
        kwargs = {k: _encode_group(v, group_names) if k in groups else _encode(v)
                  for k, v in node.kwargs.items()}
        nodes.append({"op": node.op, "name": node.name, "target": target, "args": args, "kwargs": kwargs})
    return msgpack.packb({"format": GRAPH_FORMAT, "nodes": nodes}, use_bin_type=True)


def _target_name(node: torch.fx.Node) -> str:
    t = node.target
    if isinstance(t, torch._ops.OpOverload):
        name = f"{t.namespace}::{t._opname}.{t._overloadname}"
        why = refusal(t._opname) or REFUSED_OVERLOADS.get(name)
        if why:  # no opt-in admits a refused family: offering one would be a dead end
            raise UnsafeArtifactError(
                f"node {node.name} calls {name}, which loading refuses and no opt-in can allow: it {why}. "
                "Write the step without it; `spmd-aot ops` lists the allowlist")
        if not is_allowed(name):
            raise UnsafeArtifactError(
                f"node {node.name} calls {name}, which loading refuses: it is not on the op allowlist. Write "
                f"the step without it, or opt in to it on the build and on every job that loads it "
                f"(allow_ops=[{name!r}], CLI --allow-op {name}, or ${ENV_ALLOW_OPS}); `spmd-aot ops` lists "
                "the allowlist")
        return name
    for name, fn in _PYTHON_CALLABLES.items():
        if t is fn:
            return name
    raise UnsafeArtifactError(f"node {node.name} calls {t!r}, which is not an allowed op")


def _argument_names(node) -> list[str]:
    if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
        return [a.name for a in node.target._schema.arguments]
    return []


def _group_argument_names(node) -> set[str]:
    if getattr(node.target, "namespace", None) == "_c10d_functional":
        return {"group_name"}
    return set()


def _encode(value) -> Any:
    if isinstance(value, torch.fx.Node):
        return {"~node": value.name}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, tuple):
        return {"~tuple": [_encode(v) for v in value]}
    if isinstance(value, list):
        return {"~list": [_encode(v) for v in value]}
    if isinstance(value, torch.device):
        return {"~device": value.type}
    for tag, (cls, name) in _ENUMS.items():
        if isinstance(value, cls):
            return {tag: name(value)}
    if isinstance(value, slice):
        return {"~slice": [_encode(v) for v in (value.start, value.stop, value.step)]}
    raise UnsafeArtifactError(f"cannot store a graph argument of type {type(value).__name__}: {value!r}")


def _encode_group(value, group_names):
    if not isinstance(value, str) or value not in group_names:
        raise UnsafeArtifactError(
            f"collective uses process group {value!r}, which is not a dimension of the device mesh"
        )
    return {"~group": group_names[value]}


# ---------------------------------------------------------------------------- decode
class Ref:
    """A decoded reference to the value of node number ``index`` (graph order)."""

    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index

    def __repr__(self):
        return f"Ref({self.index})"

    def __reduce__(self):  # copied as the call ``Ref(index)`` (records store it as ``{"r": index}``)
        return Ref, (self.index,)


def _walk(value, stop_at_first: bool) -> set[int]:
    """Indices of the ``Ref``s inside a decoded value (lists, tuples, maps, slices); with
    ``stop_at_first``, at most the first one found. A loop, not a generator: program
    construction asks this of every node."""
    out: set[int] = set()
    stack = [value]
    containers = (list, tuple, dict, slice)
    while stack:
        x = stack.pop()
        if isinstance(x, Ref):
            out.add(x.index)
            if stop_at_first:
                return out
            continue
        if isinstance(x, dict):
            x = x.values()
        elif isinstance(x, slice):
            x = (x.start, x.stop, x.step)
        elif not isinstance(x, (list, tuple)):
            continue
        for y in x:
            if isinstance(y, Ref):
                out.add(y.index)
                if stop_at_first:
                    return out
            elif isinstance(y, containers):
                stack.append(y)
    return out


def refs_in(value) -> set[int]:
    """Indices of every ``Ref`` inside a decoded value."""
    return _walk(value, stop_at_first=False)


def has_ref(value) -> bool:
    """Any ``Ref`` inside a decoded value (stops at the first)."""
    kind = type(value)
    if kind is Ref:
        return True
    if kind is not list and kind is not tuple and kind is not dict and kind is not slice or not value:
        return False  # a scalar, a dtype, a device, ``{}``: program construction asks this of every argument
    return bool(_walk(value, stop_at_first=True))


class DecodedNode:
    """One validated node. ``refs``: the indices of every value it reads (args and kwargs),
    known once: folding, its safety check and the program's last-use table all ask. The
    decoder passes what it saw while decoding; anyone else gets them walked."""

    __slots__ = ("op", "name", "target", "args", "kwargs", "refs")

    def __init__(self, op: str, name: str, target: Any, args: tuple, kwargs: dict,
                 refs: frozenset[int] | None = None):
        self.op = op  # placeholder | call_function | get_attr | output
        self.name = name
        self.target = target  # resolved OpOverload / operator.getitem, attribute name, or the node name
        self.args = args
        self.kwargs = kwargs
        self.refs = frozenset(refs_in(args) | refs_in(kwargs)) if refs is None else refs

    def __repr__(self):
        return f"DecodedNode({self.op}, {self.name}, {self.target}, {self.args}, {self.kwargs})"


def decode_graph(data: bytes, *, groups: list[str], device: torch.device,
                 limits: LoadLimits | None = None, world: str | None = None) -> list[DecodedNode]:
    """msgpack bytes -> validated nodes, bound to live process groups and the local device.

    ``groups[d]`` is the live group name of mesh dimension ``d``; a world group is taken as
    the default process group, or ``world`` when given (``program_blob.py`` binds both to
    placeholders, to bind them to the live groups at load).

    Values that refer to other nodes are ``Ref``s. Raises ``UnsafeArtifactError`` for a target
    outside the allowlist and ``CorruptArtifactError`` for anything else malformed; nothing
    stored is executed. ``to_fx_graph`` and ``program.Program`` consume the result.
    """
    limits = limits or load_limits()
    if len(data) > limits.graph_bytes:
        raise CorruptArtifactError(
            f"graph blob is {len(data)} bytes, more than the load limit graph_bytes={limits.graph_bytes}; "
            "if the artifact is yours, raise it with SPMD_AOT_LOAD_LIMITS=graph_bytes=...")
    try:
        count, start = _header(data, limits)
        nodes = _unpacker(memoryview(data)[start:], count, limits)
        return _Decoder(groups, device, limits, world).document(nodes, count)
    except CorruptArtifactError:
        raise
    except Exception as exc:  # msgpack raises several types for garbage
        raise CorruptArtifactError(f"graph blob is malformed: {type(exc).__name__}: {exc}") from None


def _header(data: bytes, limits: LoadLimits) -> tuple[int, int]:
    """(node count, offset of the first node) of ``{"format": 1, "nodes": [...]}``, in that order."""
    reader = msgpack.Unpacker(raw=False, strict_map_key=True, max_buffer_size=max(len(data), 1),
                              max_str_len=16, max_bin_len=0, max_array_len=0, max_map_len=2, max_ext_len=0)
    reader.feed(data)
    if reader.read_map_header() != 2 or reader.unpack() != "format":
        raise CorruptArtifactError("graph blob is not a map of format and nodes")
    found = reader.unpack()
    if found != GRAPH_FORMAT or isinstance(found, bool):
        raise CorruptArtifactError(f"graph format is {str(found)[:40]!r}, expected {GRAPH_FORMAT}")
    if reader.unpack() != "nodes":
        raise CorruptArtifactError("graph blob has no node list after its format")
    count = reader.read_array_header()
    if count > limits.nodes:
        raise CorruptArtifactError(
            f"graph has {count} nodes, more than the load limit nodes={limits.nodes}; if the "
            "artifact is yours, raise it with SPMD_AOT_LOAD_LIMITS=nodes=...")
    return count, reader.tell()


def _unpacker(data, count: int, limits: LoadLimits) -> msgpack.Unpacker:
    """A streaming reader of the node list: nodes are decoded one at a time, so memory follows
    the nodes kept, and all of them together may build at most ``objects_per_node`` objects
    per declared node (``bounded``)."""
    return bounded.unpacker(data, "graph blob", objects=limits.objects_per_node * count + 64,
                            max_array=limits.items, max_map=_MAX_MAP, max_str=_MAX_STR)


# A node map has 5 entries, a tagged value 1, kwargs at most one per schema argument.
_MAX_MAP, _MAX_STR = 256, 1 << 16


def to_fx_graph(nodes: list[DecodedNode]) -> torch.fx.Graph:
    """Decoded nodes -> an ``fx.Graph`` (for inspection and tests; jobs run a ``Program``)."""
    graph = torch.fx.Graph()
    env: list[torch.fx.Node] = []

    def fx(v):
        if isinstance(v, Ref):
            return env[v.index]
        if isinstance(v, (list, tuple)):
            return type(v)(fx(x) for x in v)
        if isinstance(v, slice):
            return slice(fx(v.start), fx(v.stop), fx(v.step))
        return v

    for n in nodes:
        env.append(graph.create_node(n.op, n.target, fx(n.args), {k: fx(v) for k, v in n.kwargs.items()},
                                     name=n.name))
    graph.lint()
    return graph


_ANY, _GROUP, _DEVICE = "any", "group", "device"
_NO_OP = (None, (), None)  # ``op_kinds`` of a node that calls nothing


@functools.cache
def _argument_kinds(op) -> tuple[tuple[str, ...], dict[str, str]]:
    """(kind of each positional argument, kind of each keyword argument) from the op's schema."""
    positional, keyword_only = [], {}
    collective = op.namespace == "_c10d_functional"
    for arg in op._schema.arguments:
        kind = (_GROUP if collective and arg.name == "group_name"
                else _DEVICE if str(arg.type) in ("Device", "Optional[Device]") else _ANY)
        keyword_only[arg.name] = kind
        if not arg.kwarg_only:
            positional.append(kind)
    return tuple(positional), keyword_only


class _Decoder:
    def __init__(self, groups: list[str], device: torch.device, limits: LoadLimits, world: str | None = None):
        self.limits = limits
        self.read: set[int] = set()  # the nodes the node being decoded refers to
        self.groups: dict = dict(enumerate(groups))
        if groups and world is not None:
            self.groups["world"] = world
        elif groups:
            import torch.distributed as dist

            self.groups["world"] = dist.group.WORLD.group_name if dist.is_initialized() else groups[0]
        self.device = device
        self.index: dict[str, int] = {}
        self.refs: list[Ref] = []  # one ``Ref`` per decoded node, shared by its readers
        self.targets: dict[str, Callable] = {}
        self.kinds: dict[str, tuple] = {}  # op name -> ``op_kinds``

    def document(self, unpacker: msgpack.Unpacker, count: int) -> list[DecodedNode]:
        """The ``count`` nodes after the header, and nothing after them."""
        out = self.nodes(unpacker.unpack() for _ in range(count))
        try:
            unpacker.unpack()
        except msgpack.OutOfData:
            return out
        raise CorruptArtifactError("graph blob has bytes after its node list")

    def nodes(self, entries) -> list[DecodedNode]:
        """Validate and resolve each raw node entry. Written for speed (a load decodes every node
        of the step): locals instead of attribute lookups, each op's schema kinds looked up once
        per target name, and references and scalars taken without a call (``arguments``)."""
        out: list[DecodedNode] = []
        index, name_ok, is_keyword = self.index, _NAME.match, keyword.iskeyword
        last_op = None
        for entry in entries:
            if type(entry) is not dict or len(entry) != 5 or not _NODE_FIELDS.issuperset(entry):
                raise CorruptArtifactError(f"malformed node entry {str(entry)[:80]}")
            op, name = entry["op"], entry["name"]
            if op not in _OPCODES:
                raise UnsafeArtifactError(f"node opcode {str(op)[:40]!r} is not allowed")
            if type(name) is not str or not name_ok(name) or is_keyword(name) or name in index:
                raise CorruptArtifactError(f"invalid or duplicate node name {str(name)[:80]!r}")
            if last_op == "output":
                raise CorruptArtifactError("nodes after the output node")
            raw_args, raw_kwargs = entry["args"], entry["kwargs"]
            if type(raw_args) is not list or type(raw_kwargs) is not dict:
                raise CorruptArtifactError(f"node {name}: args must be a list and kwargs a map")
            target, positional, by_name = self.op_kinds(entry["target"]) if op == "call_function" else _NO_OP
            if by_name is not None and len(raw_args) > len(positional):
                raise CorruptArtifactError(f"node {name}: {len(raw_args)} arguments for "
                                           f"{target}, which takes {len(positional)} positionally")
            self.read = set()
            args = self.arguments(raw_args, positional) if raw_args else ()
            kwargs = {}
            for k, v in raw_kwargs.items():
                k = self.kwarg_name(k)
                if by_name is not None and k not in by_name:
                    raise CorruptArtifactError(f"node {name}: {target} has no argument {k!r}")
                kwargs[k] = self.value(v, kind=by_name[k] if by_name is not None else _ANY)
            if by_name is not None:
                self.check_groups(name, target, raw_args, raw_kwargs, positional)
            if op == "placeholder":
                if last_op is not None and last_op != "placeholder":
                    raise CorruptArtifactError(f"placeholder {name} after non-placeholder nodes")
                target = name
            elif op == "get_attr":
                target = self.attr_name(entry["target"])
            elif op == "output":
                if len(args) != 1 or kwargs:
                    raise CorruptArtifactError("output node must have exactly one argument")
                target = "output"
            index[name] = len(out)
            self.refs.append(Ref(len(out)))
            out.append(DecodedNode(op, name, target, args, kwargs, frozenset(self.read)))
            last_op = op
        if last_op != "output":
            raise CorruptArtifactError("graph has no output node")
        return out

    def arguments(self, raw: list, kinds: tuple) -> tuple:
        """A node's positional arguments; a reference or a scalar where any value may stand is
        taken here, everything else goes through ``value`` (the same checks, one call each)."""
        out = []
        n_kinds = len(kinds)
        for i, a in enumerate(raw):
            if i >= n_kinds or kinds[i] is _ANY:
                t = type(a)
                if t is dict and len(a) == 1:
                    payload = a.get("~node", a)
                    if payload is not a:
                        out.append(self.reference(payload))
                        continue
                    items = a.get("~list")  # a shape or dims: ints, what ``value`` returns as they are
                    if type(items) is list and all(type(x) is int for x in items):
                        out.append(items)
                        continue
                elif a is None or t is int or t is float or t is str or t is bool:
                    out.append(a)
                    continue
                out.append(self.value(a))
            else:
                out.append(self.value(a, kind=kinds[i]))
        return tuple(out)

    def reference(self, payload) -> Ref:
        """The ``Ref`` a ``{"~node": name}`` value stands for: a node decoded before this one."""
        found = self.index.get(payload) if type(payload) is str else None
        if found is None:
            raise CorruptArtifactError(f"reference to unknown node {str(payload)[:80]!r}")
        self.read.add(found)
        return self.refs[found]

    def op_kinds(self, name) -> tuple:
        """(resolved target, positional argument kinds, keyword kinds or None), once per name."""
        known = self.kinds.get(name) if type(name) is str else None
        if known is None:
            target = self.target(name)
            positional, by_name = (_argument_kinds(target) if isinstance(target, torch._ops.OpOverload)
                                   else ((), None))
            known = self.kinds[name] = (target, positional, by_name)
        return known

    def check_groups(self, name, target, args, kwargs, positional) -> None:
        """A collective's group must be given, and only as a bound mesh dimension."""
        if _GROUP in positional:
            i = positional.index(_GROUP)
            if i >= len(args) and "group_name" not in kwargs:
                raise UnsafeArtifactError(f"node {name}: {target} has no process group argument")

    def target(self, name):
        if not isinstance(name, str):
            raise UnsafeArtifactError(f"op target must be a string, got {type(name).__name__}")
        if name not in self.targets:
            self.targets[name] = resolve_target(name)
        return self.targets[name]

    def kwarg_name(self, k):
        if not isinstance(k, str) or not _NAME.match(k):
            raise CorruptArtifactError(f"invalid keyword argument name {str(k)[:80]!r}")
        return k

    def attr_name(self, target):
        if not isinstance(target, str) or not _NAME.match(target) or target.startswith("__"):
            raise UnsafeArtifactError(f"invalid attribute target {str(target)[:80]!r}")
        return target

    def value(self, v, depth: int = 0, kind: str = _ANY):
        if kind == _GROUP and not (isinstance(v, dict) and list(v) == ["~group"]):
            raise UnsafeArtifactError(
                f"a collective's process group is given as {str(v)[:60]!r}; stored graphs name groups "
                "only as a mesh dimension ({'~group': dim}), which is bound to the live job's group")
        if kind == _DEVICE and v is not None and not (isinstance(v, dict) and list(v) == ["~device"]):
            raise UnsafeArtifactError(f"device argument {str(v)[:60]!r} is not a device type")
        if v is None or isinstance(v, (bool, int, float, str)):
            return v
        if depth > self.limits.depth:
            raise CorruptArtifactError(f"graph value nested deeper than {self.limits.depth} levels")
        if not isinstance(v, dict) or len(v) != 1:
            raise CorruptArtifactError(f"invalid graph value {str(v)[:80]!r}")
        (tag, payload), = v.items()
        if tag == "~node":
            return self.reference(payload)
        if tag in ("~tuple", "~list") and isinstance(payload, list):
            items = [self.value(x, depth + 1) for x in payload]
            return tuple(items) if tag == "~tuple" else items
        if tag == "~slice" and isinstance(payload, list) and len(payload) == 3:
            return slice(*(self.value(x, depth + 1) for x in payload))
        if tag == "~group":
            if kind != _GROUP:
                raise UnsafeArtifactError("a process group appears outside a collective's group argument")
            if payload == "world":
                return self.groups["world"]
            if not isinstance(payload, int) or isinstance(payload, bool) or payload not in self.groups:
                raise CorruptArtifactError(
                    f"collective names mesh dimension {payload!r}; the live mesh has "
                    f"{sum(1 for k in self.groups if isinstance(k, int))}"
                )
            return self.groups[payload]
        if tag == "~device":
            if kind != _DEVICE:
                raise UnsafeArtifactError("a device appears outside a device argument")
            if payload not in ("cpu", "cuda", "meta", "xpu", "mps", "hpu"):
                raise CorruptArtifactError(f"unknown device type {str(payload)[:40]!r}")
            return self.device if payload == self.device.type else torch.device(payload)
        if tag in _ENUMS and isinstance(payload, str) and _NAME.match(payload):
            obj = getattr(torch, payload, None)
            if isinstance(obj, _ENUMS[tag][0]):
                return obj
        raise CorruptArtifactError(f"invalid graph value {str(v)[:80]!r}")


def resolve_target(name) -> Callable:
    """``'aten::add_.Tensor'`` -> ``torch.ops.aten.add_.Tensor``, for allowlisted overloads only."""
    if not isinstance(name, str):
        raise UnsafeArtifactError(f"op target must be a string, got {type(name).__name__}")
    if name in _PYTHON_CALLABLES:
        return _PYTHON_CALLABLES[name]
    namespace, sep, rest = name.partition("::")
    opname, dot, overload = rest.partition(".")
    if not sep or not dot:
        raise UnsafeArtifactError(f"graph calls {name[:80]!r}, which is not an operator name "
                                  "(namespace::op.overload) or operator.getitem")
    for part in (namespace, opname, overload):
        if not _NAME.match(part) or part.startswith("__"):
            raise UnsafeArtifactError(f"graph calls {name[:80]!r}, which is not an operator name")
    why = refusal(opname) or REFUSED_OVERLOADS.get(name)
    if why:
        raise UnsafeArtifactError(f"graph calls {name!r}, which is refused: it {why}")
    if not is_allowed(name):
        raise OpNotAllowedError(
            f"graph calls {name[:80]!r}, which is not on the op allowlist of this spmd-aot "
            f"(`spmd-aot ops` lists it) and this job did not opt in to it (allow_ops=, --allow-op, "
            f"${ENV_ALLOW_OPS}); refusing the artifact", op=name)
    try:
        packet = getattr(getattr(torch.ops, namespace), opname)
        op = getattr(packet, overload)
    except (AttributeError, RuntimeError):
        raise CorruptArtifactError(f"operator {name!r} does not exist in torch {torch.__version__}") from None
    if not isinstance(op, torch._ops.OpOverload):
        raise UnsafeArtifactError(f"graph target {name!r} is not an operator overload")
    return op

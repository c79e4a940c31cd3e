"""An FX graph as plain data (msgpack), and back, without ever running stored code.

Encoding keeps only what execution needs: each node's opcode, its target as an operator name,
and its arguments as tagged values. Node metadata and stack traces are dropped (they hold
paths and object reprs). Decoding resolves every target against ``ALLOWED_NAMESPACES`` and
accepts only ``torch._ops.OpOverload`` objects (plus ``operator.getitem``), validates every
name and value, and raises ``UnsafeArtifactError`` / ``CorruptArtifactError`` otherwise.

Process-group names are replaced by ``{"~group": mesh_dim}`` (or ``"world"`` for a group of every
rank) and device indices are dropped,
so one artifact serves every rank; ``decode_graph`` binds them to the live job.
"""

from __future__ import annotations

import dataclasses
import keyword
import operator
import re
from typing import Any, Callable

import msgpack
import torch

from .errors import CorruptArtifactError, UnsafeArtifactError

__all__ = ["encode_graph", "decode_graph", "to_fx_graph", "Ref", "DecodedNode", "ALLOWED_NAMESPACES",
           "GRAPH_FORMAT"]

GRAPH_FORMAT = 1
ALLOWED_NAMESPACES = frozenset({"aten", "prims", "_c10d_functional"})
_PYTHON_CALLABLES: dict[str, Callable] = {"operator.getitem": operator.getitem}
# aten ops with effects outside their tensors; a traced train step never needs them.
_DENIED_OPS = {
    "from_file": "opens (and with shared=True creates and writes) a file named in the graph",
    "save": "writes a file named in the graph",
    "_print": "prints text from the graph",
}
_MAX_DEPTH = 32  # nesting of argument values; traced graphs use 2 or 3
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,200}$")
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
    for node in graph.nodes:
        if node.op not in _OPCODES:
            raise UnsafeArtifactError(f"cannot store node {node.name} with opcode {node.op}")
        groups = _group_argument_names(node)
        schema_names = _argument_names(node)
        args = [
            _encode_group(v, group_names) if i < len(schema_names) and schema_names[i] in groups
            else _encode(v)
            for i, v in enumerate(node.args)
        ]
        kwargs = {k: _encode_group(v, group_names) if k in groups else _encode(v)
                  for k, v in node.kwargs.items()}
        target = _target_name(node) if node.op == "call_function" else node.target
        nodes.append({"op": node.op, "name": node.name, "target": target, "args": args, "kwargs": kwargs})
    return msgpack.packb({"format": GRAPH_FORMAT, "nodes": nodes}, use_bin_type=True)


def _target_name(node: torch.fx.Node) -> str:
    t = node.target
    if isinstance(t, torch._ops.OpOverload):
        if t.namespace not in ALLOWED_NAMESPACES:
            raise UnsafeArtifactError(
                f"node {node.name} calls {t.name()}, outside the allowed op namespaces "
                f"{sorted(ALLOWED_NAMESPACES)}"
            )
        return f"{t.namespace}::{t._opname}.{t._overloadname}"
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


@dataclasses.dataclass
class DecodedNode:
    op: str  # placeholder | call_function | get_attr | output
    name: str
    target: Any  # resolved OpOverload / operator.getitem, attribute name, or the node name
    args: tuple
    kwargs: dict


def decode_graph(data: bytes, *, groups: list[str], device: torch.device) -> list[DecodedNode]:
    """msgpack bytes -> validated nodes, bound to live process groups and the local device.

    ``groups[d]`` is the live group name of mesh dimension ``d``; a world group is taken as
    the default process group.

    Values that refer to other nodes are ``Ref``s. Raises ``UnsafeArtifactError`` for a target
    outside the allowlist and ``CorruptArtifactError`` for anything else malformed; nothing
    stored is executed. ``to_fx_graph`` and ``program.Program`` consume the result.
    """
    try:
        doc = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several types for garbage
        raise CorruptArtifactError(f"graph blob is not valid msgpack: {exc}") from None
    try:
        if not isinstance(doc, dict) or doc.get("format") != GRAPH_FORMAT:
            found = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
            raise CorruptArtifactError(f"graph format is {found!r}, expected {GRAPH_FORMAT}")
        return _Decoder(groups, device).nodes(doc["nodes"])
    except CorruptArtifactError:
        raise
    except Exception as exc:
        raise CorruptArtifactError(f"graph blob is malformed: {type(exc).__name__}: {exc}") from None


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


class _Decoder:
    def __init__(self, groups: list[str], device: torch.device):
        self.groups: dict = dict(enumerate(groups))
        if groups:
            import torch.distributed as dist

            self.groups["world"] = dist.group.WORLD.group_name if dist.is_initialized() else groups[0]
        self.device = device
        self.index: dict[str, int] = {}
        self.targets: dict[str, Callable] = {}

    def nodes(self, entries) -> list[DecodedNode]:
        if not isinstance(entries, list):
            raise CorruptArtifactError("graph nodes must be a list")
        out = []
        for entry in entries:
            if not isinstance(entry, dict) or len(entry) != 5 or not _NODE_FIELDS.issuperset(entry):
                raise CorruptArtifactError(f"malformed node entry {str(entry)[:80]}")
            op, name = entry["op"], entry["name"]
            if op not in _OPCODES:
                raise UnsafeArtifactError(f"node opcode {str(op)[:40]!r} is not allowed")
            if not isinstance(name, str) or not _NAME.match(name) or keyword.iskeyword(name) or name in self.index:
                raise CorruptArtifactError(f"invalid or duplicate node name {str(name)[:80]!r}")
            if out and out[-1].op == "output":
                raise CorruptArtifactError("nodes after the output node")
            if not isinstance(entry["args"], list) or not isinstance(entry["kwargs"], dict):
                raise CorruptArtifactError(f"node {name}: args must be a list and kwargs a map")
            args = tuple(self.value(a) for a in entry["args"])
            kwargs = {self.kwarg_name(k): self.value(v) for k, v in entry["kwargs"].items()}
            if op == "placeholder":
                if out and out[-1].op != "placeholder":
                    raise CorruptArtifactError(f"placeholder {name} after non-placeholder nodes")
                target = name
            elif op == "get_attr":
                target = self.attr_name(entry["target"])
            elif op == "output":
                if len(args) != 1 or kwargs:
                    raise CorruptArtifactError("output node must have exactly one argument")
                target = "output"
            else:
                target = self.target(entry["target"])
            self.index[name] = len(out)
            out.append(DecodedNode(op, name, target, args, kwargs))
        if not out or out[-1].op != "output":
            raise CorruptArtifactError("graph has no output node")
        return out

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

    def value(self, v, depth: int = 0):
        if v is None or isinstance(v, (bool, int, float, str)):
            return v
        if depth > _MAX_DEPTH:
            raise CorruptArtifactError(f"graph value nested deeper than {_MAX_DEPTH} levels")
        if not isinstance(v, dict) or len(v) != 1:
            raise CorruptArtifactError(f"invalid graph value {str(v)[:80]!r}")
        (tag, payload), = v.items()
        if tag == "~node":
            if not isinstance(payload, str) or payload not in self.index:
                raise CorruptArtifactError(f"reference to unknown node {str(payload)[:80]!r}")
            return Ref(self.index[payload])
        if tag in ("~tuple", "~list") and isinstance(payload, list):
            items = [self.value(x, depth + 1) for x in payload]
            return tuple(items) if tag == "~tuple" else items
        if tag == "~slice" and isinstance(payload, list) and len(payload) == 3:
            return slice(*(self.value(x, depth + 1) for x in payload))
        if tag == "~group":
            if payload == "world":
                return self.groups["world"]
            if not isinstance(payload, int) or isinstance(payload, bool) or payload not in self.groups:
                raise CorruptArtifactError(
                    f"collective names mesh dimension {payload!r}; the live mesh has "
                    f"{sum(1 for k in self.groups if isinstance(k, int))}"
                )
            return self.groups[payload]
        if tag == "~device":
            if payload not in ("cpu", "cuda", "meta", "xpu", "mps", "hpu"):
                raise CorruptArtifactError(f"unknown device type {str(payload)[:40]!r}")
            return self.device if payload == self.device.type else torch.device(payload)
        if tag in _ENUMS and isinstance(payload, str) and _NAME.match(payload):
            obj = getattr(torch, payload, None)
            if isinstance(obj, _ENUMS[tag][0]):
                return obj
        raise CorruptArtifactError(f"invalid graph value {str(v)[:80]!r}")


def resolve_target(name) -> Callable:
    """``'aten::add_.Tensor'`` -> ``torch.ops.aten.add_.Tensor``, for allowlisted namespaces only."""
    if not isinstance(name, str):
        raise UnsafeArtifactError(f"op target must be a string, got {type(name).__name__}")
    if name in _PYTHON_CALLABLES:
        return _PYTHON_CALLABLES[name]
    namespace, sep, rest = name.partition("::")
    opname, dot, overload = rest.partition(".")
    if not sep or not dot or namespace not in ALLOWED_NAMESPACES:
        raise UnsafeArtifactError(
            f"graph calls {name[:80]!r}, which is outside the op allowlist "
            f"({', '.join(sorted(ALLOWED_NAMESPACES))} operators and operator.getitem)"
        )
    for part in (opname, overload):
        if not _NAME.match(part) or part.startswith("__"):
            raise UnsafeArtifactError(f"graph calls {name[:80]!r}, which is not an operator name")
    if opname in _DENIED_OPS:
        raise UnsafeArtifactError(f"graph calls {name!r}, which is refused: it {_DENIED_OPS[opname]}")
    try:
        packet = getattr(getattr(torch.ops, namespace), opname)
        op = getattr(packet, overload)
    except (AttributeError, RuntimeError):
        raise CorruptArtifactError(f"operator {name!r} does not exist in torch {torch.__version__}") from None
    if not isinstance(op, torch._ops.OpOverload):
        raise UnsafeArtifactError(f"graph target {name!r} is not an operator overload")
    return op

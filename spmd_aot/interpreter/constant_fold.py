"""Compute once, when a program is built, what a step computes from no input at all.

A traced step recomputes every step what eager code recomputes: causal masks (``ones`` ->
``tril`` -> ``bitwise_not``), ``arange`` positions, broadcast constants. Their values never
change, so a ``Program`` evaluates them at load and keeps the results, which takes those ops
off every step (a few percent of a small model's step). Results are bit-identical: the same
ops run on the same arguments, once.

What is folded, conservatively:
- only functional ops (no mutable schema argument), never RNG-seeded or bitwise
  nondeterministic ones, never collectives;
- only values that no later op writes in place and that the step does not return (a caller
  could modify a returned tensor); a folded value and everything folded from it are kept or
  dropped together, since views share storage;
- each op first runs on the meta device, so sizes are known before memory is touched; values
  over ``_MAX_VALUE_BYTES`` (or over ``_MAX_TOTAL_BYTES`` together) are left to the step;
- the graph is stored data, so folding is bounded work whatever it holds: one pass over the
  nodes (linear), and each op's cost is estimated from its shapes before it runs (``_cost``:
  elements read and written, or output elements x reduction length for contractions, plus a
  fixed charge per op); an op over ``LoadLimits.fold_op_flops`` is left to the step, and once
  ``fold_total_flops`` is spent nothing more is folded.
- a node that repeats an earlier folded node (the same op on the same arguments, e.g. each
  layer's causal mask) shares its value instead of running again, and the two are kept or
  dropped together; the meta runs of a 12-layer model's masks were most of a hit's folding time.
Anything that fails to fold simply runs every step, as it would have; folding never raises.
"""

from __future__ import annotations

import functools
import operator
from typing import Any

import torch

from ..format.limits import LoadLimits, load_limits
from ..format.serialize import DecodedNode, Ref, refs_in

__all__ = ["fold_constants"]

_MAX_VALUE_BYTES = 16 << 20
_MAX_TOTAL_BYTES = 64 << 20
_UNFOLDABLE_TAGS = (torch.Tag.nondeterministic_seeded, torch.Tag.nondeterministic_bitwise)
_PER_OP = 1 << 15  # charged for every op tried: its meta and real dispatch cost time too
# Contractions: output elements x the length of the contracted dimension (of this argument).
_CONTRACTIONS = {"mm": 0, "bmm": 0, "matmul": 0, "dot": 0, "vdot": 0, "mv": 0,
                 "addmm": 1, "baddbmm": 1, "addbmm": 1, "addmv": 1}
# Ops whose work can grow faster than what they read and write, with no simple formula here:
# charged output elements x their largest input (an upper bound).
_SUPERLINEAR = ("conv", "_conv", "cudnn", "mkldnn", "einsum", "cdist", "_cdist", "linalg", "_linalg",
                "tensordot", "_scaled_dot", "scaled_dot", "_efficient", "_flash", "cholesky", "triangular",
                "lu", "qr", "svd", "eig", "inverse", "det", "logdet", "slogdet", "pinverse", "matrix_power",
                "kron", "histc", "bincount", "_fft", "fft", "stft", "istft", "grid_sampler", "upsample",
                "_upsample", "embedding_bag", "_embedding_bag", "ctc", "_ctc", "pdist", "_pdist")


def fold_constants(nodes: list[DecodedNode], template: list[Any], output: Any,
                   limits: LoadLimits | None = None, admit=None) -> set[int]:
    """Evaluate input-independent call nodes; store the values later steps read in ``template``.

    ``template[i]`` holds the value of every ``get_attr`` node already. ``admit(i, value)``, if
    given, must accept a computed value before anything folds from it (the program's run-time
    invariant: a value whose metadata differs from the load's meta check is left to the step,
    which refuses it there). Returns the indices of the folded nodes (the program skips them)."""
    limits = limits or load_limits()
    available = {i for i, n in enumerate(nodes) if n.op == "get_attr"}  # constants, then folded values
    values: dict[int, Any] = {i: template[i] for i in available}
    folded: set[int] = set()
    same_as: dict[int, int] = {}  # a folded node -> the earlier folded node it repeats
    first_of: dict = {}  # a folded node's signature -> that node
    total = 0
    budget = limits.fold_total_flops
    with torch.no_grad():
        for i, node in enumerate(nodes):
            if node.op != "call_function" or not _facts(node.target)[1]:
                continue
            if not node.refs <= available:
                continue
            signature = _signature(node, same_as)
            if signature is not None and signature in first_of:
                same_as[i] = first_of[signature]
                values[i] = values[same_as[i]]
                folded.add(i)
                available.add(i)
                continue
            if budget < _PER_OP:
                break  # the load's folding budget is spent: the rest runs every step
            budget -= _PER_OP
            try:
                meta_args = _bind(node.args, values, meta=True)
                meta_kwargs = _bind(node.kwargs, values, meta=True)
                if _takes_device(node) and "device" not in meta_kwargs:
                    meta_kwargs["device"] = torch.device("meta")  # a default device is a real one
                meta = node.target(*meta_args, **meta_kwargs)
                size = _bytes(meta)
                if size is None or size > _MAX_VALUE_BYTES or total + size > _MAX_TOTAL_BYTES:
                    continue
                cost = _cost(node.target, meta_args, meta_kwargs, meta)
                if cost > limits.fold_op_flops or cost > budget:
                    continue
                budget -= cost
                value = node.target(*_bind(node.args, values), **_bind(node.kwargs, values))
                if admit is not None and not admit(i, value):
                    continue
            except Exception:  # left to the step, which raises what it raises
                continue
            values[i] = value
            folded.add(i)
            available.add(i)
            total += size
            if signature is not None:
                first_of[signature] = i
    folded -= _unsafe(nodes, folded, output, same_as)
    for i in folded:
        template[i] = values[i]
    return folded


def _numels(value) -> list[int]:
    if isinstance(value, torch.Tensor):
        return [value.numel()]
    if isinstance(value, (list, tuple)):
        return [n for v in value for n in _numels(v)]
    if isinstance(value, dict):
        return [n for v in value.values() for n in _numels(v)]
    return []


def _cost(target, args, kwargs, result) -> int:
    """Estimated multiply-adds of one op, from meta shapes (see the module doc)."""
    inputs = _numels(args) + _numels(kwargs)
    out = sum(_numels(result))
    name = getattr(target, "_opname", "")
    operand = _CONTRACTIONS.get(name)
    if operand is not None:
        t = args[operand] if len(args) > operand else None
        k = t.shape[-1] if isinstance(t, torch.Tensor) and t.dim() else 1
        return max(out, 1) * k + sum(inputs)
    if name.startswith(_SUPERLINEAR):
        return max(out, 1) * max(inputs, default=1) + sum(inputs)
    return out + sum(inputs)


@functools.cache  # per op overload: its schema and tags never change
def _pure(target) -> bool:
    if target is operator.getitem:
        return True
    if not isinstance(target, torch._ops.OpOverload) or target.namespace not in ("aten", "prims"):
        return False
    return not target._schema.is_mutable and not any(t in target.tags for t in _UNFOLDABLE_TAGS)


def _takes_device(node: DecodedNode) -> bool:
    schema = getattr(node.target, "_schema", None)
    return schema is not None and any(
        a.name == "device" and (a.kwarg_only or i >= len(node.args)) for i, a in enumerate(schema.arguments))


def _signature(node: DecodedNode, same_as: dict[int, int]):
    """A hashable stand-in for (op, arguments), a repeat's refs read as the node it repeats;
    None when an argument has no exact hashable form (that node is simply not shared)."""
    try:
        return node.target, _frozen(node.args, same_as), _frozen(node.kwargs, same_as)
    except TypeError:
        return None


def _frozen(v, same_as: dict[int, int]):
    if isinstance(v, Ref):
        return "ref", same_as.get(v.index, v.index)
    if isinstance(v, (list, tuple)):
        return type(v).__name__, tuple(_frozen(x, same_as) for x in v)
    if isinstance(v, dict):
        return "dict", tuple((k, _frozen(x, same_as)) for k, x in sorted(v.items()))
    if isinstance(v, float):
        return "float", repr(v)  # -0.0 and 0.0 differ; nan equals itself
    hash(v)  # TypeError: not hashable, not shared
    return type(v).__name__, v


def _unsafe(nodes: list[DecodedNode], folded: set[int], output: Any, same_as: dict[int, int]) -> set[int]:
    """Folded nodes that must run every step after all: the step returns them or writes them
    in place (through any view), with everything folded that shares their component."""
    if not folded:  # the common case: nothing to undo, and no need to walk every node's arguments
        return set()
    parent = {i: i for i in folded}

    def root(i):
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for i in folded:
        for r in nodes[i].refs:
            if r in parent:
                parent[root(r)] = root(i)
        if i in same_as:  # a repeat holds the very same tensor as the node it repeats
            parent[root(same_as[i])] = root(i)
    bad_roots = {root(r) for r in refs_in(output) if r in parent}
    for i, node in enumerate(nodes):
        if node.op != "call_function" or i in folded or node.refs.isdisjoint(folded):
            continue  # what a node writes or aliases is among what it reads: most read nothing folded
        _, _, writes, alias = _facts(node.target)
        if not writes and not alias:  # most nodes: nothing to look at
            continue
        suspect = _written_refs(node)
        if alias:  # a view of a folded value escapes into per-step values
            suspect |= node.refs
        for r in suspect:
            if r in parent:
                bad_roots.add(root(r))
    return {i for i in folded if root(i) in bad_roots}


_FACTS: dict[int, tuple] = {}  # id(target) -> ``_facts(target)``


def _facts(target) -> tuple:
    """(target, pure, writes anything, returns an alias), per op: looked up by identity, since
    an op overload's own hash is Python code and every node asks. The entry holds the target,
    so its id cannot be reused while the entry lives."""
    known = _FACTS.get(id(target))
    if known is None or known[0] is not target:
        writes = (target is not operator.getitem if getattr(target, "_schema", None) is None
                  else bool(_written_arguments(target)))
        known = _FACTS[id(target)] = (target, _pure(target), writes, _schema_returns_alias(target))
    return known


@functools.cache
def _schema_returns_alias(target) -> bool:
    schema = getattr(target, "_schema", None)
    return schema is not None and any(r.alias_info is not None for r in schema.returns)


def _written_refs(node: DecodedNode) -> set[int]:
    """Values an op may write: arguments its schema marks ``(a!)``; unknown ops write all."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return set() if node.target is operator.getitem else set(node.refs)
    written: set[int] = set()
    for pos, name in _written_arguments(node.target):
        value = node.args[pos] if pos < len(node.args) else node.kwargs.get(name)
        written |= refs_in(value)
    return written


@functools.cache
def _written_arguments(target) -> tuple[tuple[int, str], ...]:
    """(position, name) of every argument the op's schema marks ``(a!)``."""
    return tuple((pos, arg.name) for pos, arg in enumerate(target._schema.arguments)
                 if arg.alias_info is not None and arg.alias_info.is_write)


def _bind(v, values: dict[int, Any], meta: bool = False):
    if isinstance(v, Ref):
        x = values[v.index]
        return _to_meta(x) if meta else x
    if isinstance(v, (list, tuple)):
        return type(v)(_bind(x, values, meta) for x in v)
    if isinstance(v, dict):
        return {k: (torch.device("meta") if meta and k == "device" and x is not None else _bind(x, values, meta))
                for k, x in v.items()}
    return v


def _to_meta(x):
    if isinstance(x, torch.Tensor):
        return x if x.device.type == "meta" else torch.empty_strided(x.shape, x.stride(), dtype=x.dtype,
                                                                      device="meta")
    if isinstance(x, (list, tuple)):
        return type(x)(_to_meta(y) for y in x)
    return x


def _bytes(value) -> int | None:
    """Bytes a value's tensors occupy (None: not a tensor or a list of them)."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)) and all(isinstance(x, torch.Tensor) for x in value):
        return sum(x.numel() * x.element_size() for x in value)
    return None

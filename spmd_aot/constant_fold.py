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
  over ``_MAX_VALUE_BYTES`` (or over ``_MAX_TOTAL_BYTES`` together) are left to the step.
Anything that fails to fold simply runs every step, as it would have; folding never raises.
"""

from __future__ import annotations

import operator
from typing import Any

import torch

from .serialize import DecodedNode, Ref, refs_in

__all__ = ["fold_constants"]

_MAX_VALUE_BYTES = 16 << 20
_MAX_TOTAL_BYTES = 64 << 20
_UNFOLDABLE_TAGS = (torch.Tag.nondeterministic_seeded, torch.Tag.nondeterministic_bitwise)


def fold_constants(nodes: list[DecodedNode], template: list[Any], output: Any) -> set[int]:
    """Evaluate input-independent call nodes; store the values later steps read in ``template``.

    ``template[i]`` holds the value of every ``get_attr`` node already. Returns the indices of
    the folded nodes (the program skips them)."""
    known = {i for i, n in enumerate(nodes) if n.op == "get_attr"}
    values: dict[int, Any] = {i: template[i] for i in known}
    folded: set[int] = set()
    total = 0
    with torch.no_grad():
        for i, node in enumerate(nodes):
            if node.op != "call_function" or not _pure(node.target):
                continue
            refs = refs_in(node.args) | refs_in(node.kwargs)
            if not refs <= (known | folded):
                continue
            try:
                meta_kwargs = _bind(node.kwargs, values, meta=True)
                if _takes_device(node) and "device" not in meta_kwargs:
                    meta_kwargs["device"] = torch.device("meta")  # a default device is a real one
                meta = node.target(*_bind(node.args, values, meta=True), **meta_kwargs)
                size = _bytes(meta)
                if size is None or size > _MAX_VALUE_BYTES or total + size > _MAX_TOTAL_BYTES:
                    continue
                value = node.target(*_bind(node.args, values), **_bind(node.kwargs, values))
            except Exception:  # left to the step, which raises what it raises
                continue
            values[i] = value
            folded.add(i)
            total += size
    folded -= _unsafe(nodes, folded, output)
    for i in folded:
        template[i] = values[i]
    return folded


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


def _unsafe(nodes: list[DecodedNode], folded: set[int], output: Any) -> set[int]:
    """Folded nodes that must run every step after all: the step returns them or writes them
    in place (through any view), with everything folded that shares their component."""
    parent = {i: i for i in folded}

    def root(i):
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for i in folded:
        for r in refs_in(nodes[i].args) | refs_in(nodes[i].kwargs):
            if r in parent:
                parent[root(r)] = root(i)
    bad_roots = {root(r) for r in refs_in(output) if r in parent}
    for i, node in enumerate(nodes):
        if node.op != "call_function" or i in folded:
            continue
        suspect = _written_refs(node)
        if _returns_alias(node):  # a view of a folded value escapes into per-step values
            suspect |= refs_in(node.args) | refs_in(node.kwargs)
        for r in suspect:
            if r in parent:
                bad_roots.add(root(r))
    return {i for i in folded if root(i) in bad_roots}


def _returns_alias(node: DecodedNode) -> bool:
    schema = getattr(node.target, "_schema", None)
    return schema is not None and any(r.alias_info is not None for r in schema.returns)


def _written_refs(node: DecodedNode) -> set[int]:
    """Values an op may write: arguments its schema marks ``(a!)``; unknown ops write all."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return set() if node.target is operator.getitem else refs_in(node.args) | refs_in(node.kwargs)
    written: set[int] = set()
    for pos, arg in enumerate(schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = node.args[pos] if pos < len(node.args) else node.kwargs.get(arg.name)
        written |= refs_in(value)
    return written


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

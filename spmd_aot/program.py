"""Run a decoded graph directly: a flat list of op calls over a value table.

Why not ``fx.GraphModule``: it generates and compiles Python source for the whole graph, which
for a 12-layer transformer step (6k nodes) costs more at job start than everything else a
cache hit does. A ``Program`` is built straight from the validated nodes, calls the very same
op overloads in the same order (so results are bit-identical to the traced graph), and frees
each intermediate after its last use, as FX's generated code does.
"""

from __future__ import annotations

import operator
from typing import Any, Sequence

import torch

from .errors import CorruptArtifactError
from .serialize import DecodedNode, Ref

__all__ = ["Program"]


class Program:
    def __init__(self, nodes: list[DecodedNode], constants: dict[str, torch.Tensor]):
        self.n_inputs = sum(1 for n in nodes if n.op == "placeholder")
        self.n_ops = sum(1 for n in nodes if n.op == "call_function")
        self._template: list[Any] = [None] * len(nodes)
        for i, n in enumerate(nodes):
            if n.op == "get_attr":
                if n.target not in constants:
                    raise CorruptArtifactError(f"graph reads constant {n.target!r}, which is not stored")
                self._template[i] = constants[n.target]
        last_use = _last_uses(nodes)
        frees_after: dict[int, list[int]] = {}
        for value, user in last_use.items():
            if nodes[value].op == "call_function":
                frees_after.setdefault(user, []).append(value)
        self._steps = [_compile_call(i, n, frees_after.get(i, ())) for i, n in enumerate(nodes)
                       if n.op == "call_function"]
        self._output = nodes[-1].args[0]

    def __call__(self, *inputs: torch.Tensor) -> Any:
        if len(inputs) != self.n_inputs:
            raise TypeError(f"program takes {self.n_inputs} inputs, got {len(inputs)}")
        env = self._template.copy()
        env[: self.n_inputs] = inputs
        for fn, index, args, ref_pos, fetch, kwargs, nested, frees in self._steps:
            if nested:
                a, kw = _materialize(args, env), _materialize(kwargs, env)
                env[index] = fn(*a, **kw)
            else:
                a = list(args)
                if fetch is not None:
                    for pos, v in zip(ref_pos, fetch(env)):
                        a[pos] = v
                env[index] = fn(*a, **kwargs)
            for f in frees:
                env[f] = None
        return _materialize(self._output, env)


def _compile_call(index: int, node: DecodedNode, frees: Sequence[int]):
    """Precompute how to gather a node's arguments: flat ones with one C-level itemgetter."""
    flat = all(not isinstance(a, (list, tuple, slice)) or not _has_ref(a) for a in node.args) \
        and not _has_ref(node.kwargs)
    if not flat:
        return (node.target, index, node.args, (), None, node.kwargs, True, tuple(frees))
    ref_pos = tuple(i for i, a in enumerate(node.args) if isinstance(a, Ref))
    indices = [node.args[i].index for i in ref_pos]
    if not indices:
        fetch = None
    elif len(indices) == 1:
        only = indices[0]
        fetch = lambda env: (env[only],)  # noqa: E731  (itemgetter returns a bare value for one)
    else:
        fetch = operator.itemgetter(*indices)
    return (node.target, index, node.args, ref_pos, fetch, node.kwargs, False, tuple(frees))


def _has_ref(v) -> bool:
    if isinstance(v, Ref):
        return True
    if isinstance(v, (list, tuple)):
        return any(_has_ref(x) for x in v)
    if isinstance(v, dict):
        return any(_has_ref(x) for x in v.values())
    if isinstance(v, slice):
        return any(_has_ref(x) for x in (v.start, v.stop, v.step))
    return False


def _materialize(v, env):
    if isinstance(v, Ref):
        return env[v.index]
    if isinstance(v, (list, tuple)):
        return type(v)(_materialize(x, env) for x in v)
    if isinstance(v, dict):
        return {k: _materialize(x, env) for k, x in v.items()}
    if isinstance(v, slice):
        return slice(_materialize(v.start, env), _materialize(v.stop, env), _materialize(v.step, env))
    return v


def _last_uses(nodes: list[DecodedNode]) -> dict[int, int]:
    """value index -> index of the last call node that reads it (outputs are never freed)."""
    last: dict[int, int] = {}

    def visit(v, user):
        if isinstance(v, Ref):
            last[v.index] = user
        elif isinstance(v, (list, tuple)):
            for x in v:
                visit(x, user)
        elif isinstance(v, dict):
            for x in v.values():
                visit(x, user)
        elif isinstance(v, slice):
            visit(v.start, user), visit(v.stop, user), visit(v.step, user)

    for i, n in enumerate(nodes):
        if n.op == "call_function":
            visit(n.args, i)
            visit(n.kwargs, i)
    calls = dict(last)
    last.clear()
    visit(nodes[-1].args, -1)  # what the output node reads
    return {v: user for v, user in calls.items() if v not in last}  # graph outputs stay alive

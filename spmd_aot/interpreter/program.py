"""Run a decoded graph directly: a flat list of op calls over a value table.

Why not ``fx.GraphModule``: it generates and compiles Python source for the whole graph, which
for a 12-layer transformer step (6k nodes) costs more at job start than everything else a
cache hit does. A ``Program`` is built straight from the validated nodes, calls the very same
op overloads in the same order (so results are bit-identical to the traced graph), and frees
each intermediate after its last use, as FX's generated code does.

Per step the interpreter does as little Python as it can, since on small models that is what a
step pays on top of the kernels: each op is called through its C++ handle, its arguments are
gathered with precomputed ``itemgetter``s, the items of multi-output ops are unpacked where
they are produced (no ``getitem`` steps), and values that depend on no input (causal masks,
``arange`` positions: see ``constant_fold.py``) are computed once when the program is built.

Ops whose kernels write where index values say without bounds-checking them
(``contracts.VALUE_CHECKS``: max-pool and embedding backward) have their index tensors' range
checked right before every call; they are never folded, so no value escapes the check.

A program built from a meta-checked graph (``expected``: what the check derived for every node)
also checks, right after each op, that every result some op reads has the shape, strides and
dtype the meta check derived (``invariants.py``: ops exist whose CPU results differ from their
meta results, and contracts proven on meta hold only for values that match them). The expected
metadata is part of the ``ProgramTable``, so a program rebuilt from its prepared record checks
the same.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any, NamedTuple
from collections.abc import Callable, Sequence

import torch

from .constant_fold import fold_constants
from .invariants import DivergedValueError, check as check_value, matches, reads
from ..format.contracts import VALUE_CHECKS, op_name
from ..errors import CorruptArtifactError
from ..format.serialize import DecodedNode, Ref, has_ref, refs_in

__all__ = ["Program", "ProgramTable", "value_checked"]


@dataclasses.dataclass(frozen=True)
class ProgramTable:
    """What a ``Program`` is built from, as data (ops, value indices, constant arguments), the
    analysis done: which nodes fold, which items unpack, what is freed where. ``prepared.py``
    keeps it between jobs, so a later load of the same artifact rebuilds the program from it
    without decoding the graph again."""

    n_nodes: int
    n_inputs: int
    n_ops: int  # call nodes of the graph (folded and unpacked ones included)
    constants: tuple  # (node index, constant name) of every ``get_attr`` node
    folds: tuple  # in graph order: (index, target, args, kwargs, expect) to compute, or (index, earlier index) to share
    output: Any  # the output node's argument (``Ref``s inside)
    steps: tuple  # (target, index, args, kwargs, unpack, frees, expect), what every step calls; unpack:
    #               (item index, k, expect) per item; expect: ``invariants.describe`` of the meta result, or None
    inputs: tuple = ()  # the meta check's expectation of every input (empty: unchecked)


class Program:
    def __init__(self, nodes: list[DecodedNode], constants: dict[str, torch.Tensor], *, fold: bool = True,
                 expected: list | None = None):
        """``expected``: ``invariants.describe`` of the meta check's result of every node (the
        load passes it; a program of a graph that was never meta-checked, in tests, has none
        and checks no run-time invariant)."""
        checks: dict[int, Any] = {}  # id(op) -> its value check or None, looked up once per op
        nodes = list(nodes)
        for i, n in enumerate(nodes):
            if n.op == "call_function" and checks.get(id(n.target), _UNSEEN) is not None:  # unseen, or checked
                nodes[i] = _value_checked(n, checks)
        if expected is not None and len(expected) != len(nodes):
            raise CorruptArtifactError(f"{len(expected)} expected results for a graph of {len(nodes)} nodes")
        template: list[Any] = [None] * len(nodes)
        constant_at = []
        for i, n in enumerate(nodes):
            if n.op == "get_attr":
                constant_at.append((i, n.target))
        _place_constants(template, constant_at, constants)
        output = nodes[-1].args[0]
        admit = None if expected is None else (lambda i, value: matches(value, expected[i]))
        folded = fold_constants(nodes, template, output, admit=admit) if fold else set()
        unpacked = _unpacked_items(nodes, folded)
        last_use = _last_uses(nodes, skip=folded | set(unpacked))
        frees_after: dict[int, list[int]] = {}
        for value, user in last_use.items():
            if nodes[value].op == "call_function" and value not in folded:
                frees_after.setdefault(user, []).append(value)
        outputs = refs_in(output)
        unpack_at: dict[int, list[tuple[int, int]]] = {}
        for item, (source, k) in unpacked.items():
            unpack_at.setdefault(source, []).append((item, k))
            if item not in last_use and item not in outputs:  # an item nobody reads
                frees_after.setdefault(source, []).append(item)
        for source in unpack_at:  # the container itself, once its items are out
            if source not in last_use and source not in outputs:
                frees_after.setdefault(source, []).append(source)
        first_holder: dict[int, int] = {}  # id(folded value) -> the first node holding it
        folds = []
        for i in sorted(folded):
            earlier = first_holder.setdefault(id(template[i]), i)
            n = nodes[i]
            folds.append((i, earlier) if earlier != i else
                         (i, n.target, n.args, n.kwargs, None if expected is None else expected[i]))
        checked = _checked_values(nodes, folded, unpacked, outputs) if expected is not None else set()

        steps = []
        for i, n in enumerate(nodes):
            if n.op != "call_function" or i in folded or i in unpacked:
                continue
            items = unpack_at.get(i)
            steps.append((n.target, i, n.args, n.kwargs,
                          tuple([(item, k, expected[item] if item in checked else None) for item, k in items])
                          if items else (),
                          tuple(frees_after.get(i, ())), expected[i] if i in checked else None))
        steps = tuple(steps)
        n_inputs = sum(1 for n in nodes if n.op == "placeholder")
        self.table = ProgramTable(len(nodes), n_inputs, sum(1 for n in nodes if n.op == "call_function"),
                                  tuple(constant_at), tuple(folds), output, steps,
                                  () if expected is None else tuple(expected[:n_inputs]))
        self._bind(template)

    @classmethod
    def from_table(cls, table: ProgramTable, constants: dict[str, torch.Tensor]) -> Program:
        """The program ``table`` describes (``table.steps``' targets wrapped in their value checks
        as ``__init__`` wraps them), its folded values computed again: the same ops on the same
        arguments, in the same order, so the same values."""
        self = cls.__new__(cls)
        self.table = table
        template: list[Any] = [None] * table.n_nodes
        _place_constants(template, table.constants, constants)
        with torch.no_grad():  # as folding computes them
            for fold in table.folds:
                if len(fold) == 2:
                    template[fold[0]] = template[fold[1]]
                else:
                    i, target, args, kwargs, expect = fold
                    template[i] = target(*_materialize(args, template), **_materialize(kwargs, template))
                    check_value(template[i], expect, i, _op_label(target))  # as folding admitted it
        self._bind(template)
        return self

    def _bind(self, template: list[Any]) -> None:
        """The per-step call list, from ``self.table`` and the values known before any step."""
        table = self.table
        self.n_inputs, self.n_ops, self.n_folded = table.n_inputs, table.n_ops, len(table.folds)
        self._template, self._output = template, table.output
        self._steps = [_compile_call(index, target, args, kwargs, unpack, frees, expect)
                       for target, index, args, kwargs, unpack, frees, expect in table.steps]
        self.n_checked = (sum(1 for *_, e in table.steps if e is not None)
                          + sum(u[2] is not None for s in table.steps if s[4] for u in s[4]))
        self._inputs_expected = table.inputs

    def __call__(self, *inputs: torch.Tensor) -> Any:
        if len(inputs) != self.n_inputs:
            raise TypeError(f"program takes {self.n_inputs} inputs, got {len(inputs)}")
        if self._inputs_expected:  # the induction's base: the inputs are what the meta check laid out
            try:
                for x, expect in zip(inputs, self._inputs_expected):
                    if (x.shape, x.stride(), x.dtype) != expect:
                        self._check_input(inputs, x, expect)
            except AttributeError:
                raise TypeError(f"program inputs are tensors, got {[type(x).__name__ for x in inputs]}") from None
        env = self._template.copy()
        env[: self.n_inputs] = inputs
        tensor = _Tensor
        for fn, index, gather, kwargs, unpack, frees, expect in self._steps:
            out = fn(*gather(env), **kwargs)
            # the run-time invariant (invariants.py), inline: one tuple compare per read value
            if expect is not None and (out.__class__ is not tensor or (out.shape, out.stride(), out.dtype) != expect):
                check_value(out, expect, index, self._label(index))
            env[index] = out
            if unpack:
                for item, k, expect in unpack:
                    v = env[item] = out[k]
                    if expect is not None and (v.__class__ is not tensor or (v.shape, v.stride(), v.dtype) != expect):
                        check_value(v, expect, item, f"item {k} of node {index}, {self._label(index)}")
            if frees:
                for f in frees:
                    env[f] = None
        return _materialize(self._output, env)

    def _check_input(self, inputs: tuple, x: torch.Tensor, expect: Any) -> None:
        """An input whose strides are not the contiguous ones the meta check assumed passes if
        it is dense enough (``invariants.matches``: a slice of a batch, a channels-last weight);
        otherwise (an expanded tensor) the step refuses to run on it."""
        if matches(x, expect):
            return
        i = next(i for i, y in enumerate(inputs) if y is x)
        raise DivergedValueError(
            f"step input {i} has shape {list(x.shape)}, strides {list(x.stride())}, {x.dtype}, where the "
            f"artifact's load check laid it out as shape {list(expect[0])}, {expect[2]}, every element in its "
            "own memory; an expanded or overlapping tensor is not (pass x.contiguous()).")

    def _label(self, index: int) -> str:
        """The op of node ``index``, for an error."""
        for target, i, *_ in self.table.steps:
            if i == index:
                return _op_label(target)
        return "?"


_Tensor = torch.Tensor


def _op_label(target) -> str:
    target = getattr(target, "overload", target)
    return op_name(target) if hasattr(target, "_overloadname") else getattr(target, "__name__", str(target))


def _checked_values(nodes: list[DecodedNode], folded: set[int], unpacked: dict, outputs: set[int]) -> set[int]:
    """The values whose run-time metadata is checked (``invariants.py``): every value a call
    node reads (but at positions its op ignores), every value the step returns, and the result
    of every op that writes in place (an ``out=`` op hands back the tensor it wrote)."""
    checked = set(outputs)
    for i, n in enumerate(nodes):
        if n.op != "call_function" or i in unpacked:
            continue
        checked |= reads(n)
        target = getattr(n.target, "overload", n.target)
        schema = getattr(target, "_schema", None)
        if schema is not None and schema.is_mutable and i not in folded:
            checked.add(i)
    return checked


def _place_constants(template: list[Any], constant_at, constants: dict[str, torch.Tensor]) -> None:
    for i, name in constant_at:
        if name not in constants:
            raise CorruptArtifactError(f"graph reads constant {name!r}, which is not stored")
        template[i] = constants[name]


class _ValueChecked:
    """An op whose index values are checked before each call (not an OpOverload, so never folded)."""

    __slots__ = ("op", "check", "__name__", "overload")

    def __init__(self, op, check):
        self.op, self.check, self.__name__, self.overload = op._op, check, op_name(op), op

    def __call__(self, *args, **kwargs):
        self.check(args, kwargs)
        return self.op(*args, **kwargs)


_UNSEEN = object()


def _value_checked(node: DecodedNode, checks: dict[int, Any]) -> DecodedNode:
    """A call node, its op wrapped in its ``VALUE_CHECKS`` entry if it has one."""
    target = value_checked(node.target, checks)
    if target is node.target:
        return node
    return DecodedNode(node.op, node.name, target, node.args, node.kwargs, node.refs)


def value_checked(target, checks: dict[int, Any] | None = None):
    """``target``, or it wrapped in its ``VALUE_CHECKS`` entry (``checks``: id(op) -> the
    entry or None, looked up once per op; by id, since the caller holds every target)."""
    known = _UNSEEN if checks is None else checks.get(id(target), _UNSEEN)
    if known is _UNSEEN:
        known = VALUE_CHECKS.get(op_name(target)) if hasattr(target, "_overloadname") else None
        if checks is not None:
            checks[id(target)] = known
    return target if known is None else _ValueChecked(target, known)


def _unpacked_items(nodes: list[DecodedNode], folded: set[int]) -> dict[int, tuple[int, int]]:
    """``getitem(multi_output_op, k)`` nodes, as item index -> (source index, k)."""
    out = {}
    for i, n in enumerate(nodes):
        if (n.op == "call_function" and n.target is operator.getitem and len(n.args) == 2 and not n.kwargs
                and isinstance(n.args[0], Ref) and type(n.args[1]) is int and i not in folded):
            source = n.args[0].index
            if nodes[source].op == "call_function" and source not in folded and source < i:
                out[i] = (source, n.args[1])
    return out


class _Call(NamedTuple):
    """One node as the step loop runs it (unpacked positionally, in this order, per call)."""

    fn: Callable  # the op's C++ handle, or a wrapper that fills its keyword arguments
    index: int  # the node's slot in the environment
    gather: Callable[[list], tuple]  # env -> positional arguments
    kwargs: dict
    unpack: tuple  # (slot, position, expectation) of each item of a multi-output result kept
    frees: tuple  # slots this node reads last (emptied after it runs)
    expect: Any  # what the load's check derived for the result (run-time invariants)


def _compile_call(index: int, target, args: tuple, kwargs: dict, unpack: Sequence[tuple[int, int, Any]],
                  frees: Sequence[int], expect: Any) -> _Call:
    """The ``_Call`` of one node."""
    fn = getattr(target, "_op", target)  # the C++ handle behind an OpOverload
    if type(unpack) is not tuple:
        unpack = tuple(unpack)
    if type(frees) is not tuple:
        frees = tuple(frees)
    if not kwargs or not has_ref(kwargs):  # a ``_Call`` made as a plain tuple is: a program makes thousands
        return _new_call(_Call, (fn, index, _gatherer(args), kwargs, unpack, frees, expect))
    if all(isinstance(v, Ref) or not has_ref(v) for v in kwargs.values()):
        # a kwarg that is a value (``mm.out(a, b, out=bucket_slice)``): gathered like the args
        gather, constant = _gatherer(args), {k: v for k, v in kwargs.items() if not isinstance(v, Ref)}
        refs = [(k, v.index) for k, v in kwargs.items() if isinstance(v, Ref)]

        def value_kwargs(env, _f=fn):
            kwargs = constant.copy()
            for k, i in refs:
                kwargs[k] = env[i]
            return _f(*gather(env), **kwargs)
        return _Call(value_kwargs, index, lambda env: (env,), {}, unpack, frees, expect)

    def with_kwargs(env, _f=fn, _a=args, _kw=kwargs):  # rare: a kwarg holds values deeper
        return _f(*_materialize(_a, env), **_materialize(_kw, env))
    return _Call(with_kwargs, index, lambda env: (env,), {}, unpack, frees, expect)


_new_call = tuple.__new__
_NO_REFS = frozenset((int, float, bool, str, type(None)))  # argument types that hold no reference


def _gatherer(args: tuple) -> Callable[[list], tuple]:
    """The fastest way to build one node's positional arguments from the value table."""
    if len(args) == 1 and type(args[0]) is Ref:  # the commonest first: a program builds thousands
        only = args[0].index
        return lambda env: (env[only],)  # noqa: E731
    positions, flat = [], True  # where the refs stand; whether any hides deeper (one pass)
    for pos, a in enumerate(args):
        kind = type(a)
        if kind is Ref:
            positions.append(pos)
        elif flat and kind not in _NO_REFS and has_ref(a):
            flat = False
    if flat and args and len(positions) == len(args):  # the common case: refs only
        indices = [a.index for a in args]
        if len(indices) == 1:
            only = indices[0]
            return lambda env: (env[only],)  # noqa: E731
        return operator.itemgetter(*indices)
    if flat and not positions:
        return lambda env, _a=tuple(args): _a  # noqa: E731
    if flat:  # refs and constants
        indices = [args[i].index for i in positions]
        template = list(args)

        def flat(env):
            a = template.copy()
            for pos, idx in zip(positions, indices):
                a[pos] = env[idx]
            return a
        return flat
    if all(isinstance(a, Ref) or _is_ref_list(a) or not has_ref(a) for a in args):
        # foreach ops: lists of refs, one level deep
        parts = []
        for a in args:
            if isinstance(a, Ref):
                parts.append((0, a.index))
            elif _is_ref_list(a):
                getter = operator.itemgetter(*[x.index for x in a])
                parts.append((1, getter) if len(a) > 1 else (2, a[0].index))
            else:
                parts.append((3, a))

        def lists(env):
            out = []
            for kind, v in parts:
                if kind == 0:
                    out.append(env[v])
                elif kind == 1:
                    out.append(list(v(env)))
                elif kind == 2:
                    out.append([env[v]])
                else:
                    out.append(v)
            return out
        return lists
    return lambda env, _a=args: _materialize(_a, env)  # noqa: E731


def _is_ref_list(v) -> bool:
    return isinstance(v, list) and len(v) > 0 and all(isinstance(x, Ref) for x in v)


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


def _last_uses(nodes: list[DecodedNode], skip: set[int] = frozenset()) -> dict[int, int]:
    """value index -> index of the last call node that reads it (outputs are never freed).

    Nodes in ``skip`` run elsewhere (folded at build, unpacked by their source) and read nothing
    at step time; what they read stays alive through the node that replaced them."""
    last: dict[int, int] = {}
    for i, n in enumerate(nodes):
        if n.op == "call_function" and i not in skip:
            for r in n.refs:
                last[r] = i
    outputs = refs_in(nodes[-1].args)  # what the output node reads
    return {v: user for v, user in last.items() if v not in outputs}  # graph outputs stay alive

"""Check a decoded graph against its state layout on meta tensors, before anything runs.

Some allowed ops describe memory with numbers the graph supplies (views from sizes, strides
and offsets; factory ops with a size), and a few of torch's own kernels do not bounds-check
them. So before a loaded graph runs, every node's arguments are checked against its op's
contract (``contracts``: the size, dtype, stride and overlap relations its CPU and CUDA
kernels assume; torch's meta kernels are no bounds checks), then the node is executed on
``meta`` tensors shaped by the layout (no data, no allocation, no random numbers drawn), and
every tensor it produces must

* be a plain strided tensor (no sparse or other layouts),
* lie inside its storage (offset and strides within the storage's bytes), and
* not be larger than ``limits.LoadLimits`` allows relative to the layout's tensors.

A graph that fails any of these, or that cannot run on its own layout at all (wrong argument
types, shapes that do not fit), is refused with ``UnsafeArtifactError`` /
``CorruptArtifactError`` naming the node. This costs about as much as one eager step's Python
overhead, once per load.
"""

from __future__ import annotations

import functools
import math
import operator
from typing import Any

import torch
import torch.distributed._functional_collectives  # noqa: F401  (meta kernels of the collectives)

from .contracts import Broken, check_call
from .device_results import corrected
from ..errors import CorruptArtifactError, LoadLimitError, UnsafeArtifactError
from .fused_meta import FUSED_STEPS, standin
from .limits import ENV_LOAD_LIMITS, LoadLimits, load_limits
from .shape_rules import DECLINE, foreach_index
from .serialize import DecodedNode, Ref

__all__ = ["check_graph", "check_node", "tensor_limit"]

_META = torch.device("meta")


def _dtype(name: Any) -> torch.dtype:
    value = getattr(torch, name, None) if isinstance(name, str) and name.isidentifier() else None
    if not isinstance(value, torch.dtype):
        raise CorruptArtifactError(f"layout names unknown dtype {str(name)[:40]!r}")
    return value


def _shape(value: Any, what: str) -> list[int]:
    if (not isinstance(value, list) or len(value) > 64
            or not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 1 << 48 for d in value)):
        raise CorruptArtifactError(f"layout {what} {str(value)[:80]!r} is not a list of sizes")
    return value


def _bytes(shape: list[int], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def tensor_limit(inputs: list[dict], limits: LoadLimits) -> int:
    """The most bytes one tensor of this graph may hold (see ``LoadLimits``)."""
    sizes = []
    for entry in inputs:
        dtype = _dtype(entry.get("dtype"))
        shape = entry.get("global_shape", entry.get("local_shape"))
        sizes.append(_bytes(_shape(shape, "global shape"), dtype))
    return max([limits.tensor_floor, limits.tensor_factor * max(sizes, default=0), sum(sizes)])


def _meta_value(v, env: list):
    """A decoded argument with each reference replaced by its node's meta value (decoded values
    are of these exact types; the isinstance tests are a fallback)."""
    kind = type(v)
    if kind is Ref:
        return env[v.index]
    if kind is tuple or kind is list:
        return kind([_meta_value(x, env) for x in v])
    if kind in _SCALARS:
        return v
    if kind is dict:
        return {k: _meta_value(x, env) for k, x in v.items()}
    if isinstance(v, Ref):
        return env[v.index]
    if isinstance(v, torch.device):
        return _META
    if isinstance(v, (list, tuple)):
        return type(v)(_meta_value(x, env) for x in v)
    if isinstance(v, dict):
        return {k: _meta_value(x, env) for k, x in v.items()}
    if isinstance(v, slice):
        return slice(_meta_value(v.start, env), _meta_value(v.stop, env), _meta_value(v.step, env))
    return v


def _input_value(entry: dict, i: int, limit: int) -> torch.Tensor:
    """The meta tensor of layout input ``i``, refused past the graph's tensor limit."""
    shape, dtype = _shape(entry.get("local_shape"), "local shape"), _dtype(entry.get("dtype"))
    if _bytes(shape, dtype) > limit:
        raise CorruptArtifactError(f"layout input {i} is {_bytes(shape, dtype)} bytes, over the limit")
    return torch.empty(shape, dtype=dtype, device=_META)


def check_graph(nodes: list[DecodedNode], constants: dict[str, torch.Tensor], inputs: list[dict],
                limits: LoadLimits | None = None, *, device_type: str) -> list[Any]:
    """Run ``nodes`` on meta tensors shaped as ``inputs`` (the layout) and check every result;
    returns every node's meta value, as the artifact's ``device_type`` kernels return it
    (``device_results.py``; the program's run-time invariants compare real results with them:
    ``interpreter/invariants.py``)."""
    limits = limits or load_limits()
    limit = tensor_limit(inputs, limits)
    placeholders = sum(1 for n in nodes if n.op == "placeholder")
    if placeholders != len(inputs):
        raise CorruptArtifactError(f"graph has {placeholders} inputs, its layout {len(inputs)}")
    env: list[Any] = [None] * len(nodes)
    # Torch's meta kernels for most ops are Python and cost ~0.5 ms a call; layers repeat, so
    # the result of an op on inputs of the same metadata is remembered and rebuilt (~20 us).
    memo: dict = {}
    # Distinct metadata defeats the memo (2M nodes adding 2M different scalars), and one node
    # may list a million tensors: the meta work is bounded in units of a memo hit, charged
    # before each call runs (``_Work``).
    work = _Work(limits.meta_work)
    # id(meta tensor) -> (its metadata, its storage): every tensor a signature meets is held by
    # ``env`` until the check returns (so ids are not reused), and no node may change the
    # geometry or storage size of a tensor (``check_node``), so its metadata is read once.
    described: dict[int, tuple] = {}
    # id(op) -> (whether it makes tensors on a device, its per-index lists if a foreach op): an
    # op overload hashes in Python, so what is asked of every node is looked up by id (the
    # nodes hold every op until the check returns), the memo's key included.
    facts: dict[int, tuple] = {}

    def meta(v):
        return _meta_value(v, env)

    for i, node in enumerate(nodes):
        if node.op == "placeholder":
            env[i] = _input_value(inputs[i], i, limit)
        elif node.op == "get_attr":
            if node.target not in constants:
                raise CorruptArtifactError(f"graph reads constant {node.target!r}, which is not stored")
            env[i] = constants[node.target].to(_META)
        elif node.op == "call_function":
            target = node.target
            if target is operator.getitem and not node.kwargs and len(node.args) == 2:
                seq, k = meta(node.args)
                if type(seq) in (list, tuple) and type(k) is int and -len(seq) <= k < len(seq):
                    # an item of a multi-output op's result, checked when that op ran: itself
                    work.spend(node, 1)
                    env[i] = seq[k]
                    continue
            fact = facts.get(id(target))
            if fact is None:
                fact = facts[id(target)] = (_makes_tensors_on_a_device(target), _per_index(target))
            tensors: list[torch.Tensor] = []
            storages: dict[int, int] = {}  # storage id -> index of the first tensor on it
            # the meta arguments and the memo's key of them, in one walk (``_keyed``); a foreach
            # op over every parameter (a list of over 16) is unique in its graph: no key
            args, key = _keyed_args(node.args, env, tensors, storages, described)
            if fact[0] and node.kwargs.get("device") is None:
                kwargs = meta(node.kwargs)
                kwargs["device"] = _META  # no device: the default (CPU) would allocate for real
                kwargs_key = _signature_or_none(kwargs, tensors, storages, described) if key is not None else None
            else:
                kwargs, kwargs_key = _keyed(node.kwargs, env, tensors, storages, described)
            elements = _elements(target, args, kwargs) if fact[1] else None
            if elements is not None:
                env[i] = corrected(device_type, target, args, kwargs,
                                   _check_foreach(node, args, kwargs, elements, memo, work, limit, described))
                continue
            key = None if key is None or kwargs_key is None else (id(target), key, kwargs_key)
            known = memo.get(key) if key is not None else None
            if known is not None:  # same op on the same metadata: same (already checked) result
                work.spend(node, 1)
                env[i] = _rebuild(known, tensors)
                continue
            work.spend(node, _run_cost(node, args, tensors if key is not None else None))
            env[i] = corrected(device_type, node.target, args, kwargs, check_node(node, args, kwargs, limit))
            if key is not None:
                memo[key] = _describe(env[i], storages)
    return env


# What the meta check's work costs, in units of one memo hit (~20 us: a signature and a
# rebuilt meta tensor). A contract plus a meta kernel run costs up to ~0.4 ms (torch's Python
# meta kernels: ``clamp_min``, ``mul.Scalar``) and every tensor argument ~80 us more (a foreach
# op over 20,000 tensors: 81 us each), so a run is charged RUN_COST plus TENSOR_COST per
# tensor. A traced 48-layer AdamW step for 8 ranks spends 29k (shard) to 50k (replicate) units;
# ``LoadLimits.meta_work`` allows 400k (the costliest crafted graphs: 5-9 s on 2 busy cores).
RUN_COST, TENSOR_COST = 16, 4


class _Work:
    """The meta check's budget: ``spend`` charges a node's cost before its work is done and
    refuses the graph once the total passes ``LoadLimits.meta_work``."""

    __slots__ = ("budget", "spent")

    def __init__(self, budget: int) -> None:
        self.budget, self.spent = budget, 0

    def spend(self, node: DecodedNode, units: int) -> None:
        self.spent += units
        if self.spent > self.budget:
            raise LoadLimitError(
                f"node {node.name} ({_name(node.target)}) brings the graph check past the load limit "
                f"meta_work={self.budget} (units of one remembered op result; a run of an op's contract "
                f"and meta kernel costs {RUN_COST}, plus {TENSOR_COST} per tensor argument): the graph "
                "has more distinct op calls, or longer tensor lists, than any traced step this size; "
                f"if the artifact is yours, raise it with {ENV_LOAD_LIMITS}=meta_work=...")


def _run_cost(node: DecodedNode, args: tuple, tensors: list | None) -> int:
    """What running ``node`` costs: ``getitem`` (one element of a foreach op's results) 1, an op
    ``RUN_COST`` plus ``TENSOR_COST`` per tensor argument (``tensors``: those the memo key
    collected; None: count them in ``args``, a foreach op's long lists)."""
    if node.target is operator.getitem:
        return 1
    if tensors is None:
        n = sum(isinstance(x, torch.Tensor) for a in args for x in (a if isinstance(a, (list, tuple)) else (a,)))
    else:
        n = len(tensors)
    return RUN_COST + TENSOR_COST * n


def check_node(node: DecodedNode, args: tuple, kwargs: dict, limit: int, *, contract: bool = True) -> Any:
    """One call on meta arguments: its op's contract, then its meta kernel, then every result
    (plain strided, inside its storage, within ``limit`` bytes); returns the meta result.
    ``contract=False``: one index of a foreach op whose whole call's contract was checked."""
    if contract and node.target is not operator.getitem:
        _check_contract(node, args, kwargs)
    written = [(t, _geometry(t)) for t in _written_tensors(node.target, args, kwargs)]
    try:
        run = _STANDINS.get(node.target, node.target)
        value = run(*args, **kwargs)
    except Exception as exc:  # the graph does not fit its own layout
        raise CorruptArtifactError(
            f"node {node.name} ({_name(node.target)}) cannot run on the artifact's layout: "
            f"{type(exc).__name__}: {str(exc)[:300]}") from None
    for t, before in written:
        if _geometry(t) != before:  # e.g. ``mm.out`` into a wrongly shaped ``out`` resizes it
            raise UnsafeArtifactError(
                f"node {node.name} ({_name(node.target)}) changes the shape or strides of a tensor "
                f"it writes, from {before} to {_geometry(t)}")
    _check_result(node, value, limit)
    return value


# Foreach ops. Their meta kernel (and their CPU kernel) is the per-tensor op called once per
# index of their lists, each a Python meta kernel of ~0.2 ms: an AdamW step's foreach ops over
# every parameter were most of a first load's check (~100 ms of ~160 for a 12-layer LM). The
# same call on one-element lists gives index i's result, and parameters repeat their shapes
# layer after layer, so the check runs the op per index through the memo: the contract still
# checks the whole call (list lengths, broadcasting per index), the meta kernel runs once per
# distinct index signature, and every index's result is checked as any op's result is.


@functools.cache
def _per_index(op) -> tuple | None:
    """A foreach op's (per-index list argument positions and names, whether it returns
    tensors); None for any other op."""
    schema = getattr(op, "_schema", None)
    if schema is None or not schema.name.startswith("aten::_foreach_"):
        return None
    lists = tuple((pos, a.name) for pos, a in enumerate(schema.arguments)
                  if str(a.type) in ("List[Tensor]", "List[number]"))
    return (lists, bool(schema.returns)) if lists else None


def _elements(op, args: tuple, kwargs: dict) -> tuple[list, int] | None:
    """How a foreach call splits into per-index calls, each with one-element lists: (the list
    arguments, as (("a", position) or ("k", name), list), the number of indices); None for
    other ops and for calls that do not split evenly (lists of different or zero length, a
    tensor argument of one value per index), which run whole."""
    spec = _per_index(op)
    if spec is None:
        return None
    lists, _ = spec
    found = []
    for pos, name in lists:
        where = ("a", pos) if pos < len(args) else ("k", name)
        value = args[pos] if pos < len(args) else kwargs.get(name)
        if not isinstance(value, (list, tuple)):
            return None
        found.append((where, value))
    n = len(found[0][1])
    if n == 0 or any(len(v) != n for _, v in found):
        return None
    positions = {pos for (kind, pos), _ in found if kind == "a"}
    names = {name for (kind, name), _ in found if kind == "k"}
    for pos, a in enumerate(args):
        if pos not in positions and isinstance(a, torch.Tensor) and a.dim() != 0:
            return None
    for name, a in kwargs.items():
        if name not in names and isinstance(a, torch.Tensor) and a.dim() != 0:
            return None
    return found, n


def _element(args: tuple, kwargs: dict, found: list, k: int) -> tuple[tuple, dict]:
    """Index ``k``'s call (args, kwargs) of a foreach call split as ``_elements`` says."""
    eargs, ekwargs = list(args), dict(kwargs)
    for (kind, where), value in found:
        if kind == "a":
            eargs[where] = [value[k]]
        else:
            ekwargs[where] = [value[k]]
    return tuple(eargs), ekwargs


def _check_foreach(node: DecodedNode, args: tuple, kwargs: dict, elements: tuple, memo: dict, work: _Work,
                   limit: int, described: dict) -> Any:
    """A foreach call: its contract on the whole call, then each index's call through the memo
    (see above); the whole call's result (None for an in-place op, else the list of results).
    Charged as a run over all its tensors up front, then 1 per index the memo answers and a
    run per index it does not."""
    n_tensors = sum(isinstance(x, torch.Tensor) for a in (*args, *kwargs.values())
                    for x in (a if isinstance(a, (list, tuple)) else (a,)))
    work.spend(node, RUN_COST + TENSOR_COST * n_tensors)
    _check_contract(node, args, kwargs)
    found, n = elements
    try:
        parts = _index_key_parts(args, kwargs, found, described)
    except TypeError:  # an unhashable argument: every index runs
        parts = None
    results = []
    for k in range(n):
        tensors: list[torch.Tensor] = []
        storages: dict[int, int] = {}
        try:
            key = None if parts is None else _index_key(node.target, parts, k, tensors, storages, described)
        except TypeError:
            key = None
        known = memo.get(key) if key is not None else None
        if known is not None:
            work.spend(node, 1)
            value = _rebuild(known, tensors)
        else:
            work.spend(node, RUN_COST)
            eargs, ekwargs = _element(args, kwargs, found, k)
            value = foreach_index(node.target, eargs, ekwargs)  # dense, one shape and dtype: no kernel needed
            if value is DECLINE:
                value = check_node(node, eargs, ekwargs, limit, contract=False)
            else:
                _check_result(node, value, limit)
            if key is not None:
                memo[key] = _describe(value, storages)
        results.append(value)
    if not _per_index(node.target)[1]:
        return None
    return [v for value in results for v in value]


def _index_key_parts(args: tuple, kwargs: dict, found: list, described: dict) -> tuple[list, list]:
    """What each argument adds to an index's memo key (``_index_key``): ("list", its list) for a
    per-index list, ("same", its signature) for one that holds no tensor (the same at every
    index, computed once), ("each", the value) for one whose signature depends on the tensors
    before it (its storage's position)."""
    lists = dict(found)

    def part(where, value):
        if where in lists:
            return ("list", value)
        probe: list = []
        signature = _signature(value, probe, {}, described)
        return ("same", signature) if not probe else ("each", value)
    return ([part(("a", pos), a) for pos, a in enumerate(args)],
            [(name, part(("k", name), a)) for name, a in kwargs.items()])


def _index_key(target, parts: tuple[list, list], k: int, tensors: list, storages: dict[int, int],
               described: dict) -> tuple:
    """The memo key of index ``k``'s call: exactly ``(id(op), _signature(args), _signature(kwargs))``
    of the call ``_element`` builds, without building it."""
    def one(part):
        kind, value = part
        if kind == "list":  # the index's call holds a one-element list
            return ("list", (_signature(value[k], tensors, storages, described),))
        if kind == "same":
            return value
        return _signature(value, tensors, storages, described)
    args_parts, kwargs_parts = parts
    return (id(target), ("tuple", tuple([one(p) for p in args_parts])),
            ("D", tuple([(name, one(p)) for name, p in kwargs_parts])))


def _check_contract(node: DecodedNode, args: tuple, kwargs: dict) -> None:
    """The node's arguments against its op's contract, before its meta kernel runs (memo hits
    skip this: same op on the same metadata, already checked)."""
    try:
        check_call(node.target, args, kwargs)
    except Broken as exc:
        raise UnsafeArtifactError(f"node {node.name} ({_name(node.target)}) breaks its op's argument contract: "
                                  f"{exc}") from None
    except LookupError as exc:
        raise UnsafeArtifactError(f"node {node.name}: {exc}; an allowed op runs only with a contract") from None


def _geometry(t: torch.Tensor) -> tuple:
    return tuple(t.shape), t.stride(), t.storage_offset(), t.untyped_storage().nbytes()


def _written_tensors(op, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors an op writes (schema ``(a!)``): it may change their values, never their
    geometry, which is what the checks of later nodes rely on (ops that change geometry in
    place are refused by name: allowlist.REFUSED)."""
    schema = getattr(op, "_schema", None)
    if schema is None or not schema.is_mutable:
        return []
    out = []
    for pos, arg in enumerate(schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = args[pos] if pos < len(args) else kwargs.get(arg.name)
        out += [v for v in (value if isinstance(value, (list, tuple)) else [value]) if isinstance(v, torch.Tensor)]
    return out


@functools.cache
def _makes_tensors_on_a_device(op) -> bool:
    """Factory ops (``full``, ``empty``, ``arange``, ...): their device is a keyword argument."""
    schema = getattr(op, "_schema", None)
    return schema is not None and any(a.name == "device" and a.kwarg_only for a in schema.arguments)


# Fused steps: torch has no meta kernel for some and a lax one for others; their contract is the check.
_STANDINS = {op: standin(op) for op in FUSED_STEPS}


_SCALARS = frozenset((int, float, bool, str, type(None), torch.dtype))
_TENSOR = torch.Tensor


def _signature(v, tensors: list, storages: dict[int, int], described: dict[int, tuple]) -> Any:
    """A hashable description of an argument's metadata; tensors are collected in order, and
    ``storages`` maps each storage to the first collected tensor on it (aliasing is part of
    the key). ``described``: id(tensor) -> (metadata, storage id), filled as tensors are met."""
    kind = type(v)
    if kind is _TENSOR or (kind not in _SCALARS and isinstance(v, _TENSOR)):
        tensors.append(v)
        known = described.get(id(v))
        if known is None:
            storage = v.untyped_storage()
            known = described[id(v)] = ((tuple(v.shape), v.stride(), v.storage_offset(), v.dtype, storage.nbytes()),
                                        storage._cdata)
        return ("T", known[0], storages.setdefault(known[1], len(tensors) - 1))
    if kind is tuple or kind is list:
        return (kind.__name__, tuple([_signature(x, tensors, storages, described) for x in v]))
    if kind is float:
        return ("F", v.hex())  # -0.0, nan: exact
    if kind in _SCALARS:
        return (kind.__name__, v)
    if isinstance(v, (list, tuple)):
        return (type(v).__name__, tuple(_signature(x, tensors, storages, described) for x in v))
    if isinstance(v, dict):
        return ("D", tuple((k, _signature(x, tensors, storages, described)) for k, x in v.items()))
    if isinstance(v, slice):
        return ("S", v.start, v.stop, v.step)
    if isinstance(v, float):
        return ("F", v.hex())
    hash(v)
    return (type(v).__name__, v)


def _signature_or_none(v, tensors: list, storages: dict[int, int], described: dict[int, tuple]) -> Any:
    """``_signature``, or None for an unhashable argument (no memo: the node runs)."""
    try:
        return _signature(v, tensors, storages, described)
    except TypeError:
        return None


def _keyed(v, env: list, tensors: list, storages: dict[int, int], described: dict[int, tuple]) -> tuple:
    """(``_meta_value(v, env)``, ``_signature`` of that value) in one walk of a decoded argument,
    the signature None where it is unhashable. Exactly the two functions' results: decoded
    references, tuples, lists and plain scalars are handled here (nearly every argument); any
    other value is passed to the two functions themselves."""
    kind = type(v)
    if kind is Ref:
        x = env[v.index]
        if type(x) is _TENSOR:
            tensors.append(x)
            known = described.get(id(x))
            if known is None:
                storage = x.untyped_storage()
                known = described[id(x)] = ((tuple(x.shape), x.stride(), x.storage_offset(), x.dtype,
                                             storage.nbytes()), storage._cdata)
            return x, ("T", known[0], storages.setdefault(known[1], len(tensors) - 1))
        return x, _signature_or_none(x, tensors, storages, described)
    if kind is tuple or kind is list:
        values, keys = [], []
        for a in v:
            value, key = _keyed(a, env, tensors, storages, described)
            values.append(value)
            keys.append(key)
        return kind(values), (None if None in keys else (kind.__name__, tuple(keys)))
    if kind is float:
        return v, ("F", v.hex())  # -0.0, nan: exact
    if kind in _SCALARS:
        return v, (kind.__name__, v)
    if kind is dict:
        values, keys = {}, []
        for k, a in v.items():
            value, key = _keyed(a, env, tensors, storages, described)
            values[k] = value
            keys.append((k, key))
        return values, (None if any(key is None for _, key in keys) else ("D", tuple(keys)))
    value = _meta_value(v, env)
    return value, _signature_or_none(value, tensors, storages, described)


def _keyed_args(args: tuple, env: list, tensors: list, storages: dict[int, int],
                described: dict[int, tuple]) -> tuple:
    """``_keyed`` of a node's positional arguments; no key (None) when one is a list or tuple of
    more than 16 (a foreach op over every parameter: unique in its graph, never a memo hit)."""
    for a in args:
        value = env[a.index] if type(a) is Ref else a
        if isinstance(value, (list, tuple)) and len(value) > 16:
            return _meta_value(args, env), None
    return _keyed(args, env, tensors, storages, described)


def _describe(value: Any, storages: dict[int, int]) -> Any:
    """How to rebuild ``value`` from inputs: each tensor as a view of an input's storage, or new."""
    if isinstance(value, (list, tuple)):
        return (type(value), [_describe(v, storages) for v in value])
    if not isinstance(value, torch.Tensor):
        return ("value", value)
    source = storages.get(value.untyped_storage()._cdata)
    return ("tensor", source, value.untyped_storage().nbytes(), value.dtype, tuple(value.shape), value.stride(),
            value.storage_offset())


def _rebuild(desc: Any, tensors: list) -> Any:
    if desc[0] == "value":
        return desc[1]
    if desc[0] != "tensor":
        return desc[0](_rebuild(d, tensors) for d in desc[1])
    _, source, nbytes, dtype, shape, stride, offset = desc
    # the same tensor two ways, the cheaper first (half the cost; thousands of memo hits a load)
    if source is None:
        fresh = torch.empty_strided(shape, stride, dtype=dtype, device=_META)
        if offset == 0 and fresh.untyped_storage().nbytes() == nbytes:
            return fresh
        storage = torch.UntypedStorage(nbytes, device=_META)
    else:
        base = tensors[source]
        if base.dtype == dtype:
            try:
                return base.as_strided(shape, stride, offset)  # a view of the same storage
            except RuntimeError:  # what as_strided refuses, set_ builds as the kernel did
                pass
        storage = base.untyped_storage()
    return torch.empty(0, dtype=dtype, device=_META).set_(storage, offset, shape, stride)


def _name(target) -> str:
    return getattr(target, "__name__", None) or str(target)


def _check_result(node: DecodedNode, value: Any, limit: int) -> None:
    if isinstance(value, (list, tuple)):
        for v in value:
            _check_result(node, v, limit)
        return
    if not isinstance(value, torch.Tensor):
        return
    where = f"node {node.name} ({_name(node.target)})"
    if value.layout != torch.strided:
        raise UnsafeArtifactError(f"{where} makes a {value.layout} tensor; only strided tensors are allowed")
    storage = value.untyped_storage().nbytes()
    if storage > limit:
        raise UnsafeArtifactError(
            f"{where} would create a tensor of {storage} bytes, more than this artifact's limit of "
            f"{limit} bytes (tensor_factor x its largest state tensor, its whole state, or tensor_floor); "
            "if the artifact is yours, raise it with SPMD_AOT_LOAD_LIMITS")
    if value.numel() == 0:
        return
    offset = value.storage_offset()
    if offset < 0 or any(s < 0 for s in value.stride()):
        raise UnsafeArtifactError(f"{where} makes a view with a negative offset or stride")
    last = offset + sum((n - 1) * s for n, s in zip(value.shape, value.stride()))
    if (last + 1) * value.element_size() > storage:
        raise UnsafeArtifactError(
            f"{where} makes a view of shape {list(value.shape)}, strides {list(value.stride())}, offset "
            f"{offset} that reaches byte {(last + 1) * value.element_size()} of a {storage}-byte storage")

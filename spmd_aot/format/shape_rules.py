"""The result of one index of an elementwise foreach op, from its arguments' metadata alone.

Why: the load check runs a foreach call index by index through its memo (``validate.py``), and
each index its memo has not seen runs the op's meta kernel, a chain of Python decompositions of
~0.15 ms (an AdamW step's foreach calls over a 12-layer LM's parameters: ~110 such runs, about a
quarter of a first load's check). For the elementwise ops an optimizer calls, an index whose
tensors are all dense, of one shape and one floating dtype has an obvious result: a new dense
tensor of that shape and dtype (out of place), or nothing (in place: ``self`` keeps its shape,
strides and storage); 0-dim tensors of a floating dtype may be mixed in (``foreach_index``).
That is what torch's meta kernels give for exactly those arguments
(``tests/format/test_shape_rules.py`` compares every op here with its meta kernel over shapes,
dtypes and scalars, including the arguments the rule declines).

Anything else is declined (``DECLINE``) and the meta kernel runs as before: another dtype,
dtypes that differ, strides other than the dense ones (size-1 dimensions included), an empty
tensor, a 0-dim tensor of a dtype that is not floating, an in-place op whose written tensor the
others would broadcast, a scalar that is not a finite float or a small int, an argument the
schema does not name. A rule never replaces the checks around the run: the whole call's
contract ran before, the result is checked as any result is (``validate._check_result``),
remembered by the memo under the same key, and compared with the real result by the run-time
invariants (``interpreter/invariants.py``).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch

__all__ = ["DECLINE", "foreach_index", "FOREACH_ELEMENTWISE"]

DECLINE = object()  # the rule does not say: run the meta kernel

# aten foreach ops (name without overload) whose per-index op is elementwise arithmetic
FOREACH_ELEMENTWISE = frozenset(
    f"_foreach_{name}{suffix}" for name in ("add", "sub", "mul", "div", "addcmul", "addcdiv", "sqrt", "lerp",
                                            "maximum", "minimum", "clamp_min", "clamp_max", "neg", "reciprocal",
                                            "pow", "abs", "exp", "sign")
    for suffix in ("", "_"))

_DTYPES = frozenset((torch.float32, torch.float64, torch.bfloat16))
_FLOATING = frozenset((torch.float16, torch.bfloat16, torch.float32, torch.float64))
_META = torch.device("meta")
_KINDS = {"List[Tensor]": "tensors", "Tensor": "tensor", "number": "scalar", "List[number]": "scalars"}
_INT_BOUND = 1 << 53  # exactly a float64
# kernels that want the per-index ``scalars`` tensor on the host (its values are read there)
_SCALARS_ON_HOST = frozenset(("_foreach_addcmul", "_foreach_addcdiv"))
# kernels that want every tensor of an index in one dtype, 0-dim ones included
_ONE_DTYPE = frozenset(("_foreach_lerp",))
_FLOAT_BOUND = 1e38  # within float32's and bfloat16's range


@functools.cache
def _arguments(op) -> tuple | None:
    """((name, kind), ...) of the op's schema arguments, whether it returns tensors, how many it
    takes positionally, whether its 0-dim tensors must have the others' dtype; None for an op the
    rules do not cover (not an elementwise foreach op, an argument of another type, an ``out=``
    overload, a tensor its kernel reads on the host)."""
    schema = getattr(op, "_schema", None)
    if schema is None or not schema.name.startswith("aten::") or schema.name[6:] not in FOREACH_ELEMENTWISE:
        return None
    out, positional = [], 0
    base = schema.name[6:].rstrip("_")
    for pos, a in enumerate(schema.arguments):
        kind = _KINDS.get(str(a.type))
        if kind is None or (a.alias_info is not None and (pos, kind) != (0, "tensors")):
            return None  # only ``self`` may be written (not an ``out=`` list, which may be resized)
        if kind == "tensor" and base in _SCALARS_ON_HOST:
            return None
        out.append((a.name, kind))
        positional += not a.kwarg_only
    returns = [str(r.type) for r in schema.returns]
    if returns not in ([], ["List[Tensor]"]) or (not returns and schema.arguments[0].alias_info is None):
        return None
    return tuple(out), bool(returns), positional, base in _ONE_DTYPE


def _dense_strides(shape: tuple) -> tuple:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def _scalar_ok(v: Any) -> bool:
    kind = type(v)
    if kind is bool:
        return True
    if kind is int:
        return -_INT_BOUND < v < _INT_BOUND
    return kind is float and math.isfinite(v) and abs(v) < _FLOAT_BOUND


def foreach_index(op, args: tuple, kwargs: dict) -> Any:
    """The meta result of one index's call of foreach ``op`` (one-element lists, as
    ``validate._check_foreach`` builds it): a one-element list holding a new dense tensor, None for
    an in-place op, or ``DECLINE``.

    The tensors with dimensions must share one shape and dtype (float32, float64 or bfloat16) and
    be dense; 0-dim tensors (hyperparameters, step counts: what an optimizer mixes in) of a
    floating dtype broadcast and take that dtype, as torch's type promotion gives a dimensioned
    tensor's dtype precedence over a 0-dim one of the same category; a written list must hold a
    tensor of the result's shape (an in-place op cannot resize it)."""
    known = _arguments(op)
    if known is None:
        return DECLINE
    arguments, returns, positional, one_dtype = known
    if len(args) > positional or not set(kwargs) <= {name for name, _ in arguments[len(args):]}:
        return DECLINE
    shape = dtype = None  # of the tensors with dimensions
    scalars: set = set()  # dtypes of the 0-dim tensors
    written: list = []  # shapes of the tensors an in-place op writes
    for pos, (name, kind) in enumerate(arguments):
        if pos < len(args):
            value = args[pos]
        elif name in kwargs:
            value = kwargs[name]
        elif kind == "scalar":  # a default (alpha=1, value=1)
            continue
        else:
            return DECLINE
        if kind in ("tensors", "scalars"):
            if type(value) is not list or len(value) != 1:
                return DECLINE
            value = value[0]
        if kind in ("scalar", "scalars"):
            if not _scalar_ok(value):
                return DECLINE
            continue
        if type(value) is not torch.Tensor or value.device != _META or value.layout != torch.strided:
            return DECLINE
        if pos == 0 and not returns:
            written.append(tuple(value.shape))
        if value.dim() == 0:
            scalars.add(value.dtype)
            continue
        if kind == "tensor":  # one value for every index: ``_elements`` splits only 0-dim ones
            return DECLINE
        size = tuple(value.shape)
        if value.numel() == 0 or value.stride() != _dense_strides(size):
            return DECLINE
        if shape is None:
            shape, dtype = size, value.dtype
        elif size != shape or value.dtype != dtype:
            return DECLINE
    if not scalars <= ({dtype} if one_dtype and dtype is not None else _FLOATING):
        return DECLINE
    if shape is None:  # only 0-dim tensors: one dtype among them
        if len(scalars) != 1:
            return DECLINE
        shape, (dtype,) = (), scalars
    if dtype not in _DTYPES or any(w != shape for w in written):
        return DECLINE
    return [torch.empty(shape, dtype=dtype, device=_META)] if returns else None

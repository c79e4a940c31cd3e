"""The load check's shape rules (``format/shape_rules.py``) give what torch's meta kernels give:
every overload of every elementwise foreach op the rules cover, over shapes, dtypes, 0-dim
tensors mixed in and scalars, compared with the op's own meta kernel on the same arguments; an
argument set the rule accepts is one the meta kernel accepts, and the ones it must leave to the
kernel (strides, dtypes, broadcasting into a written tensor) are declined."""

from __future__ import annotations

import itertools

import pytest
import torch

from spmd_aot.format import shape_rules
from spmd_aot.format.shape_rules import DECLINE, foreach_index
from spmd_aot.interpreter.invariants import describe

META = torch.device("meta")
SHAPES = [(4, 3), (2, 1, 3), ()]
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64]


def _overloads():
    out = []
    for name in sorted(shape_rules.FOREACH_ELEMENTWISE):
        packet = getattr(torch.ops.aten, name, None)
        for overload in packet.overloads() if packet is not None else ():
            op = getattr(packet, overload)
            if shape_rules._arguments(op) is not None:
                out.append(op)
    return out


OPS = _overloads()


def _arguments(op, shape, dtype, scalar, zero_dim: torch.dtype | None):
    """Positional arguments of one index's call: lists of one tensor (the written one of ``shape``;
    the others too, or 0-dim of ``zero_dim``), a 0-dim tensor where one value serves every index."""
    arguments, _, positional, _ = shape_rules._arguments(op)
    out = []
    for pos, (_name, kind) in enumerate(arguments[:positional]):
        if kind == "tensors":
            size = () if zero_dim is not None and pos > 0 else shape
            out.append([torch.empty(size, dtype=zero_dim if size == () and zero_dim else dtype, device=META)])
        elif kind == "tensor":
            out.append(torch.empty((), dtype=zero_dim or dtype, device=META))
        elif kind == "scalars":
            out.append([scalar])
        else:
            out.append(scalar)
    return tuple(out)


def _meta(op, args):
    try:
        return op(*args)
    except Exception as exc:  # noqa: BLE001  (what the kernel refuses, the rule must decline)
        return exc


@pytest.mark.parametrize("op", OPS, ids=str)
def test_the_rule_is_the_meta_kernels_result_where_it_answers(op):
    answered = 0
    cases = [(shape, dtype, 0.5, zero_dim) for shape, dtype, zero_dim in
             itertools.product(SHAPES, DTYPES, [None, torch.float64])]
    cases += [(SHAPES[0], torch.float32, scalar, zero_dim) for scalar, zero_dim in
              [(2, None), (True, None), (-3.0, torch.float32), (0.5, torch.int64), (0.5, torch.float16)]]
    cases += [(SHAPES[0], torch.float64, 0.5, torch.float32), (SHAPES[0], torch.bfloat16, 0.5, torch.float64)]
    for shape, dtype, scalar, zero_dim in cases:
        args = _arguments(op, shape, dtype, scalar, zero_dim)
        rule = foreach_index(op, args, {})
        if rule is DECLINE:
            continue
        answered += 1
        written = [(tuple(t.shape), t.stride()) for t in args[0]] if isinstance(args[0], list) else None
        real = _meta(op, args)
        assert not isinstance(real, Exception), (op, shape, dtype, scalar, zero_dim, real)
        assert type(rule) is type(real) and describe(rule) == describe(real), (op, shape, dtype, zero_dim)
        if real is None:  # in place: the written tensor keeps its geometry
            assert [(tuple(t.shape), t.stride()) for t in args[0]] == written
    assert answered  # every covered overload has cases the rule answers


@pytest.mark.parametrize("case", ["transposed", "size_one_stride", "offset_view", "empty", "mixed_shapes",
                                  "mixed_dtypes", "int", "float16", "written_broadcast", "cpu", "huge_int",
                                  "nan_scalar", "two_elements", "unknown_kwarg"])
def test_what_the_rule_leaves_to_the_meta_kernel(case):
    aten = torch.ops.aten
    m = torch.empty(4, 3, device=META)
    op, args, kwargs = aten._foreach_mul.List, ([m], [m]), {}
    if case == "transposed":
        args = ([m.t().contiguous().t()], [m])
    elif case == "size_one_stride":
        args = ([torch.empty_strided((4, 1), (1, 7), device=META)],) * 2
    elif case == "offset_view":  # dense strides at an offset: still a new dense result (answered)
        v = torch.empty(5, 3, device=META)[1:]
        assert describe(foreach_index(op, ([v], [v]), {})) == describe(op([v], [v]))
        return
    elif case == "empty":
        e = torch.empty(0, 3, device=META)
        args = ([e], [e])
    elif case == "mixed_shapes":
        args = ([m], [torch.empty(3, device=META)])
    elif case == "mixed_dtypes":
        args = ([m], [torch.empty(4, 3, dtype=torch.float64, device=META)])
    elif case == "int":
        i = torch.empty(4, 3, dtype=torch.int64, device=META)
        args = ([i], [i])
    elif case == "float16":
        h = torch.empty(4, 3, dtype=torch.float16, device=META)
        args = ([h], [h])
    elif case == "written_broadcast":  # a 0-dim self the others would resize: the kernel refuses
        op, args = aten._foreach_mul_.List, ([torch.empty((), device=META)], [m])
        assert isinstance(_meta(op, args), Exception)
    elif case == "cpu":
        c = torch.empty(4, 3)
        args = ([c], [c])
    elif case == "huge_int":
        op, args = aten._foreach_mul.Scalar, ([m], 1 << 60)
    elif case == "nan_scalar":
        op, args = aten._foreach_mul.Scalar, ([m], float("nan"))
    elif case == "two_elements":
        args = ([m, m], [m, m])
    elif case == "unknown_kwarg":
        op, args, kwargs = aten._foreach_add.List, ([m], [m]), {"beta": 2}
    assert foreach_index(op, args, kwargs) is DECLINE


def test_ops_outside_the_rules_are_declined():
    m = torch.empty(4, 3, device=META)
    assert foreach_index(torch.ops.aten._foreach_norm.Scalar, ([m],), {}) is DECLINE
    assert foreach_index(torch.ops.aten._foreach_copy_.default, ([m], [m]), {}) is DECLINE
    assert foreach_index(torch.ops.aten.mul.Tensor, (m, m), {}) is DECLINE
    out = torch.ops.aten._foreach_mul.List_out  # writes an ``out=`` list, which the kernel may resize
    assert shape_rules._arguments(out) is None and foreach_index(out, ([m], [m]), {"out": [m]}) is DECLINE

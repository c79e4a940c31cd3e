"""The rules every contract builds on: an op's arguments bound by name from its schema, the
general rules for written tensors (no internal overlap, no overlap with what is read), and the
small relations checkers state (broadcasting, dims in range, contiguity, one-value tensors)."""

from __future__ import annotations

import functools
from typing import Any

import torch






class Broken(ValueError):
    """A contract relation does not hold: ``argument`` names the argument, the message the relation."""

    def __init__(self, argument: str, relation: str):
        super().__init__(f"argument '{argument}' {relation}")
        self.argument = argument


def _need(ok: bool, argument: str, relation: str) -> None:
    if not ok:
        raise Broken(argument, relation)


class Args(dict):
    """Schema argument name -> value (defaults filled in) for one call."""

    def t(self, name: str) -> torch.Tensor | None:
        v = self.get(name)
        return v if isinstance(v, torch.Tensor) else None

    def tensor(self, name: str) -> torch.Tensor:
        v = self.get(name)
        _need(isinstance(v, torch.Tensor), name, f"must be a tensor, got {type(v).__name__}")
        return v

    def tensors(self, name: str) -> list:
        v = self.get(name)
        _need(isinstance(v, (list, tuple)) and all(isinstance(t, torch.Tensor) for t in v), name,
              "must be a list of tensors")
        return list(v)


@functools.cache
def _schema(op) -> tuple:
    """(argument names, defaults, indices of written arguments) of an overload."""
    args = op._schema.arguments
    names = tuple(a.name for a in args)
    defaults = tuple(a.default_value if a.has_default_value() else None for a in args)
    written = frozenset(i for i, a in enumerate(args) if a.alias_info is not None and a.alias_info.is_write)
    return names, defaults, written


def _bind(op, args: tuple, kwargs: dict) -> tuple[Args, frozenset]:
    names, defaults, written = _schema(op)
    if len(args) > len(names) or any(k not in names for k in kwargs):
        raise Broken("*", f"does not fit the schema {op._schema}")
    bound = Args(zip(names, defaults))
    bound.update(zip(names, args))
    bound.update(kwargs)
    return bound, frozenset(names[i] for i in written)


def _extent(t: torch.Tensor) -> tuple[int, int]:
    """Byte range [start, end) the tensor's elements occupy in its storage."""
    if t.numel() == 0:
        return 0, 0
    size = t.element_size()
    last = t.storage_offset() + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    return t.storage_offset() * size, (last + 1) * size


def no_internal_overlap(t: torch.Tensor) -> bool:
    """No two indices of ``t`` reach the same element: sorted by stride, each dimension's stride
    steps past everything the smaller ones span (stride 0 with size > 1 fails)."""
    span = 0
    for n, s in sorted(((n, s) for n, s in zip(t.shape, t.stride()) if n > 1), key=lambda d: d[1]):
        if s <= span:
            return False
        span += (n - 1) * s
    return True


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.shape == b.shape and a.stride() == b.stride() and a.storage_offset() == b.storage_offset()
            and a.dtype == b.dtype)


def _general(bound: Args, written: frozenset, alias_ok: bool, also_written: tuple = ()) -> None:
    """Written tensors: no internal overlap, no overlap with any other argument (identical views
    allowed only where the kernel is elementwise). ``also_written``: arguments a kernel writes
    that its schema does not mark (``native_batch_norm``'s running statistics)."""
    writes = written | frozenset(also_written)
    if not writes:
        return
    by_storage: dict[int, list] = {}
    for name, value in bound.items():
        items = value if isinstance(value, (list, tuple)) else (value,)
        for k, t in enumerate(items):
            if not isinstance(t, torch.Tensor):
                continue
            label = f"{name}[{k}]" if isinstance(value, (list, tuple)) else name
            is_written = name in writes
            if is_written:
                _need(no_internal_overlap(t), label,
                      f"is written but its elements overlap (shape {list(t.shape)}, strides {list(t.stride())})")
            by_storage.setdefault(t.untyped_storage()._cdata, []).append((label, t, is_written))
    for group in by_storage.values():
        if len(group) < 2 or not any(w for _, _, w in group):
            continue
        for i, (label, t, w) in enumerate(group):
            start, end = _extent(t)
            for other_label, o, ow in group[i + 1:]:
                if not (w or ow):
                    continue
                o_start, o_end = _extent(o)
                if start < o_end and o_start < end:
                    if alias_ok and not (w and ow) and _same_view(t, o):
                        continue
                    raise Broken(label, f"overlaps argument '{other_label}' in memory, and one of them is written")


def _shape(t) -> list:
    return list(t.shape)


def _broadcast(shapes: list, names: list) -> list:
    if all(s == shapes[0] for s in shapes[1:]):  # the common case: nothing to broadcast
        return list(shapes[0]) if shapes else []
    out: list = []
    for shape, name in zip(shapes, names):
        shape = list(shape)
        if len(shape) > len(out):
            out = [1] * (len(shape) - len(out)) + out
        padded = [1] * (len(out) - len(shape)) + shape
        for i, (a, b) in enumerate(zip(out, padded)):
            _need(a == b or a == 1 or b == 1, name, f"of shape {shape} does not broadcast with {out}")
            out[i] = b if a == 1 else a
    return out


def _wrap(dim: Any, ndim: int, name: str) -> int:
    n = max(ndim, 1)
    _need(isinstance(dim, int) and -n <= dim < n, name, f"= {dim} is not a dimension of a {ndim}-d tensor")
    return dim % n


def _contiguous(t: torch.Tensor, name: str, why: str = "the kernel reads it through a raw pointer") -> None:
    _need(t.is_contiguous(), name, f"must be contiguous ({why}); strides {list(t.stride())}")


def _last_dim_dense(t: torch.Tensor, name: str) -> None:
    _need(t.dim() >= 1 and (t.stride(-1) == 1 or t.shape[-1] <= 1), name,
          f"must have stride 1 in its last dimension (the kernel reads rows as vectors); strides {list(t.stride())}")


def _one_value(t: torch.Tensor | None, name: str, dtypes=None) -> None:
    if t is None:
        return
    _need(t.numel() == 1, name, f"must hold exactly one value, has shape {_shape(t)}")
    if dtypes:
        _need(t.dtype in dtypes, name, f"must be {'/'.join(str(d) for d in dtypes)}, is {t.dtype}")


def _dtype_eq(t: torch.Tensor, ref: torch.Tensor, name: str, ref_name: str) -> None:
    _need(t.dtype == ref.dtype, name, f"has dtype {t.dtype}, must be {ref_name}'s {ref.dtype}")


def _shape_eq(t: torch.Tensor, shape, name: str, what: str) -> None:
    _need(list(t.shape) == list(shape), name, f"has shape {_shape(t)}, must be {what} = {list(shape)}")


def _opmath(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _ints(v, name: str, n: int | None = None) -> list:
    _need(isinstance(v, (list, tuple)) and all(isinstance(x, int) for x in v) and (n is None or len(v) == n),
          name, f"= {v!r} must be a list of {n if n is not None else 'some'} ints")
    return list(v)

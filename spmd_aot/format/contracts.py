"""Argument contracts: what every admitted op overload's CPU and CUDA kernels assume of their arguments.

Why: a stored graph's arguments are chosen by whoever can write the cache. Torch's kernels do
not check everything they rely on (the fused optimizer steps index every state tensor with the
parameter's element count, ``native_layer_norm_backward`` reads ``mean``/``rstd`` through raw
pointers, ``max_pool2d_with_indices_backward`` writes where its ``indices`` say), and torch's
meta kernels are no bounds checks either. So an op is admitted only with a contract here, and
``validate.py`` checks it on the meta tensors' metadata before running the node's meta kernel:

* general rules, from the op's schema, for every op: a tensor the op writes (``a!``, ``out=``)
  has no internal overlap (no stride 0, no self-overlapping strides) and overlaps no other
  argument, except the identical tensor where the kernel is elementwise (``x.add_(x)``);
* one relation checker per op family (``CONTRACTS``: overload name -> checker), as data; a
  checker states the exact size, dtype, stride and contiguity relations between arguments.

Ops whose kernels read index *values* without a bounds check get a value check at run time
(``VALUE_CHECKS``, applied by ``program.py`` right before the call). An allowed op with no
contract is refused at load (and a test keeps the allowlist covered).
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable

import torch

from .allowlist import is_opted_in

__all__ = ["CONTRACTS", "VALUE_CHECKS", "Broken", "check_call", "contract_of", "no_internal_overlap", "op_name"]

Shape = tuple


class Broken(ValueError):
    """A contract relation does not hold: ``argument`` names the argument, the message the relation."""

    def __init__(self, argument: str, relation: str):
        super().__init__(f"argument '{argument}' {relation}")
        self.argument = argument


def _need(ok: bool, argument: str, relation: str) -> None:
    if not ok:
        raise Broken(argument, relation)


# ------------------------------------------------------------------ binding and general rules
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


@functools.lru_cache(maxsize=None)
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


# ------------------------------------------------------------------ small relations
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


# ------------------------------------------------------------------ checkers (one per op family)
def unchecked_by_design(a: Args) -> None:
    """The kernel validates every size, dim and index argument itself (TORCH_CHECK before any
    memory access, proven by tools/fuzz_ops.py); only the general rules apply. Views: their
    result is also checked against its storage by validate.py."""


def storage_checked(a: Args) -> None:
    """Views from raw sizes and strides: nothing to relate between arguments; the result must lie
    inside its input's storage, which validate.py checks on every view. (``as_strided`` is refused
    by the allowlist anyway; its contract lets that storage check be tested on its own.)"""


def elementwise(a: Args, written: frozenset) -> None:
    """TensorIterator ops: tensor arguments broadcast together; a written tensor (in place or
    ``out``) already has the broadcast shape, since an iterator never resizes it safely."""
    names = [n for n, v in a.items() if isinstance(v, torch.Tensor) and n != "out"]
    shape = _broadcast([a[n].shape for n in names], names)
    for n in names + (["out"] if a.t("out") is not None else []):
        if n in written:
            _shape_eq(a[n], shape, n, "the broadcast shape of the inputs")


def dims(a: Args, *, args: tuple = ("dim",), of: str = "self") -> None:
    """Reductions and dim-taking ops: every dim names a dimension of ``of`` (no duplicates)."""
    t = a.tensor(of)
    for name in args:
        v = a.get(name)
        if v is None:
            continue
        values = v if isinstance(v, (list, tuple)) else [v]
        wrapped = [_wrap(d, t.dim(), name) for d in values]
        _need(len(set(wrapped)) == len(wrapped), name, f"= {v} names a dimension twice")


def matmul(a: Args, *, kind: str) -> None:
    """Matrix products: contraction sizes agree, dtypes equal, an ``out``/``self`` addend fits."""
    if kind in ("mm", "mm.out", "addmm"):
        x, y, xn, yn = (a.tensor("mat1"), a.tensor("mat2"), "mat1", "mat2") if kind == "addmm" else \
            (a.tensor("self"), a.tensor("mat2"), "self", "mat2")
        _need(x.dim() == 2, xn, f"must be 2-d, has shape {_shape(x)}")
        _need(y.dim() == 2, yn, f"must be 2-d, has shape {_shape(y)}")
        _need(x.shape[1] == y.shape[0], yn, f"has shape {_shape(y)}; its dim 0 must be {xn}.shape[1] = {x.shape[1]}")
        _dtype_eq(y, x, yn, xn)
        result = [x.shape[0], y.shape[1]]
        if kind == "mm.out":
            _shape_eq(a.tensor("out"), result, "out", "[self.shape[0], mat2.shape[1]]")
            _dtype_eq(a.tensor("out"), x, "out", "self")
        if kind == "addmm":
            _broadcast([a.tensor("self").shape, result], ["self", "mat1 @ mat2"])
            _dtype_eq(a.tensor("self"), x, "self", "mat1")
    elif kind in ("bmm", "baddbmm"):
        x, y, xn, yn = (a.tensor("batch1"), a.tensor("batch2"), "batch1", "batch2") if kind == "baddbmm" else \
            (a.tensor("self"), a.tensor("mat2"), "self", "mat2")
        _need(x.dim() == 3 and y.dim() == 3, yn, f"and {xn} must be 3-d: {_shape(x)}, {_shape(y)}")
        _need(x.shape[0] == y.shape[0] and x.shape[2] == y.shape[1], yn,
              f"has shape {_shape(y)}; must be [{xn}.shape[0], {xn}.shape[2], *] for {xn} {_shape(x)}")
        _dtype_eq(y, x, yn, xn)
        if kind == "baddbmm":
            _broadcast([a.tensor("self").shape, [x.shape[0], x.shape[1], y.shape[2]]], ["self", "batch1 @ batch2"])
            _dtype_eq(a.tensor("self"), x, "self", "batch1")
    elif kind == "linear":
        x, w, b = a.tensor("input"), a.tensor("weight"), a.t("bias")
        _need(w.dim() in (1, 2), "weight", f"must be 1-d or 2-d, has shape {_shape(w)}")
        _need(x.dim() >= 1 and x.shape[-1] == w.shape[-1], "weight",
              f"has shape {_shape(w)}; its last dim must be input.shape[-1]")
        _dtype_eq(w, x, "weight", "input")
        if b is not None:
            _broadcast([b.shape, [w.shape[0]] if w.dim() == 2 else []], ["bias", "the output features"])
            _dtype_eq(b, x, "bias", "input")
    else:  # matmul
        x, y = a.tensor("self"), a.tensor("other")
        _need(x.dim() >= 1 and y.dim() >= 1, "other", "and self must have at least one dimension")
        k = y.shape[0] if y.dim() == 1 else y.shape[-2]
        _need(x.shape[-1] == k, "other", f"has shape {_shape(y)}; its contracted dim must be self.shape[-1] = {x.shape[-1]}")
        _broadcast([x.shape[:-2], y.shape[:-2]], ["self", "other"])
        _dtype_eq(y, x, "other", "self")


def _norm_param(a: Args, name: str, shape, ref: torch.Tensor, what: str) -> None:
    t = a.t(name)
    if t is None:
        return
    _shape_eq(t, shape, name, what)
    _need(t.dtype in (ref.dtype, torch.float32), name, f"has dtype {t.dtype}, must be input's {ref.dtype} or float32")


def layer_norm(a: Args, *, backward: bool) -> None:
    """``input.shape[-k:] == normalized_shape``; weight and bias of ``normalized_shape``; backward:
    ``grad_out`` as ``input``, ``mean``/``rstd`` of ``input.shape[:-k] + [1]*k`` and contiguous
    (the CPU kernel reads M values through raw pointers). ``grad_out`` and ``input`` may have any
    strides: the kernel makes them contiguous first (a transposed or stride-0 ``grad_out`` gives
    the contiguous result exactly; sequence-parallel graphs pass transposed ones)."""
    x = a.tensor("input")
    ns = _ints(a.get("normalized_shape"), "normalized_shape")
    k = len(ns)
    _need(1 <= k <= x.dim() and list(x.shape[x.dim() - k:]) == ns, "normalized_shape",
          f"= {ns} must be the trailing dims of input {_shape(x)}")
    for name in ("weight", "bias"):
        _norm_param(a, name, ns, x, "normalized_shape")
    if not backward:
        return
    g = a.tensor("grad_out")
    _shape_eq(g, x.shape, "grad_out", "input.shape")
    _dtype_eq(g, x, "grad_out", "input")
    stats = list(x.shape[: x.dim() - k]) + [1] * k
    for name in ("mean", "rstd"):
        t = a.tensor(name)
        _shape_eq(t, stats, name, "input.shape[:-k] + [1]*k")
        _need(t.dtype in (x.dtype, _opmath(x.dtype)), name, f"has dtype {t.dtype}, must be input's {x.dtype}")
        _contiguous(t, name)


def batch_norm(a: Args, *, backward: bool) -> None:
    """Every per-channel vector (weight, bias, running and saved statistics) is 1-d of
    ``C = input.shape[1]`` elements (the kernel indexes them by channel, unchecked); backward:
    ``grad_out`` has ``input``'s shape and dtype."""
    x = a.tensor("input")
    _need(x.dim() >= 2, "input", f"must have a channel dimension, has shape {_shape(x)}")
    c = x.shape[1]
    for name in ("weight", "bias", "running_mean", "running_var", "save_mean", "save_invstd"):
        if name in a:
            _norm_param(a, name, [c], x, "[input.shape[1]]")
    for name in ("running_mean", "running_var"):
        t = a.t(name)
        if t is not None:
            _contiguous(t, name, "the kernel updates it in place")
    if backward:
        g = a.tensor("grad_out")
        _shape_eq(g, x.shape, "grad_out", "input.shape")
        _dtype_eq(g, x, "grad_out", "input")


def softmax(a: Args, *, backward: bool) -> None:
    """``dim`` names a dimension; backward: ``grad_output`` and ``output`` alike in shape and dtype."""
    if not backward:
        _wrap(a.get("dim"), a.tensor("self").dim(), "dim")
        return
    g, out = a.tensor("grad_output"), a.tensor("output")
    _shape_eq(g, out.shape, "grad_output", "output.shape")
    _dtype_eq(g, out, "grad_output", "output")
    _wrap(a.get("dim"), out.dim(), "dim")


def nll_loss(a: Args, *, backward: bool) -> None:
    """``self`` [N, C] or [C]; ``target`` [N] or [] of int64/uint8 (values: the kernel checks);
    ``weight`` [C]; backward: ``total_weight`` one value of self's dtype, ``grad_output`` [N] or one value."""
    x, target = a.tensor("self"), a.tensor("target")
    _need(x.dim() in (1, 2), "self", f"must be 1-d or 2-d, has shape {_shape(x)}")
    _shape_eq(target, x.shape[:1] if x.dim() == 2 else [], "target", "[self.shape[0]] (or [] for 1-d self)")
    _need(target.dtype in (torch.int64, torch.uint8), "target", f"must be int64 or uint8, is {target.dtype}")
    c = x.shape[-1]
    if a.t("weight") is not None:
        _shape_eq(a.t("weight"), [c], "weight", "[C]")
        _dtype_eq(a.t("weight"), x, "weight", "self")
    _need(a.get("reduction") in (0, 1, 2), "reduction", f"= {a.get('reduction')!r} must be 0, 1 or 2")
    if backward:
        _one_value(a.tensor("total_weight"), "total_weight")
        _dtype_eq(a.tensor("total_weight"), x, "total_weight", "self")
        g = a.tensor("grad_output")
        if a.get("reduction") == 0 and x.dim() == 2:
            _shape_eq(g, [x.shape[0]], "grad_output", "[N] (reduction none)")
        else:
            _one_value(g, "grad_output")
        _dtype_eq(g, x, "grad_output", "self")


def index_values(a: Args, *, op: str) -> None:
    """Ops that read index values the CPU kernel bounds-checks (CUDA: a device-side assert);
    the contract fixes the index tensors' dtype and dimensions."""
    if op == "embedding":
        _need(a.tensor("weight").dim() == 2, "weight", f"must be 2-d, has shape {_shape(a.tensor('weight'))}")
        _need(a.tensor("indices").dtype in (torch.int64, torch.int32), "indices", "must be int64 or int32")
    elif op == "embedding_dense_backward":
        g, idx = a.tensor("grad_output"), a.tensor("indices")
        _need(idx.dtype in (torch.int64, torch.int32), "indices", f"must be int64 or int32, is {idx.dtype}")
        _need(g.dim() >= 1 and list(g.shape[:-1]) == list(idx.shape), "grad_output",
              f"has shape {_shape(g)}; must be indices.shape + [D] for indices {_shape(idx)}")
        _need(isinstance(a.get("num_weights"), int) and a["num_weights"] >= 0, "num_weights", "must be >= 0")
    elif op == "index_select":
        _need(a.tensor("index").dim() <= 1, "index", "must be 0-d or 1-d")
        _need(a.tensor("index").dtype in (torch.int64, torch.int32), "index", "must be int64 or int32")
        _wrap(a.get("dim"), a.tensor("self").dim(), "dim")
    elif op == "masked_scatter":  # the kernel counts the mask's ones against source's elements
        x, mask, src = a.tensor("self"), a.tensor("mask"), a.tensor("source")
        _broadcast([x.shape, mask.shape], ["self", "mask"])
        _need(mask.dtype == torch.bool, "mask", f"must be bool, is {mask.dtype}")
        _dtype_eq(src, x, "source", "self")
    elif op == "embedding_bag":
        w, idx, off = a.tensor("weight"), a.tensor("indices"), a.tensor("offsets")
        _need(w.dim() == 2, "weight", f"must be 2-d, has shape {_shape(w)}")
        _need(idx.dim() == 1 and off.dim() == 1, "indices", "and offsets must be 1-d")
        _need(idx.dtype in (torch.int64, torch.int32) and off.dtype == idx.dtype, "offsets",
              "and indices must be int64 or int32, the same")
        _need(a.get("mode") in (0, 1, 2), "mode", f"= {a.get('mode')!r} must be 0 (sum), 1 (mean) or 2 (max)")
        psw = a.t("per_sample_weights")
        if psw is not None:
            _shape_eq(psw, idx.shape, "per_sample_weights", "indices.shape")
            _dtype_eq(psw, w, "per_sample_weights", "weight")
    elif op in ("gather", "scatter_add", "scatter"):
        x, idx = a.tensor("self"), a.tensor("index")
        _need(idx.dtype == torch.int64, "index", f"must be int64, is {idx.dtype}")
        if op == "scatter" and a.get("reduce") is not None:
            _need(a.get("reduce") in ("sum", "prod", "mean", "amax", "amin"), "reduce", f"= {a.get('reduce')!r} is unknown")
        _need(idx.dim() == x.dim() or (idx.dim() <= 1 and x.dim() <= 1), "index",
              f"must have self's {x.dim()} dims, has {idx.dim()}")
        d = _wrap(a.get("dim"), x.dim(), "dim")
        if a.t("src") is not None:
            src = a.tensor("src")
            _dtype_eq(src, x, "src", "self")
            _need(src.dim() == idx.dim() or idx.numel() == 0, "src", "must have index's number of dims")
            _need(all(i <= s for i, s in zip(idx.shape, src.shape)), "index",
                  f"has shape {_shape(idx)}; no dim may exceed src's {_shape(src)}")
        _need(all(i <= s for k, (i, s) in enumerate(zip(idx.shape, x.shape)) if k != d), "index",
              f"has shape {_shape(idx)}; no dim but dim {d} may exceed self's {_shape(x)}")
    elif op == "index":
        x, indices = a.tensor("self"), a.get("indices")
        if a.t("values") is not None:
            _dtype_eq(a.tensor("values"), x, "values", "self")
        _need(isinstance(indices, (list, tuple)) and len(indices) <= x.dim(), "indices",
              f"must list at most self's {x.dim()} dims")
        for k, t in enumerate(indices):
            if t is not None:
                _need(t.dtype in (torch.int64, torch.int32, torch.bool, torch.uint8), f"indices[{k}]",
                      f"must be int64, int32, bool or uint8, is {t.dtype}")


def _pool_out(n: int, k: int, s: int, p: int, d: int, ceil: bool) -> int:
    span = d * (k - 1) + 1
    out = (n + 2 * p - span + ((s - 1) if ceil else 0)) // s + 1
    if ceil and (out - 1) * s >= n + p:
        out -= 1
    return out


def _pool_params(a: Args, dims_: int, with_dilation: bool) -> tuple:
    k = _ints(a.get("kernel_size"), "kernel_size")
    s = _ints(a.get("stride"), "stride") or k
    p = _ints(a.get("padding"), "padding")
    d = _ints(a.get("dilation"), "dilation") if with_dilation else [1]
    out = []
    for name, v in (("kernel_size", k), ("stride", s), ("padding", p), ("dilation", d)):
        _need(len(v) in (1, dims_), name, f"= {v} must have 1 or {dims_} values")
        out.append(v * dims_ if len(v) == 1 else v)
    k, s, p, d = out
    _need(all(x > 0 for x in k + s + d), "kernel_size", "stride and dilation must be positive")
    _need(all(0 <= pp <= kk // 2 for pp, kk in zip(p, k)), "padding", f"= {p} must be in [0, kernel_size // 2]")
    return k, s, p, d


def pooling(a: Args, *, kind: str) -> None:
    """2-d pooling: ``self`` [C, H, W] or [N, C, H, W]; backward: ``grad_output`` (and
    ``indices``, int64) have exactly the pooled shape the parameters give."""
    x = a.tensor("self")
    if kind.startswith("adaptive"):
        _need(x.dim() in (3, 4), "self", f"must be 3-d or 4-d, has shape {_shape(x)}")
        if kind == "adaptive_backward":
            g = a.tensor("grad_output")
            _need(g.dim() == x.dim() and list(g.shape[:-2]) == list(x.shape[:-2]), "grad_output",
                  f"has shape {_shape(g)}; must be self.shape[:-2] + [oH, oW] for self {_shape(x)}")
            _dtype_eq(g, x, "grad_output", "self")
        else:
            _need(all(v >= 0 for v in _ints(a.get("output_size"), "output_size", 2)), "output_size", "must be >= 0")
        return
    dims_ = 1 if kind == "max1d" else 2
    _need(x.dim() in (dims_ + 1, dims_ + 2), "self", f"must be {dims_ + 1}-d or {dims_ + 2}-d, has shape {_shape(x)}")
    k, s, p, d = _pool_params(a, dims_, kind in ("max", "max_backward", "max1d"))
    ceil = bool(a.get("ceil_mode"))
    spatial = [_pool_out(n, *args, ceil) for n, args in zip(x.shape[-dims_:], zip(k, s, p, d))]
    _need(all(o > 0 for o in spatial), "self", f"of shape {_shape(x)} is too small for the pooling window")
    if kind.endswith("backward"):
        expected = list(x.shape[:-dims_]) + spatial
        g = a.tensor("grad_output")
        _shape_eq(g, expected, "grad_output", "the pooled shape of self")
        _dtype_eq(g, x, "grad_output", "self")
        if kind == "max_backward":
            idx = a.tensor("indices")
            _shape_eq(idx, expected, "indices", "the pooled shape of self")
            _need(idx.dtype == torch.int64, "indices", f"must be int64, is {idx.dtype}")


def _conv_geometry(a: Args) -> tuple[list, int]:
    x, w = a.tensor("input"), a.tensor("weight")
    _need(x.dim() in (3, 4, 5), "input", f"must be 3-d, 4-d or 5-d, has shape {_shape(x)}")
    _need(w.dim() == x.dim(), "weight", f"must have input's {x.dim()} dims, has shape {_shape(w)}")
    n = x.dim() - 2
    params = {}
    for name in ("stride", "padding", "dilation", "output_padding"):
        v = _ints(a.get(name), name)
        _need(len(v) in (1, n), name, f"= {v} must have 1 or {n} values")
        params[name] = v * n if len(v) == 1 else v
    s, p, d, op_ = params["stride"], params["padding"], params["dilation"], params["output_padding"]
    groups = a.get("groups")
    _need(isinstance(groups, int) and groups > 0, "groups", f"= {groups!r} must be positive")
    _need(all(v > 0 for v in s + d) and all(v >= 0 for v in p + op_), "stride",
          "and dilation must be positive, padding and output_padding >= 0")
    _dtype_eq(w, x, "weight", "input")
    if a.get("transposed"):
        _need(x.shape[1] == w.shape[0] and w.shape[0] % groups == 0, "weight",
              f"has shape {_shape(w)}; dim 0 must be input.shape[1] = {x.shape[1]}, divisible by groups")
        _need(all(o < max(ss, dd) for o, ss, dd in zip(op_, s, d)), "output_padding", "must be < stride or dilation")
        out_c = w.shape[1] * groups
        spatial = [(i - 1) * ss - 2 * pp + dd * (kk - 1) + oo + 1
                   for i, ss, pp, dd, kk, oo in zip(x.shape[2:], s, p, d, w.shape[2:], op_)]
    else:
        _need(x.shape[1] == w.shape[1] * groups and w.shape[0] % groups == 0, "weight",
              f"has shape {_shape(w)}; dim 1 x groups must be input.shape[1] = {x.shape[1]}, dim 0 divisible by groups")
        out_c = w.shape[0]
        spatial = [(i + 2 * pp - dd * (kk - 1) - 1) // ss + 1
                   for i, ss, pp, dd, kk in zip(x.shape[2:], s, p, d, w.shape[2:])]
    _need(all(o > 0 for o in spatial), "input", f"of shape {_shape(x)} is smaller than the kernel {_shape(w)}")
    return [x.shape[0], out_c] + spatial, out_c


def convolution(a: Args, *, backward: bool) -> None:
    """Sizes from the convolution formula: weight fits input and groups; backward's
    ``grad_output`` has exactly the forward output's shape; bias has out_channels values."""
    out_shape, out_c = _conv_geometry(a)
    if not backward:
        if a.t("bias") is not None:
            _shape_eq(a.t("bias"), [out_c], "bias", "[out_channels]")
            _dtype_eq(a.t("bias"), a.tensor("input"), "bias", "input")
        return
    g = a.tensor("grad_output")
    _shape_eq(g, out_shape, "grad_output", "the convolution's output shape")
    _dtype_eq(g, a.tensor("input"), "grad_output", "input")
    if a.get("bias_sizes") is not None:  # a conv without bias passes [0] and asks no bias gradient
        mask = a.get("output_mask")
        wants_bias = mask is None or len(mask) < 3 or bool(mask[2])
        allowed = [[out_c]] if wants_bias else [[out_c], [0]]
        _need(list(a["bias_sizes"]) in allowed, "bias_sizes",
              f"= {a['bias_sizes']} must be [{out_c}]" + ("" if wants_bias else " or [0] (no bias)"))


def attention_cpu(a: Args, *, backward: bool) -> None:
    """CPU flash attention: q [B, H, L, E], k [B, Hk, S, E], v [B, Hk, S, E] where Hk divides H
    (grouped-query attention: the kernel maps query head h to key head h / (H / Hk); Hk > H
    divides by zero, a Hk that does not divide H reads past the key heads), one dtype, rows dense
    (stride 1 in the last dim); mask broadcastable to [B, H, L, S]; backward: ``out`` and
    ``grad_out`` [B, H, L, E], ``logsumexp`` [B, H, L] in the accumulation dtype."""
    q, k, v = a.tensor("query"), a.tensor("key"), a.tensor("value")
    for name, t in (("query", q), ("key", k), ("value", v)):
        _need(t.dim() == 4, name, f"must be 4-d [B, H, L, E], has shape {_shape(t)}")
        _dtype_eq(t, q, name, "query")
        _last_dim_dense(t, name)
    b, h, length, e = q.shape
    hk = k.shape[1]
    _need(1 <= hk <= h and h % hk == 0, "key", f"has {hk} heads, which must divide query's {h} (grouped-query attention)")
    _shape_eq(k, [b, hk, k.shape[2], e], "key", "[B, Hk, S, E] of query")
    _shape_eq(v, list(k.shape), "value", "key.shape")
    _need(a.get("dropout_p") == 0.0, "dropout_p", f"= {a.get('dropout_p')} must be 0 (no dropout on CPU)")
    mask = a.t("attn_mask")
    if mask is not None:
        _broadcast([mask.shape, [b, h, length, k.shape[2]]], ["attn_mask", "[B, H, L, S]"])
        _need(mask.dim() >= 2 and mask.dtype in (torch.bool, q.dtype), "attn_mask", f"must be >= 2-d, bool or {q.dtype}")
        _last_dim_dense(mask, "attn_mask")
    if backward:
        for name in ("grad_out", "out"):
            t = a.tensor(name)
            _shape_eq(t, [b, h, length, e], name, "[B, H, L, E]")
            _dtype_eq(t, q, name, "query")
            _last_dim_dense(t, name)
        lse = a.tensor("logsumexp")
        _shape_eq(lse, [b, h, length], "logsumexp", "[B, H, L]")
        _need(lse.dtype == _opmath(q.dtype), "logsumexp", f"must be {_opmath(q.dtype)}, is {lse.dtype}")


def foreach(a: Args, *, lists: tuple = ("self",), scalars: str | None = None,
            scalar_tensor: str | None = None) -> None:
    """Foreach ops: every list as long as the first; per index the tensors broadcast to the first
    list's shape (CUDA's fused path takes only equal shapes, strides and dtypes and falls back to
    the per-tensor op otherwise, whose iterator checks dtypes); a scalar list one value per
    tensor; a scalar tensor 0-d (``scalars`` tensor of ``_foreach_addcdiv_.Tensor``: 1-d, one
    value per tensor)."""
    first = a.tensors(lists[0])
    for name in lists[1:]:
        other = a.tensors(name)
        _need(len(other) == len(first), name, f"has {len(other)} tensors, {lists[0]} has {len(first)}")
        for i, (x, y) in enumerate(zip(first, other)):
            shape = _broadcast([x.shape, y.shape], [f"{lists[0]}[{i}]", f"{name}[{i}]"])
            _need(list(shape) == list(x.shape), f"{name}[{i}]",
                  f"of shape {_shape(y)} would broadcast {lists[0]}[{i}] {_shape(x)} to {shape}")
    if scalars is not None:
        v = a.get(scalars)
        if isinstance(v, torch.Tensor):
            _need(v.dim() == 1 and v.numel() == len(first), scalars,
                  f"has shape {_shape(v)}, must be [{len(first)}] (one value per tensor)")
        else:
            _need(isinstance(v, (list, tuple)) and len(v) == len(first), scalars,
                  f"must have one value per tensor ({len(first)})")
    if scalar_tensor is not None:
        t = a.tensor(scalar_tensor)
        _need(t.dim() == 0, scalar_tensor, f"must be a 0-d tensor, has shape {_shape(t)}")


def fused_step(a: Args, *, state: tuple, steps: str | None) -> None:
    """Fused optimizer steps index every state tensor with its parameter's element count through
    raw pointers: every list as long as the parameters (optional ones may be empty; Adam's
    ``max_exp_avg_sqs`` exactly when ``amsgrad``), each state tensor of its parameter's exact
    shape and dtype, all contiguous; step counters, grad_scale and found_inf one float32 value (lr:
    float32 or float64)."""
    params = a.tensors("self")
    for i, p in enumerate(params):
        _contiguous(p, f"self[{i}]")
    for name in state:
        tensors = a.tensors(name)
        optional = name == "momentum_buffer_list" or (name == "max_exp_avg_sqs" and not a.get("amsgrad"))
        if optional and not tensors:
            continue
        _need(len(tensors) == len(params), name, f"has {len(tensors)} tensors, self has {len(params)}"
              + (" (max_exp_avg_sqs must be given exactly when amsgrad)" if name == "max_exp_avg_sqs" else ""))
        for i, (p, t) in enumerate(zip(params, tensors)):
            _shape_eq(t, p.shape, f"{name}[{i}]", f"self[{i}].shape")
            _dtype_eq(t, p, f"{name}[{i}]", f"self[{i}]")
            _contiguous(t, f"{name}[{i}]")
    if steps is not None:
        counters = a.tensors(steps)
        _need(len(counters) == len(params), steps, f"has {len(counters)} tensors, self has {len(params)}")
        for i, t in enumerate(counters):
            _one_value(t, f"{steps}[{i}]", (torch.float32,))
    for name in ("lr", "grad_scale", "found_inf"):
        if isinstance(a.get(name), torch.Tensor):  # lr: the traced step's input is float64
            _one_value(a[name], name, (torch.float32, torch.float64) if name == "lr" else (torch.float32,))
        else:
            _need(a.get(name) is None or isinstance(a.get(name), float), name, "must be a float, a tensor or None")


def collective(a: Args, *, kind: str) -> None:
    """Functional collectives hand raw buffers to the process group: tensors contiguous and at
    least 1-d (dim 0 is gathered/scattered: the C++ op indexes ``sizes()[0]``), ``group_size``
    positive, dim 0 divisible by it for reduce_scatter; ``out`` of the gathered shape."""
    tensors = a.tensors("inputs") if "inputs" in a else [a.tensor("input")]
    for i, t in enumerate(tensors):
        label = f"inputs[{i}]" if "inputs" in a else "input"
        if kind != "all_reduce":  # all_reduce copies its input contiguously first
            _contiguous(t, label, "the process group sends its raw buffer")
        _need(t.dim() >= 1 or kind in ("all_reduce", "all_reduce_", "broadcast"), label,
              "must have a dimension 0 to gather or scatter over")
    if kind in ("all_gather", "reduce_scatter"):
        n = a.get("group_size")
        _need(isinstance(n, int) and n > 0, "group_size", f"= {n!r} must be positive")
        if kind == "reduce_scatter":
            for i, t in enumerate(tensors):
                _need(t.shape[0] % n == 0, "input", f"dim 0 ({t.shape[0]}) must divide by group_size {n}")
        if a.t("out") is not None:
            x = tensors[0]
            _shape_eq(a.t("out"), [x.shape[0] * n] + list(x.shape[1:]), "out", "input.shape with dim 0 x group_size")
            _dtype_eq(a.t("out"), x, "out", "input")
            _contiguous(a.t("out"), "out", "the process group writes its raw buffer")


def factory(a: Args) -> None:
    """Factory ops with explicit strides: one non-negative stride per size (the storage is sized
    from them; validate.py checks the result lies in it)."""
    size, stride = _ints(a.get("size"), "size"), _ints(a.get("stride"), "stride")
    _need(len(size) == len(stride), "stride", f"= {stride} must have one value per size {size}")
    _need(all(v >= 0 for v in size + stride), "stride", "and size must be >= 0")


def group_norm(a: Args, *, backward: bool) -> None:
    """The kernel takes N, C, HxW and group as numbers and reads N*C*HxW elements: they must
    describe ``input`` exactly; weight/bias [C]; mean/rstd [N, group], contiguous."""
    x = a.tensor("input")
    n, c, hw, g = (a.get(k) for k in ("N", "C", "HxW", "group"))
    _need(all(isinstance(v, int) and v >= 0 for v in (n, c, hw, g)) and g > 0, "group",
          "N, C, HxW must be ints >= 0 and group positive")
    _need(x.dim() >= 2 and x.shape[0] == n and x.shape[1] == c and x.numel() == n * c * hw, "input",
          f"has shape {_shape(x)}; must be [N={n}, C={c}, ...] with N*C*HxW = {n * c * hw} elements")
    _need(c % g == 0, "C", f"= {c} must divide by group {g}")
    for name in ("weight", "bias"):
        if name in a:
            _norm_param(a, name, [c], x, "[C]")
    if backward:
        gr = a.tensor("grad_out")
        _shape_eq(gr, x.shape, "grad_out", "input.shape")
        _dtype_eq(gr, x, "grad_out", "input")
        for name in ("mean", "rstd"):
            t = a.tensor(name)
            _shape_eq(t, [n, g], name, "[N, group]")
            _need(t.dtype in (x.dtype, _opmath(x.dtype)), name, f"has dtype {t.dtype}, must be input's {x.dtype}")
            _contiguous(t, name)


def fft(a: Args, *, kind: str) -> None:
    """``dim`` distinct dimensions of ``self``; c2r: complex input whose last transformed dim
    holds exactly ``last_dim_size // 2 + 1`` values (pocketfft reads that many)."""
    x = a.tensor("self")
    ds = _ints(a.get("dim"), "dim")
    wrapped = [_wrap(d, x.dim(), "dim") for d in ds]
    _need(len(ds) >= 1 and len(set(wrapped)) == len(ds), "dim", f"= {ds} must name distinct dimensions")
    _need(a.get("normalization") in (0, 1, 2), "normalization", "must be 0, 1 or 2")
    if kind == "r2c":
        _need(x.dtype in (torch.float32, torch.float64), "self", f"must be float32 or float64, is {x.dtype}")
    else:
        _need(x.dtype in (torch.complex64, torch.complex128), "self", f"must be complex, is {x.dtype}")
        n = a.get("last_dim_size")
        _need(isinstance(n, int) and n >= 1 and x.shape[wrapped[-1]] == n // 2 + 1, "last_dim_size",
              f"= {n!r}: self.shape[dim[-1]] = {x.shape[wrapped[-1]]} must be last_dim_size // 2 + 1")


def grid_sampler(a: Args) -> None:
    """``input`` [N, C, H, W], ``grid`` [N, H', W', 2] of its dtype; modes are known enum values."""
    x, grid = a.tensor("input"), a.tensor("grid")
    _need(x.dim() == 4, "input", f"must be 4-d, has shape {_shape(x)}")
    _need(grid.dim() == 4 and grid.shape[0] == x.shape[0] and grid.shape[3] == 2, "grid",
          f"has shape {_shape(grid)}; must be [input.shape[0], H, W, 2]")
    _dtype_eq(grid, x, "grid", "input")
    _need(a.get("interpolation_mode") in (0, 1, 2), "interpolation_mode", "must be 0, 1 or 2")
    _need(a.get("padding_mode") in (0, 1, 2), "padding_mode", "must be 0, 1 or 2")


def batch_norm_writes(a: Args) -> tuple:
    """``native_batch_norm`` updates its running statistics in place when training, though its
    schema does not mark them written."""
    return ("running_mean", "running_var") if a.get("training") else ()


# ------------------------------------------------------------------ the table
P = functools.partial
_ELEMENTWISE_OPS = """
    abs.default add.Scalar add.Tensor add_.Scalar add_.Tensor addcdiv.default addcdiv_.default addcmul.default
    addcmul_.default bernoulli_.float bitwise_and.Tensor bitwise_not.default bitwise_or.Tensor clamp.default
    clamp.Tensor clamp_max.default clamp_min.default copy_.default cos.default div.Scalar div.Tensor div_.Scalar
    div_.Tensor eq.Scalar eq.Tensor erf.default exp.default exp2.default expm1.default fill_.Scalar gelu.default
    gelu_backward.default ge.Scalar ge.Tensor gt.Scalar gt.Tensor hardtanh.default hardtanh_backward.default
    isinf.default isnan.default le.Scalar le.Tensor leaky_relu.default leaky_relu_backward.default lerp.Scalar
    lerp_.Scalar log.default log1p.default logical_and.default logical_and_.default logical_not.default
    logical_or.default logical_or_.default lt.Scalar lt.Tensor masked_fill.Scalar masked_fill.Tensor maximum.default
    minimum.default mse_loss.default mse_loss_backward.default mul.Scalar mul.Tensor mul_.Scalar mul_.Tensor
    nan_to_num.default native_dropout.default native_dropout_backward.default ne.Scalar ne.Tensor neg.default
    pow.Scalar pow.Tensor_Scalar pow.Tensor_Tensor reciprocal.default relu.default relu_.default rsqrt.default
    rsub.Scalar rsub.Tensor sgn.default sigmoid.default sigmoid_backward.default sign.default silu.default
    silu_backward.default sin.default softplus.default softplus_backward.default sqrt.default square.default
    sub.Scalar sub.Tensor sub_.Tensor sub_.Scalar tanh.default tanh_backward.default threshold_backward.default
    where.self where.ScalarOther where.ScalarSelf zero_.default _to_copy.default clone.default alias.default
    detach.default lift_fresh_copy.default empty_like.default ones_like.default zeros_like.default
    full_like.default new_empty.default new_ones.default new_zeros.default logical_not_.default
    bitwise_and_.Tensor bitwise_or_.Tensor masked_fill_.Scalar masked_fill_.Tensor tril_.default triu_.default
    neg_.default exp_.default sigmoid_.default tanh_.default clamp_.default clamp_min_.default gelu_.default
    silu_.default cos_.default sin_.default rsqrt_.default sqrt_.default reciprocal_.default pow_.Scalar
    leaky_relu_.default hardtanh_.default fill_.Tensor fill.Scalar copy.default acos.default acosh.default
    asin.default asinh.default atan.default atanh.default atan2.default atan2.out bitwise_and.Scalar
    bitwise_or.Scalar bitwise_xor.Scalar bitwise_xor.Tensor ceil.default cosh.default div.Scalar_mode
    div.Tensor_mode elu.default floor.default fmod.Scalar fmod.Tensor log10.default log2.default
    logical_xor.default remainder.Scalar remainder.Tensor round.default sinh.default tan.default trunc.default
"""
_KERNEL_CHECKED_OPS = """
    _unsafe_view.default view.default reshape.default expand.default expand_as.default t.default transpose.int
    permute.default select.int slice.Tensor narrow.default split.Tensor split_with_sizes.default chunk.default
    unflatten.int flatten.using_ints squeeze.dim squeeze.dims unsqueeze.default unbind.int view_as.default
    split_with_sizes_copy.default cat.default stack.default flip.default roll.default repeat.default
    constant_pad_nd.default tril.default triu.default select_backward.default slice_backward.default
    empty.memory_format full.default ones.default zeros.default arange.default arange.start arange.start_step
    scalar_tensor.default sort.default topk.default _c10d_functional.wait_tensor.default diagonal.default
    select_scatter.default slice_scatter.default rand.default randn.default randperm.default
    reflection_pad1d.default reflection_pad2d.default reflection_pad3d.default replication_pad2d.default
    replication_pad3d.default avg_pool3d.default max_pool3d_with_indices.default _adaptive_avg_pool3d.default
    col2im.default upsample_nearest2d.vec upsample_bilinear2d.vec _cdist_forward.default _pdist_forward.default
"""
_DIM_OPS = {  # reductions and dim-taking ops: (dim argument names)
    "amax.default": ("dim",), "amin.default": ("dim",), "argmax.default": ("dim",), "cumsum.default": ("dim",),
    "max.dim": ("dim",), "min.dim": ("dim",), "max.default": (), "min.default": (), "mean.default": (),
    "mean.dim": ("dim",), "sum.default": (), "sum.dim_IntList": ("dim",), "prod.dim_int": ("dim",),
    "std.correction": ("dim",), "var.correction": ("dim",), "var_mean.correction": ("dim",),
    "linalg_vector_norm.default": ("dim",), "any.default": (), "any.dim": ("dim",), "all.default": (),
    "all.dim": ("dim",), "argmin.default": ("dim",), "logsumexp.default": ("dim",), "any.dims": ("dim",),
    "prod.default": (), "var.dim": ("dim",), "_safe_softmax.default": ("dim",),
}

_RULES: list[tuple[Callable, str]] = [
    (unchecked_by_design, _KERNEL_CHECKED_OPS),
    (storage_checked, "as_strided.default"),
    (P(matmul, kind="mm"), "mm.default"),
    (P(matmul, kind="mm.out"), "mm.out"),
    (P(matmul, kind="addmm"), "addmm.default"),
    (P(matmul, kind="bmm"), "bmm.default"),
    (P(matmul, kind="baddbmm"), "baddbmm.default"),
    (P(matmul, kind="linear"), "linear.default"),
    (P(matmul, kind="matmul"), "matmul.default"),
    (P(layer_norm, backward=False), "native_layer_norm.default"),
    (P(layer_norm, backward=True), "native_layer_norm_backward.default"),
    (P(batch_norm, backward=False), "native_batch_norm.default"),  # running stats: see batch_norm_writes
    (P(batch_norm, backward=True), "native_batch_norm_backward.default"),
    (P(softmax, backward=False), "_softmax.default _log_softmax.default"),
    (P(softmax, backward=True), "_softmax_backward_data.default _log_softmax_backward_data.default"),
    (P(nll_loss, backward=False), "nll_loss_forward.default"),
    (P(nll_loss, backward=True), "nll_loss_backward.default"),
    (P(index_values, op="embedding"), "embedding.default"),
    (P(index_values, op="embedding_dense_backward"), "embedding_dense_backward.default"),
    (P(index_values, op="index_select"), "index_select.default"),
    (P(index_values, op="gather"), "gather.default"),
    (P(index_values, op="scatter_add"), "scatter_add.default"),
    (P(index_values, op="index"), "index.Tensor index_put.default"),
    (P(index_values, op="scatter"), "scatter.value scatter.src scatter_reduce.two"),
    (P(index_values, op="embedding_bag"), "_embedding_bag.default"),
    (P(index_values, op="masked_scatter"), "masked_scatter.default"),
    (factory, "empty_strided.default"),
    (P(batch_norm, backward=False), "_native_batch_norm_legit.default _native_batch_norm_legit.no_stats "
                                    "_native_batch_norm_legit_no_training.default"),
    (P(group_norm, backward=False), "native_group_norm.default"),
    (P(group_norm, backward=True), "native_group_norm_backward.default"),
    (P(fft, kind="r2c"), "_fft_r2c.default"),
    (P(fft, kind="c2r"), "_fft_c2r.default"),
    (grid_sampler, "grid_sampler_2d.default"),
    (P(pooling, kind="avg"), "avg_pool2d.default"),
    (P(pooling, kind="avg_backward"), "avg_pool2d_backward.default"),
    (P(pooling, kind="max"), "max_pool2d_with_indices.default"),
    (P(pooling, kind="max_backward"), "max_pool2d_with_indices_backward.default"),
    (P(pooling, kind="max1d"), "max_pool1d.default"),
    (P(pooling, kind="adaptive"), "_adaptive_avg_pool2d.default"),
    (P(pooling, kind="adaptive_backward"), "_adaptive_avg_pool2d_backward.default"),
    (P(convolution, backward=False), "convolution.default"),
    (P(convolution, backward=True), "convolution_backward.default"),
    (P(attention_cpu, backward=False), "_scaled_dot_product_flash_attention_for_cpu.default"),
    (P(attention_cpu, backward=True), "_scaled_dot_product_flash_attention_for_cpu_backward.default"),
    (P(fused_step, state=("grads", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs"), steps="state_steps"),
     "_fused_adam_.default _fused_adam_.tensor_lr _fused_adamw_.default _fused_adamw_.tensor_lr"),
    (P(fused_step, state=("grads", "momentum_buffer_list"), steps=None), "_fused_sgd_.default _fused_sgd_.tensor_lr"),
    (foreach, """_foreach_abs.default _foreach_add.Scalar _foreach_add_.Scalar _foreach_div_.Scalar
        _foreach_mul.Scalar _foreach_mul_.Scalar _foreach_neg_.default _foreach_norm.Scalar _foreach_reciprocal_.default
        _foreach_sign.default _foreach_sqrt.default _foreach_sqrt_.default _foreach_sub.Scalar _foreach_sub_.Scalar
        _foreach_zero_.default"""),
    (P(foreach, lists=("exponent",)), "_foreach_pow.ScalarAndTensor"),
    (P(foreach, lists=("self", "other")), """_foreach_add.List _foreach_add_.List _foreach_div.List
        _foreach_div_.List _foreach_maximum_.List _foreach_mul.List _foreach_mul_.List _foreach_sub_.List"""),
    (P(foreach, lists=("self", "src")), "_foreach_copy_.default"),
    (P(foreach, scalar_tensor="other"), "_foreach_add_.Tensor _foreach_div_.Tensor _foreach_mul.Tensor _foreach_mul_.Tensor"),
    (P(foreach, scalars="scalars"), "_foreach_add_.ScalarList"),
    (P(foreach, lists=("self", "tensor1", "tensor2")), "_foreach_addcdiv_.Scalar _foreach_addcmul_.Scalar"),
    (P(foreach, lists=("self", "tensor1", "tensor2"), scalars="scalars"),
     "_foreach_addcdiv_.ScalarList _foreach_addcdiv_.Tensor _foreach_addcmul_.Tensor"),
    (P(foreach, lists=("self", "tensors1")), "_foreach_lerp_.Scalar"),
    (P(foreach, lists=("self", "tensors1", "weights")), "_foreach_lerp_.List"),
    (P(collective, kind="all_gather"), "all_gather_into_tensor.default all_gather_into_tensor_coalesced.default "
                                       "all_gather_into_tensor_out.default"),
    (P(collective, kind="reduce_scatter"), "reduce_scatter_tensor.default reduce_scatter_tensor_coalesced.default"),
    (P(collective, kind="all_reduce"), "all_reduce.default all_reduce_coalesced.default"),
    (P(collective, kind="all_reduce_"), "all_reduce_.default all_reduce_coalesced_.default"),
    (P(collective, kind="broadcast"), "broadcast.default broadcast_.default"),
]


class Contract:
    """One overload's contract: its relation checker, and whether a written argument may be the
    identical view of a read one (elementwise kernels read each element before writing it)."""

    __slots__ = ("check", "alias_ok", "extra_writes", "family")

    def __init__(self, check: Callable, alias_ok: bool, family: str, extra_writes: Callable | None = None):
        self.check, self.alias_ok, self.family, self.extra_writes = check, alias_ok, family, extra_writes


def _table() -> dict[str, Contract]:
    out: dict[str, Contract] = {}

    def add(names: str, contract: Contract) -> None:
        for short in names.split():
            short = short.removeprefix("_c10d_functional.")
            ns = "_c10d_functional" if short.split(".")[0] in _COLLECTIVE_NAMES else "aten"
            name = f"{ns}::{short}"
            if name in out:
                raise ValueError(f"two contracts for {name}")
            out[name] = contract

    for short in _ELEMENTWISE_OPS.split():
        add(short, Contract(elementwise, True, "elementwise"))
    for short, args in _DIM_OPS.items():
        add(short, Contract(P(dims, args=args), False, "reduction"))
    for check, names in _RULES:
        family = getattr(check, "func", check).__name__
        alias_ok = family == "foreach"  # per element: read, then written
        extra = batch_norm_writes if getattr(check, "func", None) is batch_norm else None
        add(names, Contract(check, alias_ok, family, extra))
    return out


_COLLECTIVE_NAMES = {"all_gather_into_tensor", "all_gather_into_tensor_coalesced", "all_gather_into_tensor_out",
                     "reduce_scatter_tensor", "reduce_scatter_tensor_coalesced", "all_reduce", "all_reduce_",
                     "all_reduce_coalesced", "all_reduce_coalesced_", "broadcast", "broadcast_", "wait_tensor"}

#: "namespace::op.overload" -> its Contract. Every overload in allowed_ops.txt must have one.
CONTRACTS: dict[str, Contract] = _table()


def op_name(op) -> str:
    """``"aten::relu.default"``: the allowlist's spelling of an overload."""
    return f"{op._schema.name}.{op._overloadname}"


def contract_of(op) -> Contract | None:
    return CONTRACTS.get(op_name(op)) if hasattr(op, "_overloadname") else None


def check_call(op, args: tuple, kwargs: dict) -> None:
    """Check one call's arguments (meta or real tensors) against ``op``'s contract: raises
    ``Broken`` naming the argument and the relation, or ``LookupError`` if ``op`` has none."""
    contract = contract_of(op)
    if contract is None:
        if not (hasattr(op, "_overloadname") and is_opted_in(op_name(op))):
            raise LookupError(f"{op} has no argument contract (spmd_aot/format/contracts.py)")
        # opted in by this job (allowlist.opted_in): the rules every op obeys, the rest vouched for
        _general(*_bind(op, args, kwargs), alias_ok=False)
        return
    bound, written = _bind(op, args, kwargs)
    extra = contract.extra_writes(bound) if contract.extra_writes else ()
    _general(bound, written, contract.alias_ok, extra)
    if contract.check is elementwise:
        elementwise(bound, written | frozenset(extra))
    else:
        contract.check(bound)


# ------------------------------------------------------------------ run-time value checks
def _index_range(t: torch.Tensor, high: int, what: str) -> None:
    """0 <= t < high. On CPU an exception; on other devices an asynchronous device assert (no
    host sync; a failure stops the process with an error instead of writing out of bounds)."""
    if t.numel() == 0:
        return
    if t.device.type == "cpu":
        low, top = torch.aminmax(t)
        if int(low) < 0 or int(top) >= high:
            raise IndexError(f"{what}: index values span [{int(low)}, {int(top)}], must lie in [0, {high})")
    else:
        torch._assert_async(((t >= 0) & (t < high)).all(), f"{what}: an index value is outside [0, {high})")


def _embedding_backward_values(args: tuple, kwargs: dict) -> None:
    bound, _ = _bind(torch.ops.aten.embedding_dense_backward.default, args, kwargs)
    _index_range(bound["indices"], bound["num_weights"], "embedding_dense_backward indices")


def _max_pool_backward_values(args: tuple, kwargs: dict) -> None:
    bound, _ = _bind(torch.ops.aten.max_pool2d_with_indices_backward.default, args, kwargs)
    x = bound["self"]
    _index_range(bound["indices"], x.shape[-1] * x.shape[-2], "max_pool2d_with_indices_backward indices")


def _embedding_bag_values(args: tuple, kwargs: dict) -> None:
    bound, _ = _bind(torch.ops.aten._embedding_bag.default, args, kwargs)
    indices, offsets = bound["indices"], bound["offsets"]
    _index_range(indices, bound["weight"].shape[0], "_embedding_bag indices")
    _index_range(offsets, indices.numel() + 1, "_embedding_bag offsets")
    if offsets.numel() > 1:  # bags are ranges: offsets never decrease
        steps = offsets[1:] - offsets[:-1]
        _index_range(steps, indices.numel() + 1, "_embedding_bag offsets (decreasing)")


#: Overloads whose kernels (CPU or CUDA) write where index values say without checking them:
#: name -> check(args, kwargs), run before every call (program.py). Embedding's backward counts
#: ``counts[index]++`` with ``scale_grad_by_freq`` (CPU) and scatters rows by index (CUDA);
#: max-pool's backward adds into ``grad_input[index]``.
VALUE_CHECKS: dict[str, Callable[[tuple, dict], None]] = {
    "aten::embedding_dense_backward.default": _embedding_backward_values,
    "aten::max_pool2d_with_indices_backward.default": _max_pool_backward_values,
    "aten::_embedding_bag.default": _embedding_bag_values,
}

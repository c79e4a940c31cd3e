"""Relation checkers for the normalization families (layer, batch, group and weight norm): the
sizes their kernels take as numbers or read through raw pointers must describe the tensors exactly."""

from __future__ import annotations

import torch

from .rules import Args, _contiguous, _dtype_eq, _ints, _need, _opmath, _shape, _shape_eq


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
    ``grad_out`` has ``input``'s shape and dtype.

    Eval mode normalises with the running statistics, which the CPU kernels then read through
    raw pointers without checking they exist (``training=False`` without them: SIGSEGV, in the
    forward and in the backward), so eval mode needs both. The backward with ``train=False``
    never reads the saved statistics, which CPU eval-mode batch norm returns empty (``[0]``,
    ``device_results``): they may be ``[C]``, ``[0]`` or absent; with ``train=True`` it reads them,
    so they must be ``[C]``."""
    x = a.tensor("input")
    _need(x.dim() >= 2, "input", f"must have a channel dimension, has shape {_shape(x)}")
    c = x.shape[1]
    training = bool(a.get("train" if backward else "training"))
    if "training" in a and "running_mean" not in a:  # _native_batch_norm_legit.no_stats
        _need(training, "training", "must be True: this overload has no running statistics to normalise with")
    if not training:
        for name in ("running_mean", "running_var"):
            _need(name not in a or a.t(name) is not None, name,
                  "must be given in eval mode (the kernel normalises with it, unchecked)")
    if backward and training:
        for name in ("save_mean", "save_invstd"):
            _need(a.t(name) is not None, name, "must be given when train=True (the kernel reads it, unchecked)")
    saved_unread = backward and not training
    for name in ("weight", "bias", "running_mean", "running_var", "save_mean", "save_invstd"):
        if name in a:
            t = a.t(name)
            if saved_unread and name.startswith("save_") and t is not None and t.dim() == 1 and t.shape[0] == 0:
                continue  # eval-mode saved statistics, empty on CPU: never read
            _norm_param(a, name, [c], x, "[input.shape[1]]")
    for name in ("running_mean", "running_var"):
        t = a.t(name)
        if t is not None:
            _contiguous(t, name, "the kernel updates it in place")
    if backward:
        g = a.tensor("grad_out")
        _shape_eq(g, x.shape, "grad_out", "input.shape")
        _dtype_eq(g, x, "grad_out", "input")


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


def weight_norm(a: Args, *, backward: bool) -> None:
    """``torch._weight_norm``'s fused kernel (``nn.utils.parametrizations.weight_norm`` over dim 0
    or the last): it reads ``v`` and the per-slice ``g`` (and in backward ``grad_w`` and the
    saved norms) through raw pointers, sized from ``v``'s shape and ``dim`` alone, so each is
    contiguous and of exactly its shape: ``g`` and the norms keep ``v``'s ``dim`` and are 1 elsewhere."""
    names = ("saved_v", "saved_g") if backward else ("v", "g")
    v, g = a.tensor(names[0]), a.tensor(names[1])
    dim = a.get("dim", 0)
    _need(isinstance(dim, int) and v.dim() >= 1 and dim in (0, v.dim() - 1), "dim",
          f"= {dim!r} must be 0 or the last dimension of {names[0]} {_shape(v)}")
    # an empty weight divides by a zero size in the CPU kernel (SIGFPE, found by the fuzzer)
    _need(v.numel() > 0, names[0], f"has shape {_shape(v)}; must have no zero size")
    per_slice = [s if k == dim else 1 for k, s in enumerate(v.shape)]
    _contiguous(v, names[0])
    _shape_eq(g, per_slice, names[1], f"{names[0]}.shape[dim] with 1 elsewhere")
    _contiguous(g, names[1])
    _dtype_eq(g, v, names[1], names[0])
    if backward:
        grad, norms = a.tensor("grad_w"), a.tensor("saved_norms")
        _shape_eq(grad, v.shape, "grad_w", "saved_v.shape")
        _contiguous(grad, "grad_w")
        _dtype_eq(grad, v, "grad_w", "saved_v")
        _shape_eq(norms, per_slice, "saved_norms", "saved_g.shape")
        _contiguous(norms, "saved_norms")
        _need(norms.dtype in (v.dtype, _opmath(v.dtype)), "saved_norms",
              f"has dtype {norms.dtype}, must be {v.dtype} or {_opmath(v.dtype)}")


def batch_norm_writes(a: Args) -> tuple:
    """``native_batch_norm`` updates its running statistics in place when training, though its
    schema does not mark them written."""
    return ("running_mean", "running_var") if a.get("training") else ()

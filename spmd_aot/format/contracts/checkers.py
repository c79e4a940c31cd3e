"""One relation checker per op family: the exact size, dtype, stride and contiguity relations
between arguments that the family's CPU and CUDA kernels rely on without checking."""

from __future__ import annotations

import torch

from .rules import (Args, _broadcast, _contiguous, _dtype_eq, _ints, _last_dim_dense, _need, _one_value, _opmath, _shape,
                    _shape_eq, _wrap)


def unchecked_by_design(a: Args) -> None:
    """The kernel validates every size, dim and index argument itself (TORCH_CHECK before any
    memory access, proven by tools/fuzz/fuzz_ops.py); only the general rules apply. Views: their
    result is also checked against its storage by validate.py."""


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
        last = bool(a.get("include_last_offset"))
        _need(off.shape[0] >= 1 + last, "offsets",
              f"has {off.shape[0]} values; must hold at least one bag ({1 + last} values with include_last_offset="
              f"{last}): the CPU kernel indexes the first bag unchecked (SIGSEGV)")
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
            _need(all(n > 0 for n in x.shape[-3:]), "self",
                  f"has shape {_shape(x)}; its channel and spatial sizes must be > 0 (the CPU backward "
                  "divides by them unchecked: SIGSEGV)")
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
    mask = a.get("output_mask")
    # CPU's oneDNN path (fp32/bf16) returns the weight's gradient whenever the bias's is asked
    # for, where the meta kernel returns none: the two would not describe the same values
    _need(not (isinstance(mask, (list, tuple)) and len(mask) == 3 and mask[2] and not mask[1]), "output_mask",
          f"= {list(mask) if isinstance(mask, (list, tuple)) else mask}: a bias gradient needs the weight's "
          "too (a trainable bias beside a frozen weight: keep the weight trainable, or leave the bias out)")
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
    ``grad_out`` [B, H, L, E], ``logsumexp`` [B, H, L] in the accumulation dtype.

    The backward reads ``out`` rows as vectors, so ``out`` keeps the dense-row rule, but it copies
    ``grad_out`` to a contiguous tensor before its gemms (a broadcast ``grad_out`` would make them
    slow), so ``grad_out`` may have any strides: tensor-parallel graphs pass one laid out by a
    gather (``tests/building/test_build_verifies.py`` checks the results equal the contiguous call's)."""
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
    _need(length >= 1 and k.shape[2] >= 1, "query",
          f"and key must hold at least one position each (L = {length}, S = {k.shape[2]}): the CPU kernel "
          "divides by the block count, which is 0 for an empty sequence (SIGFPE)")
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
        _last_dim_dense(a.tensor("out"), "out")
        lse = a.tensor("logsumexp")
        _shape_eq(lse, [b, h, length], "logsumexp", "[B, H, L]")
        _need(lse.dtype == _opmath(q.dtype), "logsumexp", f"must be {_opmath(q.dtype)}, is {lse.dtype}")


def foreach(a: Args, *, lists: tuple = ("self",), scalars: str | None = None,
            scalar_tensor: str | None = None) -> None:
    """Foreach ops: every list as long as the first; per index the tensors broadcast to the first
    list's shape (CUDA's fused path takes only equal shapes, strides and dtypes and falls back to
    the per-tensor op otherwise, whose iterator checks dtypes); a scalar list one value per
    tensor; a scalar tensor 0-d (a ``scalars`` tensor: 1-d, one value per tensor)."""
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
            for t in tensors:
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


def bucketize(a: Args) -> None:
    """``boundaries`` 1-d and of ``self``'s dtype: the kernel binary-searches each value in it
    (inside its length whatever the order of its values; unsorted boundaries give unspecified
    buckets, as in eager)."""
    x, b = a.tensor("self"), a.tensor("boundaries")
    _need(b.dim() == 1, "boundaries", f"must be 1-d, has shape {_shape(b)}")
    _dtype_eq(b, x, "boundaries", "self")


def log_sigmoid_backward(a: Args) -> None:
    """``grad_output`` and ``self`` broadcast to the gradient's shape; ``buffer`` is what the
    forward saved: ``self``'s shape on CPU (the kernel iterates over it with the others), empty
    on CUDA (its kernel ignores it)."""
    g, x, buf = a.tensor("grad_output"), a.tensor("self"), a.tensor("buffer")
    shape = _broadcast([g.shape, x.shape], ["grad_output", "self"])
    # an empty [0] buffer would broadcast against a last dimension of 1 on CPU (a [.., 0] result)
    empty_ok = list(buf.shape) == [0] and len(shape) >= 1 and shape[-1] != 1
    _need(empty_ok or list(buf.shape) == list(x.shape), "buffer",
          f"has shape {_shape(buf)}; must be self's {_shape(x)} (CPU) or [0] (CUDA) with a last dimension other than 1")
    _dtype_eq(buf, x, "buffer", "self")


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

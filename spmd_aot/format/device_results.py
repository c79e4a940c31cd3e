"""What a device's kernel returns where it differs from the op's meta kernel, for real graphs.

Why: the load's meta check derives every value's metadata from torch's meta kernels, and the
interpreter's run-time invariants (``interpreter/invariants.py``) refuse a real value whose shape or
dtype differs from it. A few meta kernels describe another device's kernel rather than the one
the artifact runs on, and ordinary models reach them: in bf16 or fp16, CPU layer norm keeps its
saved mean and rstd in the input's dtype (meta: fp32, as CUDA does), and CPU group norm keeps
them in fp32 when its weight is fp32 (meta: the input's dtype). Checking such a graph against
the meta dtype would refuse a model eager trains.

So the check corrects these results to what the artifact's device returns, *before* any later
node's contract is checked against them: the contracts of the ops that read the statistics then
hold for the real values, and the invariants compare with the real dtype. Each rule is the
kernel's own (ATen's ``param_scalar_type``: fp32 when a reduced-precision input meets an fp32
weight or bias, else the input's dtype) and is tested against the kernel on every dtype pair.

The same holds for every other admitted op whose CPU kernel returns other metadata than its meta
kernel on arguments its contract accepts (found by ``tools/fuzz/fuzz_ops.py``, which compares
every run's result with what this module derives); each rule restates the CPU kernel's own
choice and ``tests/format/test_device_results.py`` checks it against the kernel on every
dtype and flag combination:

* batch norm in eval mode (``native_batch_norm`` and ``_native_batch_norm_legit`` with
  ``training=False``, ``_native_batch_norm_legit_no_training``) returns empty saved statistics
  (``[0]``; meta: ``[C]``), and in every mode keeps them in the parameters' dtype as layer norm
  does (fp32 beside an fp32 weight, bias or running statistic; else the input's dtype);
* ``native_batch_norm_backward`` returns no gradient its ``output_mask`` does not ask for
  (meta: ``grad_input`` always);
* ``_embedding_bag``: ``offset2bag`` is empty on the fast path of sum mode (fp32/fp16/bf16
  weight with dense rows, no ``padding_idx``, dense per-sample weights), ``bag_size`` has one
  value per bag and ``max_indices`` is ``[bags, D]`` in max mode, else ``[bags]`` (meta describes
  CUDA's kernel), whether or not the weight requires grad;
* ``threshold_backward`` computes in the promoted dtype of ``grad_output`` and ``self`` (meta:
  ``grad_output``'s), ``native_dropout_backward`` in that of ``grad_output`` and ``mask`` (the
  default float dtype when both are integral: it multiplies by a float scale);
  ``mse_loss_backward`` returns ``self``'s dtype (meta: all three promoted);
* ``native_dropout`` on an empty input returns a mask of the input's dtype (meta: bool);
* ``convolution`` and ``convolution_backward`` return their outputs (and ``grad_input``,
  ``grad_weight``) in the memory format of the backend the CPU picks (oneDNN: channels-last
  when the input or weight is; meta: contiguous). A channels-last result reached by a transpose
  (Segformer's depthwise convolution over a ``transpose(1, 2).view(...)`` of a sequence) is
  then viewed back as a sequence, which only the channels-last strides allow: the rule is
  torch's own, as its fake tensors apply it while tracing (``_select_conv_backend``, then
  ``_conv_determine_backend_memory_format`` on CPU tensors of the arguments' metadata).

And one CUDA kernel: ``log_sigmoid_forward`` returns an empty ``buffer`` there (meta: ``self``'s
shape, which is CPU's).
"""

from __future__ import annotations

from typing import Any
from collections.abc import Callable

import torch

__all__ = ["corrected"]

_REDUCED = (torch.bfloat16, torch.float16)


def _present(t: Any) -> bool:
    return isinstance(t, torch.Tensor)


def _statistics_dtype(x: torch.Tensor, params: tuple) -> torch.dtype:
    """ATen CPU's ``param_scalar_type(input, is_mixed_type(input, weight, bias))``."""
    mixed = x.dtype in _REDUCED and any(_present(p) and p.dtype == torch.float32 for p in params)
    return torch.float32 if mixed else x.dtype


def _with_statistics_dtype(value: Any, dtype: torch.dtype) -> Any:
    """``(out, mean, rstd)`` with mean and rstd re-made (same shape and strides) in ``dtype``."""
    out, mean, rstd = value
    if mean.dtype == dtype and rstd.dtype == dtype:
        return value
    remade = tuple(torch.empty_strided(t.shape, t.stride(), dtype=dtype, device=t.device) for t in (mean, rstd))
    return (out, *remade)


def _cpu_layer_norm(args: tuple, kwargs: dict, value: Any) -> Any:
    x = args[0]
    params = tuple(args[2:4]) + tuple(kwargs.get(k) for k in ("weight", "bias"))
    return _with_statistics_dtype(value, _statistics_dtype(x, params))


def _cpu_group_norm(args: tuple, kwargs: dict, value: Any) -> Any:
    x = args[0]
    params = tuple(args[1:3]) + tuple(kwargs.get(k) for k in ("weight", "bias"))
    return _with_statistics_dtype(value, _statistics_dtype(x, params))


def _arg(args: tuple, kwargs: dict, position: int, name: str, default: Any = None) -> Any:
    """An argument by schema position or keyword (stored graphs may use either)."""
    return args[position] if len(args) > position else kwargs.get(name, default)


def _remade(t: torch.Tensor, dtype: torch.dtype | None = None, shape: tuple | None = None) -> torch.Tensor:
    """A meta tensor like ``t`` with another dtype (same shape and strides) or another shape (contiguous)."""
    if shape is not None:
        return torch.empty(shape, dtype=dtype or t.dtype, device=t.device)
    return torch.empty_strided(t.shape, t.stride(), dtype=dtype, device=t.device)


def _batch_norm(training_at: int | None) -> Callable[[tuple, dict, Any], Any]:
    """CPU batch norm (``batch_norm_cpu``): saved mean/invstd ``[C]`` when training, ``[0]``
    in eval mode, in ``param_scalar_type`` of input, weight, bias and running statistics.
    ``training_at``: the position of the ``training`` argument (None: always eval mode)."""
    def rule(args: tuple, kwargs: dict, value: Any) -> Any:
        out, mean, invstd = value
        x = args[0]
        training = False if training_at is None else bool(_arg(args, kwargs, training_at, "training"))
        params = tuple(_arg(args, kwargs, k, n) for k, n in ((1, "weight"), (2, "bias")))
        if training_at != 3:  # the no_stats overload has no running statistics
            params += tuple(_arg(args, kwargs, k, n) for k, n in ((3, "running_mean"), (4, "running_var")))
        dtype = _statistics_dtype(x, params)
        shape = None if training else (0,)
        return (out, _remade(mean, dtype, shape), _remade(invstd, dtype, shape))
    return rule


def _batch_norm_backward(args: tuple, kwargs: dict, value: Any) -> Any:
    """CPU ``batch_norm_backward_cpu`` returns no tensor for a gradient its ``output_mask`` does
    not ask for; the meta kernel always returns ``grad_input``."""
    mask = _arg(args, kwargs, 9, "output_mask")
    if not isinstance(mask, (list, tuple)) or len(mask) != 3 or all(mask):
        return value
    return tuple(v if wanted else None for v, wanted in zip(value, mask))


def _embedding_bag(args: tuple, kwargs: dict, value: Any) -> Any:
    """CPU ``_embedding_bag`` (``make_offset2bag_out``, ``make_bag_size_out``, ``make_max_indices_out``)."""
    out, offset2bag, bag_size, max_indices = value
    weight, indices, offsets = args[0], args[1], args[2]
    mode = _arg(args, kwargs, 4, "mode", 0)
    per_sample = _arg(args, kwargs, 6, "per_sample_weights")
    last = bool(_arg(args, kwargs, 7, "include_last_offset", False))
    padding_idx = _arg(args, kwargs, 8, "padding_idx", -1)
    padding_idx = -1 if padding_idx is None else padding_idx
    fast_sum = (weight.dtype in (torch.float32, torch.float16, torch.bfloat16) and weight.stride(1) == 1
                and out.stride(1) == 1 and padding_idx < 0
                and (not _present(per_sample) or per_sample.stride(0) == 1))
    bags = offsets.shape[0] - (1 if last else 0)
    o2b = (indices.shape[0],) if mode in (1, 2) or not fast_sum else (0,)
    return (out, _remade(offset2bag, shape=o2b), _remade(bag_size, shape=(bags,)),
            _remade(max_indices, shape=(bags, weight.shape[1]) if mode == 2 else (bags,)))


def _promoted(first: str, second: str, at: tuple[int, int]) -> Callable[[tuple, dict, Any], Any]:
    """A TensorIterator kernel that computes in the promoted dtype of two tensor arguments."""
    def rule(args: tuple, kwargs: dict, value: Any) -> Any:
        a, b = _arg(args, kwargs, at[0], first), _arg(args, kwargs, at[1], second)
        dtype = torch.promote_types(a.dtype, b.dtype)
        return value if value.dtype == dtype else _remade(value, dtype)
    return rule


def _dropout_backward(args: tuple, kwargs: dict, value: Any) -> Any:
    """CPU ``native_dropout_backward`` is ``grad_output * mask * scale``: the promoted dtype of
    the two tensors, and the default float dtype when both are integral (``scale`` is a float)."""
    grad, mask = _arg(args, kwargs, 0, "grad_output"), _arg(args, kwargs, 1, "mask")
    dtype = torch.promote_types(grad.dtype, mask.dtype)
    if not (dtype.is_floating_point or dtype.is_complex):
        dtype = torch.get_default_dtype()
    return value if value.dtype == dtype else _remade(value, dtype)


def _mse_loss_backward(args: tuple, kwargs: dict, value: Any) -> Any:
    """CPU ``mse_loss_backward`` writes into ``zeros_like(self)``: ``self``'s dtype."""
    dtype = _arg(args, kwargs, 1, "self").dtype
    return value if value.dtype == dtype else _remade(value, dtype)


def _native_dropout(args: tuple, kwargs: dict, value: Any) -> Any:
    """CPU ``native_dropout`` returns ``(input.clone(), empty_like(input))`` for an empty input."""
    out, mask = value
    x = args[0]
    if x.numel() != 0 or mask.dtype == x.dtype:
        return value
    return (out, _remade(mask, x.dtype))


_CONV_FAKE_MODE: list = []  # one FakeTensorMode, made on first use: CPU tensors with no storage


def _conv_memory_format(x: torch.Tensor, w: torch.Tensor, bias: Any, bias_sizes: Any, rest: tuple) -> Any:
    """The memory format CPU convolution returns for arguments of ``x``'s and ``w``'s metadata
    (torch's fake ``conv`` implementation, which tracing used)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    if not _CONV_FAKE_MODE:
        _CONV_FAKE_MODE.append(FakeTensorMode())
    with _CONV_FAKE_MODE[0]:
        fx = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="cpu")
        fw = torch.empty_strided(w.shape, w.stride(), dtype=w.dtype, device="cpu")
        fb = torch.empty_strided(bias.shape, bias.stride(), dtype=bias.dtype, device="cpu") if _present(bias) else None
        backend = torch._C._select_conv_backend(fx, fw, fb, *rest, bias_sizes if fb is None else None)
        if w.dim() == 3:  # 1-d: decided on the 2-d form, as the kernel runs it
            fx, fw = fx.contiguous().unsqueeze(2), fw.unsqueeze(2)
        return torch._C._conv_determine_backend_memory_format(fx, fw, backend)


def _in_format(t: Any, fmt: Any) -> Any:
    """Meta tensor ``t`` in memory format ``fmt`` (a 3-d tensor: channels-last of its 4-d form)."""
    if not _present(t):
        return t
    if t.dim() == 3 and fmt == torch.channels_last:
        return t.unsqueeze(2).to(memory_format=fmt).squeeze(2)
    return t.to(memory_format=fmt)


_CONV_REST = ((3, "stride"), (4, "padding"), (5, "dilation"), (6, "transposed"), (7, "output_padding"), (8, "groups"))


def _cpu_convolution(args: tuple, kwargs: dict, value: Any) -> Any:
    """``convolution(input, weight, bias, stride, padding, dilation, transposed, output_padding, groups)``."""
    x, w, bias = (_arg(args, kwargs, k, n) for k, n in ((0, "input"), (1, "weight"), (2, "bias")))
    rest = tuple(_arg(args, kwargs, k, n) for k, n in _CONV_REST)
    return _in_format(value, _conv_memory_format(x, w, bias, None, rest))


def _cpu_convolution_backward(args: tuple, kwargs: dict, value: Any) -> Any:
    """``convolution_backward(grad_output, input, weight, bias_sizes, stride, ...)``: grad_input
    and grad_weight in the forward's format, grad_bias as it is."""
    x, w, sizes = (_arg(args, kwargs, k, n) for k, n in ((1, "input"), (2, "weight"), (3, "bias_sizes")))
    rest = tuple(_arg(args, kwargs, k + 1, n) for k, n in _CONV_REST)
    fmt = _conv_memory_format(x, w, None, sizes, rest)
    return (_in_format(value[0], fmt), _in_format(value[1], fmt), value[2])


def _cuda_log_sigmoid(args: tuple, kwargs: dict, value: Any) -> Any:
    """CUDA ``log_sigmoid_forward`` returns an empty ``buffer`` (its backward does not read it;
    meta: ``self``'s shape, as CPU's)."""
    out, buffer = value
    return value if buffer.numel() == 0 else (out, _remade(buffer, shape=(0,)))


_aten = torch.ops.aten
#: device type -> op -> (args, kwargs, meta result) -> what that device's kernel returns
RULES: dict[str, dict[Any, Callable[[tuple, dict, Any], Any]]] = {
    "cpu": {
        _aten.native_layer_norm.default: _cpu_layer_norm,
        _aten.native_group_norm.default: _cpu_group_norm,
        _aten.native_batch_norm.default: _batch_norm(5),
        _aten._native_batch_norm_legit.default: _batch_norm(5),
        _aten._native_batch_norm_legit.no_stats: _batch_norm(3),
        _aten._native_batch_norm_legit_no_training.default: _batch_norm(None),
        _aten.native_batch_norm_backward.default: _batch_norm_backward,
        _aten._embedding_bag.default: _embedding_bag,
        _aten.threshold_backward.default: _promoted("grad_output", "self", (0, 1)),
        _aten.native_dropout_backward.default: _dropout_backward,
        _aten.mse_loss_backward.default: _mse_loss_backward,
        _aten.native_dropout.default: _native_dropout,
        _aten.convolution.default: _cpu_convolution,
        _aten.convolution_backward.default: _cpu_convolution_backward,
    },
    "cuda": {
        _aten.log_sigmoid_forward.default: _cuda_log_sigmoid,
    },
}


def corrected(device_type: str, op: Any, args: tuple, kwargs: dict, value: Any) -> Any:
    """``value`` (an op's meta result) as the artifact's ``device_type`` kernel returns it."""
    rule = RULES.get(device_type, {}).get(op)
    return value if rule is None else rule(args, kwargs, value)

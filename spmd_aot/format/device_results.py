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
"""

from __future__ import annotations

from typing import Any, Callable

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


_aten = torch.ops.aten
#: device type -> op -> (args, kwargs, meta result) -> what that device's kernel returns
RULES: dict[str, dict[Any, Callable[[tuple, dict, Any], Any]]] = {
    "cpu": {
        _aten.native_layer_norm.default: _cpu_layer_norm,
        _aten.native_group_norm.default: _cpu_group_norm,
    },
}


def corrected(device_type: str, op: Any, args: tuple, kwargs: dict, value: Any) -> Any:
    """``value`` (an op's meta result) as the artifact's ``device_type`` kernel returns it."""
    rule = RULES.get(device_type, {}).get(op)
    return value if rule is None else rule(args, kwargs, value)

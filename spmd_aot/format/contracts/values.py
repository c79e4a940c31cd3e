"""Run-time value checks: overloads whose kernels write where index values say, without a
bounds check, or trap on values (integer division); ``program`` runs these right before every
such call, and before folding a constant at load."""

from __future__ import annotations

from collections.abc import Callable

import torch

from .rules import _bind


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


_INT_MIN = {torch.int64: -(1 << 63), torch.int32: -(1 << 31)}


def _trunc_division_values(args: tuple, kwargs: dict) -> None:
    """Integer division rounding toward zero runs x86's ``idiv``, which traps on the one quotient
    that does not fit, INT_MIN / -1 (SIGFPE, for int64 and int32; floor division and the other
    integer types do not trap). Refused before the call, on any device (CUDA wraps instead)."""
    self, other = args[0], args[1] if len(args) > 1 else kwargs.get("other")
    if kwargs.get("rounding_mode") != "trunc" or not isinstance(self, torch.Tensor):
        return
    dtype = torch.result_type(self, other)
    low = _INT_MIN.get(dtype)
    if low is None or self.numel() == 0:
        return
    if isinstance(other, torch.Tensor):
        bad = bool(((self == low) & (other == -1)).any())
    else:
        bad = other == -1 and bool((self == low).any())
    if bad:
        raise ArithmeticError(f"div(rounding_mode='trunc'): {low} / -1 overflows {dtype} (the CPU kernel traps on it)")


#: Overloads whose kernels (CPU or CUDA) write where index values say without checking them:
#: name -> check(args, kwargs), run before every call (program.py). Embedding's backward counts
#: ``counts[index]++`` with ``scale_grad_by_freq`` (CPU) and scatters rows by index (CUDA);
#: max-pool's backward adds into ``grad_input[index]``.
VALUE_CHECKS: dict[str, Callable[[tuple, dict], None]] = {
    "aten::embedding_dense_backward.default": _embedding_backward_values,
    "aten::max_pool2d_with_indices_backward.default": _max_pool_backward_values,
    "aten::_embedding_bag.default": _embedding_bag_values,
    "aten::div.Tensor_mode": _trunc_division_values,
    "aten::div.Scalar_mode": _trunc_division_values,
}

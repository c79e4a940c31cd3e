"""Grouped matrix products (mixture-of-experts layers) traced into static-shape ops.

transformers' default experts implementation (``experts_implementation="grouped_mm"``) sorts
the (token, expert) pairs by expert, counts them per expert with ``torch.histc``, and runs
each expert's rows through its weights with ``aten._grouped_mm(x, w, offs)``, ``offs`` the
cumulative row counts (group ``g`` is rows ``[offs[g-1], offs[g])``). Torch 2.13's meta
kernel of ``_grouped_mm`` accepts bf16 only (the CPU kernel runs fp32 too), so tracing an
fp32 model on fake tensors failed; and neither ``_grouped_mm`` (its CPU kernel trusts
``offs``) nor ``histc`` is an op a stored graph may call (``format/allowed_ops.txt``).

While the step is traced, ``DECOMPOSITIONS`` (make_fx's decomposition table) replaces both
with allowlisted ops whose shapes do not depend on values (and two more ops the same code
calls: ``floor_divide`` becomes the ``div(rounding_mode="floor")`` it equals, the in-place
``index_put_`` the out-of-place ``index_put`` copied back):

- ``_grouped_mm``: every group's product is computed over all rows (one batched matmul over
  the groups) and each output row keeps its own group's product (``where`` on a row-to-group
  mask made by comparing row indices with ``offs``; the other groups contribute exact zeros).
  The same result as the kernel's per-group slices (rows past ``offs[-1]``, which the kernel
  leaves unwritten, are zero) at the cost of ``groups`` times the matmul work and a
  ``groups x rows x features`` intermediate; autograd's formula for ``_grouped_mm`` calls it
  again for the gradients (the 2-D x 2-D form for the weights), which are replaced the same
  way. A model with many experts pays that: ``experts_implementation="batched_mm"`` gathers
  each pair's expert weights instead (memory ``pairs x weight``, no wasted compute).
- ``histc``: each value's bin as the kernel computes it (``(x - min) * bins / (max - min)``
  in the input's dtype, truncated; ``max`` itself in the last bin; values outside
  ``[min, max]`` and NaN dropped), counted with a one-hot sum.

What cannot be replaced exactly (a bias or ``out_dtype`` on ``_grouped_mm``, ``histc`` with
``min == max``, which takes its range from the values) is refused in one line naming the
``batched_mm`` experts implementation.
"""

from __future__ import annotations

import struct
import traceback

import torch

from ..errors import UnsupportedError
from .data_dependent import _is_user

__all__ = ["DECOMPOSITIONS", "grouped_mm", "histc", "floor_divide", "index_put_"]

aten = torch.ops.aten

_FIX = ("build the model with experts_implementation=\"batched_mm\" (transformers: "
        "`from_pretrained(..., experts_implementation=\"batched_mm\")` or the config's "
        "`experts_implementation=\"batched_mm\"`)")


def _refuse(what: str) -> UnsupportedError:
    frames = [f for f in traceback.extract_stack() if _is_user(f.filename)]
    where = f" at {frames[-1].filename}:{frames[-1].lineno} `{(frames[-1].line or '').strip()}`" if frames else ""
    return UnsupportedError(f"{what}{where} has no static-shape form spmd-aot can store; {_FIX}")


def _groups_of(offs: torch.Tensor, n: int) -> torch.Tensor:
    """``[groups, n]`` bool: whether index ``i`` (a row of the jagged operand) lies in group
    ``g``, i.e. ``offs[g-1] <= i < offs[g]``. Indices at or past ``offs[-1]`` are in none."""
    index = torch.arange(n, device=offs.device)
    group = (index.unsqueeze(1) >= offs.unsqueeze(0)).sum(1)  # groups that end at or before i
    return group.unsqueeze(0) == torch.arange(offs.shape[0], device=offs.device).unsqueeze(1)


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor | None = None,
               bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``aten._grouped_mm`` on static shapes (see the module docstring). The four forms:
    ``[S, K] x [G, K, N] -> [S, N]`` (rows of ``a`` grouped; the experts' forward and input
    gradient), ``[M, S] x [S, N] -> [G, M, N]`` (the shared dim grouped; the weight gradient),
    ``[G, M, K] x [K, S] -> [M, S]`` (columns of ``b`` grouped), ``[G, M, K] x [G, K, N]``
    (no ``offs``: a batched matmul)."""
    if bias is not None:
        raise _refuse("torch._grouped_mm with a bias")
    if out_dtype is not None and out_dtype != a.dtype:
        raise _refuse(f"torch._grouped_mm with out_dtype={out_dtype}")
    if a.dim() == 3 and b.dim() == 3:
        if offs is not None:
            raise _refuse("torch._grouped_mm of two 3-D operands with offs")
        return torch.bmm(a, b)
    if offs is None or offs.dim() != 1:
        raise _refuse("torch._grouped_mm of a 2-D operand without 1-D offs")
    if a.dim() == 2 and b.dim() == 3:  # out[rows of g] = a[rows of g] @ b[g]
        mask = _groups_of(offs, a.shape[0])  # [G, S]
        every = torch.matmul(a.unsqueeze(0), b)  # [G, S, N]
        return torch.where(mask.unsqueeze(-1), every, 0).sum(0)
    if a.dim() == 2 and b.dim() == 2:  # out[g] = a[:, cols of g] @ b[rows of g]
        mask = _groups_of(offs, a.shape[1])  # [G, S]
        return torch.matmul(torch.where(mask.unsqueeze(1), a.unsqueeze(0), 0), b)  # [G, M, N]
    if a.dim() == 3 and b.dim() == 2:  # out[:, cols of g] = a[g] @ b[:, cols of g]
        mask = _groups_of(offs, b.shape[1])  # [G, S]
        every = torch.matmul(a, b)  # [G, M, S]: one [G*M, K] x [K, S] product
        return torch.where(mask.unsqueeze(1), every, 0).sum(0)
    raise _refuse(f"torch._grouped_mm of {a.dim()}-D and {b.dim()}-D operands")


def _rounded(value: float, dtype: torch.dtype) -> float:
    """``value`` as the kernel holds it: in the input's dtype (a float32 for float32 input)."""
    if dtype == torch.float64:
        return float(value)
    if dtype == torch.float32:
        return struct.unpack("f", struct.pack("f", float(value)))[0]
    if not dtype.is_floating_point:
        return float(int(value))
    return torch.tensor(float(value), dtype=dtype).item()  # a host scalar: no graph node


def histc(x: torch.Tensor, bins: int = 100, min: float = 0, max: float = 0) -> torch.Tensor:  # noqa: A002
    """``aten.histc`` on static shapes, binning as torch's kernels do (see the module
    docstring). Integer input (transformers' experts on CUDA) bins with integer arithmetic, as
    the CUDA kernel does: computed exactly in float64."""
    if min == max:
        raise _refuse("torch.histc with min == max (a range taken from the values)")
    if bins <= 0 or x.dtype in (torch.bool, torch.complex64, torch.complex128):
        raise _refuse(f"torch.histc with bins={bins} on a {x.dtype} tensor")
    lo, hi = _rounded(min, x.dtype), _rounded(max, x.dtype)
    width = _rounded(hi - lo, x.dtype)
    flat = x.reshape(-1)
    if not x.is_floating_point():
        flat = flat.to(torch.float64)
    position = ((flat - lo) * bins / width).to(torch.int64).clamp(0, bins - 1)
    position = torch.where(flat == hi, bins - 1, position)
    inside = (flat >= lo) & (flat <= hi)  # NaN compares false: dropped
    hits = (position.unsqueeze(0) == torch.arange(bins, device=x.device).unsqueeze(1)) & inside.unsqueeze(0)
    return hits.sum(1).to(x.dtype)


def floor_divide(a, b):
    """``aten.floor_divide`` (the experts' ``perm // top_k``, the token of each sorted pair) as
    ``div(rounding_mode="floor")``, the op it equals and the one the allowlist holds."""
    return torch.div(a, b, rounding_mode="floor")


def index_put_(x, indices, values, accumulate=False):
    """``aten.index_put_`` (the experts' inverse permutation, ``inv[perm] = arange(n)``) as the
    allowlisted out-of-place ``index_put`` copied back into ``x``: the same writes to ``x``."""
    return x.copy_(aten.index_put.default(x, indices, values, accumulate))


#: make_fx's decomposition table while the step is traced (``trace.py``)
DECOMPOSITIONS = {aten._grouped_mm.default: grouped_mm, aten.histc.default: histc,
                  aten.floor_divide.default: floor_divide, aten.index_put_.default: index_put_}

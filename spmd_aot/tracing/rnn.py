"""Recurrent layers (``nn.LSTM``, ``nn.GRU``, ``nn.RNN``) traced into allowlisted ops.

Why: on CPU, torch runs an fp32 or bf16 LSTM through oneDNN (``aten.mkldnn_rnn_layer`` and its
backward: opaque kernels taking weights, hidden sizes and a workspace as raw arguments, which no
load may admit), and its native GRU and RNN cells split their gate products with
``aten.unsafe_split``, an op the allowlist refuses by family (it skips the view bookkeeping that
``split`` does).

So while the step is traced:

- a call of ``torch._VF.lstm`` / ``gru`` / ``rnn_tanh`` / ``rnn_relu`` (what the modules call)
  runs with oneDNN off for that call only (``native_rnn_cells``), so torch takes its native
  path: per time step, a matmul of the gates and the elementwise cell, all ordinary ops.
  Convolutions elsewhere in the model keep oneDNN, whose layout choices the graph records;
- ``unsafe_split`` and ``unsafe_split_with_sizes`` are recorded as ``split_with_sizes_copy``
  (``DECOMPOSITIONS``): the same pieces, each in its own storage. Not views: the GRU cell
  multiplies one gate chunk in place by another chunk of the same product
  (``h_n.mul_(r)``), which shares no element with it but interleaves with it in memory, and
  the load's contracts refuse an in-place op whose arguments' extents overlap. The cells never
  read the split tensor again, so the copies compute what the views did.

The native cells compute what oneDNN computes to rounding (LSTM within ~5e-7 of it on the
gradients of a 2-layer model); the stored graph runs them on every device.
"""

from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["DECOMPOSITIONS", "native_rnn_cells"]

aten = torch.ops.aten
_RNN_CALLS = frozenset({torch._VF.lstm, torch._VF.gru, torch._VF.rnn_tanh, torch._VF.rnn_relu})


class _NativeCells(TorchFunctionMode):
    """Runs the recurrent layers' ``_VF`` calls with oneDNN off; every other call as it is."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in _RNN_CALLS:
            return func(*args, **kwargs)
        enabled = torch._C._get_mkldnn_enabled()
        torch._C._set_mkldnn_enabled(False)
        try:
            return func(*args, **kwargs)
        finally:
            torch._C._set_mkldnn_enabled(enabled)


@contextlib.contextmanager
def native_rnn_cells():
    """While active, recurrent layers take torch's native path (see the module doc)."""
    with _NativeCells():
        yield


def _split(x, split_size, dim=0):
    """``unsafe_split(x, split_size, dim)``: pieces of ``split_size`` along ``dim``, the last one shorter."""
    n = x.shape[dim]
    sizes = [min(split_size, n - start) for start in range(0, n, split_size)] if split_size > 0 else [n]
    return aten.split_with_sizes_copy.default(x, sizes, dim)


def _split_with_sizes(x, split_sizes, dim=0):
    return aten.split_with_sizes_copy.default(x, split_sizes, dim)


#: make_fx's decomposition table entries while the step is traced (``trace.py``)
DECOMPOSITIONS = {aten.unsafe_split.Tensor: _split, aten.unsafe_split_with_sizes.default: _split_with_sizes}

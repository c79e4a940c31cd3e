"""Adversarial op fuzzer: break every admitted overload's argument contract, and run what the
load-time check accepts for real.

For every overload in ``spmd_aot/allowed_ops.txt`` (read at run time) this builds valid argument
sets (``SAMPLES``, else derived from the schema), then mutates each one: wrong and 1-element
sizes, a zero size in every dimension, stride 0 (expand), non-contiguous, other dtypes, aliased
and overlapping tensors, lists of the wrong length, dims and sizes out of range, every flag and
mask entry flipped, ints replaced by -1, 0, huge values and the int64 extremes, floats by NaN,
infinities and 0, mode strings by others, integer tensors holding negative, out-of-range, INT_MIN
and INT_MAX values, float tensors holding NaN and infinities, huge sizes (as stride-0 views and
size arguments: refused by the load limits, never allocated), and one size changed to 0 or 1 in
every tensor and int argument that has it (a sequence length of 0 in query, key and value). By
default it also breaks two arguments at once (``pair_mutations``: a zero size with another
tensor's layout or dtype, or a flag, changed; ``--no-pairs`` skips them): a kernel's slow path can
fail on an empty argument its fast path handles.
Each set first goes through the check a loaded graph goes through (``validate.check_node``: the
op's contract, its meta kernel, the result checks) on meta tensors; whatever it accepts then runs
for real on CPU (``--device cuda``: on the GPU, each run synchronized, a CUDA fault counted
as a crash) in a child process (glibc's heap checker, ``faulthandler``, a timeout), after the
run-time index check ``program.py`` applies. A Python exception from torch is fine; a signal,
an abort or a hang is a crash, reported with its case. ``EDGES`` adds hand-made cases at the
edges of a contract (a view ending exactly at its storage's end and one element past it, sizes
of 0, complex views of the wrong layout or dtype).

The heap checker: on glibc 2.34 and later ``MALLOC_CHECK_=3`` does nothing unless
``libc_malloc_debug.so.0`` is preloaded, so children run with both, and each child reads its own
``/proc/self/maps`` and refuses to run a case unless the checker is mapped (the run then fails);
before any case, a child writes one byte past a tensor's storage and must die of it.

Every accepted case's result is also compared with what the load's check derives for the
device (the meta kernel's result as ``format/device_results.py`` corrects it: shape, dtype and
which outputs are absent): a divergence means a contract checked on that metadata does not
describe the values downstream. Crashes and divergences are reported per op, and either makes
the run exit with status 1.

Children run many cases each and log each case's index before running it, so a crash names its
case and the parent restarts a child from the next one.

    python tools/fuzz/fuzz_ops.py                 # every op, every mutation and pair of mutations
    python tools/fuzz/fuzz_ops.py --slice 8       # every 8th op plus the review's crash ops (CI)
    python tools/fuzz/fuzz_ops.py --op aten::native_batch_norm.default -v
    python tools/fuzz/fuzz_ops.py --device cuda   # on a lent GPU: the kernels a CUDA artifact calls
"""

from __future__ import annotations

import argparse
import ctypes.util
import dataclasses
import json
import os
import pickle
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch

# ------------------------------------------------------------------ tensor recipes


@dataclasses.dataclass(frozen=True)
class T:
    """A tensor recipe: geometry on a storage (``storage`` id shared = aliased) and a fill rule."""
    shape: tuple
    dtype: str = "float32"
    stride: tuple | None = None  # None: contiguous
    offset: int = 0
    storage: int | None = None  # None: its own storage
    fill: Any = "randn"  # "randn" | ("int", lo, hi) | "bool" | ("const", v)

    def strides(self) -> tuple:
        if self.stride is not None:
            return self.stride
        out, acc = [], 1
        for n in reversed(self.shape):
            out.append(acc)
            acc *= max(n, 1)
        return tuple(reversed(out))

    def elements(self) -> int:
        if 0 in self.shape:
            return self.offset
        return self.offset + 1 + sum((n - 1) * s for n, s in zip(self.shape, self.strides()))


def t(*shape, dtype="float32", fill=None, **kw) -> T:
    if fill is None:
        fill = ("int", 0, 3) if dtype in ("int64", "int32", "uint8") else "bool" if dtype == "bool" else "randn"
    return T(tuple(shape), dtype, fill=fill, **kw)


def _recipes(v, out):
    if isinstance(v, T):
        out.append(v)
    elif isinstance(v, (list, tuple)):
        for x in v:
            _recipes(x, out)
    elif isinstance(v, dict):
        for x in v.values():
            _recipes(x, out)
    return out


def materialize(args, kwargs, device: str, group: str | None = None):
    """Real (or meta) tensors for the recipes in ``args``/``kwargs``; shared storage ids share one."""
    recipes = _recipes([args, kwargs], [])
    sizes: dict = {}
    for k, r in enumerate(recipes):
        key = r.storage if r.storage is not None else ("own", k)
        sizes[key] = (max(sizes.get(key, (0,))[0], r.elements()), r)
    bases = {}
    gen = torch.Generator().manual_seed(0)
    for key, (n, r) in sizes.items():
        dtype = getattr(torch, r.dtype)
        if device == "meta":
            bases[key] = torch.empty(n, dtype=dtype, device="meta")
        elif r.fill == "bool":
            bases[key] = torch.rand(n, generator=gen) > 0.5
        elif isinstance(r.fill, tuple) and r.fill[0] == "int":
            bases[key] = torch.randint(r.fill[1], r.fill[2], (n,), generator=gen).to(dtype)
        elif isinstance(r.fill, tuple) and r.fill[0] == "const":
            bases[key] = torch.full((n,), r.fill[1]).to(dtype)
        else:
            bases[key] = (torch.rand(n, generator=gen) + 0.5).to(dtype) if dtype.is_floating_point or \
                dtype.is_complex else torch.randint(0, 3, (n,), generator=gen).to(dtype)
        if device not in ("meta", "cpu"):
            bases[key] = bases[key].to(device)  # the same values on every device
    counter = iter(range(len(recipes)))

    def build(v):
        if isinstance(v, T):
            k = next(counter)
            base = bases[v.storage if v.storage is not None else ("own", k)]
            return base.as_strided(v.shape, v.strides(), v.offset)
        if isinstance(v, list):
            return [build(x) for x in v]
        if isinstance(v, tuple):
            return tuple(build(x) for x in v)
        if isinstance(v, dict):
            return {k: build(x) for k, x in v.items()}
        if v == "<group>" and group is not None:
            return group
        if isinstance(v, str) and v.startswith("<dtype:"):
            return getattr(torch, v[7:-1])
        return v
    return build(args), build(kwargs)


# ------------------------------------------------------------------ valid samples
F, L = "float32", "int64"
ADAM = dict(lr=0.01, beta1=0.9, beta2=0.99, weight_decay=0.01, eps=1e-8, amsgrad=False, maximize=False)
SGD = dict(weight_decay=0.0, momentum=0.9, lr=0.1, dampening=0.0, nesterov=False, maximize=False, is_first_step=False)
G = "<group>"


def _adam(lr_tensor: bool):
    kw = dict(ADAM, lr=t(dtype="float64") if lr_tensor else 0.01)
    return [((t(4, 3), t(5)), (t(4, 3), t(5)), (t(4, 3), t(5)), (t(4, 3), t(5)), [], [t(), t()]), kw]


def _sgd(lr_tensor: bool):
    return [([t(4, 3), t(5)], [t(4, 3), t(5)], [t(4, 3), t(5)]), dict(SGD, lr=t(dtype="float64") if lr_tensor else 0.1)]


SAMPLES: dict[str, list] = {  # op -> [[args, kwargs], ...]; the rest is derived from the schema
    "aten::mm.default": [[(t(3, 4), t(4, 5)), {}]],
    "aten::mm.out": [[(t(3, 4), t(4, 5)), {"out": t(3, 5)}]],
    "aten::addmm.default": [[(t(5), t(3, 4), t(4, 5)), {}]],
    "aten::bmm.default": [[(t(2, 3, 4), t(2, 4, 5)), {}]],
    "aten::baddbmm.default": [[(t(2, 3, 5), t(2, 3, 4), t(2, 4, 5)), {}]],
    "aten::linear.default": [[(t(3, 4), t(5, 4), t(5)), {}]],
    "aten::matmul.default": [[(t(2, 3, 4), t(4, 5)), {}]],
    "aten::native_layer_norm.default": [[(t(4, 3, 8), [8], t(8), t(8), 1e-5), {}]],
    "aten::native_layer_norm_backward.default": [[(t(4, 3, 8), t(4, 3, 8), [8], t(4, 3, 1), t(4, 3, 1), t(8), t(8),
                                                   [True, True, True]), {}]],
    "aten::native_batch_norm.default": [[(t(4, 3, 5), t(3), t(3), t(3), t(3), True, 0.1, 1e-5), {}]],
    "aten::_native_batch_norm_legit.default": [[(t(4, 3, 5), t(3), t(3), t(3), t(3), True, 0.1, 1e-5), {}]],
    "aten::_native_batch_norm_legit.no_stats": [[(t(4, 3, 5), t(3), t(3), True, 0.1, 1e-5), {}]],
    "aten::_native_batch_norm_legit_no_training.default": [[(t(4, 3, 5), t(3), t(3), t(3), t(3), 0.1, 1e-5), {}]],
    "aten::native_batch_norm_backward.default": [[(t(4, 3, 5), t(4, 3, 5), t(3), t(3), t(3), t(3), t(3), True, 1e-5,
                                                   [True, True, True]), {}]],
    "aten::native_group_norm.default": [[(t(2, 4, 5), t(4), t(4), 2, 4, 5, 2, 1e-5), {}]],
    "aten::native_group_norm_backward.default": [[(t(2, 4, 5), t(2, 4, 5), t(2, 2), t(2, 2), t(4), 2, 4, 5, 2,
                                                   [True, True, True]), {}]],
    "aten::_softmax.default": [[(t(3, 4), 1, False), {}]],
    "aten::_log_softmax.default": [[(t(3, 4), 1, False), {}]],
    "aten::_softmax_backward_data.default": [[(t(3, 4), t(3, 4), 1, "<dtype:float32>"), {}]],
    "aten::_log_softmax_backward_data.default": [[(t(3, 4), t(3, 4), 1, "<dtype:float32>"), {}]],
    "aten::_safe_softmax.default": [[(t(3, 4), 1), {}]],
    "aten::nll_loss_forward.default": [[(t(3, 5), t(3, dtype=L, fill=("int", 0, 5)), t(5), 1, -100), {}]],
    "aten::nll_loss_backward.default": [[(t(), t(3, 5), t(3, dtype=L, fill=("int", 0, 5)), t(5), 1, -100, t()), {}]],
    "aten::embedding.default": [[(t(10, 4), t(2, 3, dtype=L, fill=("int", 0, 10))), {}]],
    "aten::embedding_dense_backward.default": [[(t(2, 3, 4), t(2, 3, dtype=L, fill=("int", 0, 10)), 10, -1, True), {}],
                                               [(t(2, 3, 4), t(2, 3, dtype=L, fill=("int", 0, 10)), 10, 0, False), {}]],
    "aten::_embedding_bag.default": [[(t(10, 4), t(6, dtype=L, fill=("int", 0, 10)), t(2, dtype=L, fill=("const", 0)),
                                       False, 0, False, None, False, -1), {}]],
    "aten::index_select.default": [[(t(5, 4), 0, t(3, dtype=L, fill=("int", 0, 5))), {}]],
    "aten::gather.default": [[(t(5, 4), 1, t(5, 2, dtype=L, fill=("int", 0, 4))), {}]],
    "aten::scatter_add.default": [[(t(5, 4), 1, t(5, 2, dtype=L, fill=("int", 0, 4)), t(5, 2)), {}]],
    "aten::scatter.src": [[(t(5, 4), 1, t(5, 2, dtype=L, fill=("int", 0, 4)), t(5, 2)), {}]],
    "aten::scatter.value": [[(t(5, 4), 1, t(5, 2, dtype=L, fill=("int", 0, 4)), 1.0), {}]],
    "aten::scatter_.src": [[(t(5, 4), 1, t(5, 2, dtype=L, fill=("int", 0, 4)), t(5, 2)), {}]],
    "aten::scatter_.value": [[(t(5, 4), 1, t(5, 2, dtype=L, fill=("int", 0, 4)), 1.0), {}]],
    "aten::scatter_reduce.two": [[(t(5, 4), 1, t(5, 2, dtype=L, fill=("int", 0, 4)), t(5, 2), "sum"), {}]],
    "aten::index.Tensor": [[(t(5, 4), [t(3, dtype=L, fill=("int", 0, 5))]), {}]],
    "aten::index_put.default": [[(t(5, 4), [t(3, dtype=L, fill=("int", 0, 5))], t(3, 4), True), {}]],
    "aten::masked_scatter.default": [[(t(3, 4), t(3, 4, dtype="bool"), t(12)), {}]],
    "aten::avg_pool2d.default": [[(t(1, 2, 6, 6), [2, 2]), {}]],
    "aten::avg_pool2d_backward.default": [[(t(1, 2, 3, 3), t(1, 2, 6, 6), [2, 2], [2, 2], [0, 0], False, True, None), {}]],
    "aten::max_pool2d_with_indices.default": [[(t(1, 2, 6, 6), [2, 2]), {}]],
    "aten::max_pool2d_with_indices_backward.default": [[(t(1, 2, 3, 3), t(1, 2, 6, 6), [2, 2], [2, 2], [0, 0], [1, 1],
                                                         False, t(1, 2, 3, 3, dtype=L, fill=("int", 0, 36))), {}]],
    "aten::max_pool1d.default": [[(t(2, 3, 8), [2]), {}]],
    "aten::max_pool3d_with_indices.default": [[(t(1, 2, 4, 4, 4), [2, 2, 2]), {}]],
    "aten::avg_pool3d.default": [[(t(1, 2, 4, 4, 4), [2, 2, 2]), {}]],
    "aten::_adaptive_avg_pool2d.default": [[(t(1, 2, 6, 6), [3, 3]), {}]],
    "aten::_adaptive_avg_pool3d.default": [[(t(1, 2, 4, 4, 4), [2, 2, 2]), {}]],
    "aten::_adaptive_avg_pool2d_backward.default": [[(t(1, 2, 3, 3), t(1, 2, 6, 6)), {}]],
    "aten::convolution.default": [[(t(1, 4, 6, 6), t(6, 2, 3, 3), t(6), [1, 1], [1, 1], [1, 1], False, [0, 0], 2), {}],
                                  [(t(1, 4, 6, 6), t(4, 3, 3, 3), t(3), [2, 2], [1, 1], [1, 1], True, [1, 1], 1), {}]],
    "aten::convolution_backward.default": [[(t(1, 6, 6, 6), t(1, 4, 6, 6), t(6, 2, 3, 3), [6], [1, 1], [1, 1], [1, 1],
                                             False, [0, 0], 2, [True, True, True]), {}],
                                           [(t(1, 6, 6, 6), t(1, 4, 6, 6), t(6, 2, 3, 3), [0], [1, 1], [1, 1], [1, 1],
                                             False, [0, 0], 2, [True, True, False]), {}]],  # no bias
    "aten::_scaled_dot_product_flash_attention_for_cpu.default": [[(t(2, 3, 5, 8), t(2, 3, 6, 8), t(2, 3, 6, 8)),
                                                                    {"attn_mask": t(5, 6)}],
                                                                   [(t(2, 4, 5, 8), t(2, 2, 6, 8), t(2, 2, 6, 8)), {}]],
    "aten::_scaled_dot_product_flash_attention_for_cpu_backward.default": [
        [(t(2, 3, 5, 8), t(2, 3, 5, 8), t(2, 3, 6, 8), t(2, 3, 6, 8), t(2, 3, 5, 8), t(2, 3, 5), 0.0, False), {}],
        [(t(2, 4, 5, 8), t(2, 4, 5, 8), t(2, 2, 6, 8), t(2, 2, 6, 8), t(2, 4, 5, 8), t(2, 4, 5), 0.0, True), {}]],
    "aten::_fused_adam_.default": [_adam(False)], "aten::_fused_adamw_.default": [_adam(False)],
    "aten::_fused_adam_.tensor_lr": [_adam(True)], "aten::_fused_adamw_.tensor_lr": [_adam(True)],
    "aten::_fused_sgd_.default": [_sgd(False)], "aten::_fused_sgd_.tensor_lr": [_sgd(True)],
    "aten::_foreach_add_.ScalarList": [[([t(3), t(4)], [1.0, 2.0]), {}]],
    "aten::_foreach_addcdiv_.ScalarList": [[([t(3), t(4)], [t(3), t(4)], [t(3), t(4)], [1.0, 2.0]), {}]],
    "aten::_foreach_pow.ScalarAndTensor": [[(2.0, [t(3), t(4)]), {}]],
    "aten::_fft_r2c.default": [[(t(4, 8), [1], 0, True), {}]],
    "aten::_fft_c2r.default": [[(t(4, 5, dtype="complex64"), [1], 0, 8), {}]],
    "aten::grid_sampler_2d.default": [[(t(1, 2, 4, 4), t(1, 3, 3, 2), 0, 0, False), {}]],
    "aten::col2im.default": [[(t(1, 8, 9), [4, 4], [2, 2], [1, 1], [0, 0], [1, 1]), {}]],
    "aten::_cdist_forward.default": [[(t(3, 4), t(5, 4), 2.0, None), {}]],
    "aten::_pdist_forward.default": [[(t(5, 4), 2.0), {}]],
    "aten::upsample_nearest2d.vec": [[(t(1, 2, 3, 3), [6, 6], None), {}]],
    "aten::upsample_bilinear2d.vec": [[(t(1, 2, 3, 3), [6, 6], False, None), {}]],
    "aten::upsample_bilinear2d.default": [[(t(1, 2, 3, 3), [6, 6], False), {}],
                                          [(t(1, 2, 3, 3), [5, 7], True, 1.5, 2.0), {}]],
    "aten::upsample_bilinear2d_backward.default": [[(t(1, 2, 6, 6), [6, 6], [1, 2, 3, 3], False), {}],
                                                   [(t(1, 2, 5, 7), [5, 7], [1, 2, 3, 3], True, 1.5, 2.0), {}]],
    "aten::reflection_pad1d.default": [[(t(2, 5), [2, 2]), {}]],
    "aten::reflection_pad2d.default": [[(t(1, 4, 4), [1, 1, 2, 2]), {}]],
    "aten::reflection_pad3d.default": [[(t(1, 1, 4, 4, 4), [1, 1, 1, 1, 1, 1]), {}]],
    "aten::replication_pad2d.default": [[(t(1, 4, 4), [1, 1, 2, 2]), {}]],
    "aten::replication_pad3d.default": [[(t(1, 1, 4, 4, 4), [1, 1, 1, 1, 1, 1]), {}]],
    "aten::empty_strided.default": [[([3, 4], [4, 1]), {}]],
    "aten::new_empty_strided.default": [[(t(2), [3, 4], [1, 3]), {}]],
    "aten::log_sigmoid_forward.default": [[(t(3, 4),), {}]],
    "aten::log_sigmoid_backward.default": [[(t(3, 4), t(3, 4), t(3, 4)), {}], [(t(3, 4), t(3, 4), t(0)), {}]],
    "aten::_weight_norm_interface.default": [[(t(4, 3, 5), t(1, 1, 5), 2), {}], [(t(4, 3, 5), t(4, 1, 1), 0), {}]],
    "aten::_weight_norm_interface_backward.default": [[(t(4, 3, 5), t(4, 3, 5), t(1, 1, 5), t(1, 1, 5), 2), {}],
                                                      [(t(4, 3, 5), t(4, 3, 5), t(4, 1, 1), t(4, 1, 1), 0), {}]],
    "aten::bucketize.Tensor": [[(t(3, 4), t(5)), {}], [(t(3, 4), t(5)), {"out_int32": True, "right": True}]],
    "aten::select_backward.default": [[(t(4), [3, 4], 0, 1), {}]],
    "aten::slice_backward.default": [[(t(2, 4), [3, 4], 0, 1, 3, 1), {}]],
    "aten::select_scatter.default": [[(t(3, 4), t(4), 0, 1), {}]],
    "aten::slice_scatter.default": [[(t(3, 4), t(2, 4), 0, 1, 3, 1), {}]],
    "aten::split_with_sizes.default": [[(t(6, 4), [2, 4]), {}]],
    "aten::split_with_sizes_copy.default": [[(t(6, 4), [2, 4]), {}]],
    "aten::unflatten.int": [[(t(6, 4), 0, [2, 3]), {}]],
    "aten::view.default": [[(t(6, 4), [4, 6]), {}]], "aten::reshape.default": [[(t(6, 4), [4, 6]), {}]],
    "aten::_unsafe_view.default": [[(t(6, 4), [4, 6]), {}]],
    "aten::expand.default": [[(t(1, 4), [3, 4]), {}]], "aten::permute.default": [[(t(2, 3, 4), [2, 0, 1]), {}]],
    "aten::repeat.default": [[(t(2, 3), [2, 2]), {}]], "aten::constant_pad_nd.default": [[(t(2, 3), [1, 1]), {}]],
    "aten::diagonal.default": [[(t(3, 4), 0, 0, 1), {}]], "aten::roll.default": [[(t(3, 4), [1], [0]), {}]],
    "aten::flip.default": [[(t(3, 4), [0]), {}]], "aten::topk.default": [[(t(3, 4), 2), {}]],
    "aten::cat.default": [[([t(2, 4), t(3, 4)], 0), {}]], "aten::stack.default": [[([t(2, 4), t(2, 4)], 0), {}]],
    "aten::randperm.default": [[(5,), {}]], "aten::arange.default": [[(5,), {}]], "aten::arange.start": [[(1, 5), {}]],
    "aten::arange.start_step": [[(1, 9, 2), {}]], "aten::scalar_tensor.default": [[(2.0,), {}]],
    "aten::squeeze.dims": [[(t(1, 4, 1), [0, 2]), {}]], "aten::masked_fill.Tensor": [[(t(3, 4), t(3, 4, dtype="bool"), t()), {}]],
    "aten::masked_fill_.Tensor": [[(t(3, 4), t(3, 4, dtype="bool"), t()), {}]],
    "aten::where.self": [[(t(3, 4, dtype="bool"), t(3, 4), t(4)), {}]],
    "aten::native_dropout_backward.default": [[(t(3, 4), t(3, 4, dtype="bool"), 2.0), {}]],
    "aten::t.default": [[(t(3, 4),), {}]], "aten::narrow.default": [[(t(5, 4), 0, 1, 3), {}]],
    "aten::chunk.default": [[(t(6, 4), 3), {}]], "aten::split.Tensor": [[(t(6, 4), 2), {}]],
    "aten::cumsum.default": [[(t(3, 4), 1), {}]], "aten::sort.default": [[(t(3, 4),), {}]],
    "aten::copy_.default": [[(t(3, 4), t(4)), {}]], "aten::fill_.Tensor": [[(t(3, 4), t()), {}]],
    "_c10d_functional::all_gather_into_tensor_out.default": [[(t(3, 4), 1, G), {"out": t(3, 4)}]],
    "_c10d_functional::broadcast.default": [[(t(3, 4), 0, G), {}]],
    "_c10d_functional::reduce_scatter_tensor.default": [[(t(4, 4), "sum", 2, G), {}]],
    "_c10d_functional::reduce_scatter_tensor_coalesced.default": [[([t(4, 4), t(2)], "sum", 2, G), {}]],
    "aten::_foreach_add_.Tensor": [[([t(3), t(4)], t()), {}]], "aten::_foreach_div_.Tensor": [[([t(3), t(4)], t()), {}]],
    "aten::_foreach_mul.Tensor": [[([t(3), t(4)], t()), {}]], "aten::_foreach_mul_.Tensor": [[([t(3), t(4)], t()), {}]],
    "aten::clamp.Tensor": [[(t(3, 4), t(4), t(3, 1)), {}]], "aten::clamp.default": [[(t(3, 4), -1.0, 1.0), {}]],
    "aten::clamp_.default": [[(t(3, 4), -1.0, 1.0), {}], [(t(3, 4), None, 0.5), {}]],
    "_c10d_functional::broadcast_.default": [[(t(3, 4), 0, G), {}]],
    "_c10d_functional::all_to_all_single.default": [[(t(4, 3), [4], [4], G), {}]],  # a world of one
    # views by contract (spmd_aot/format/contracts/views.py): at and inside the storage's end
    "aten::as_strided.default": [[(t(4, 4), [4, 4], [4, 1], 0), {}],
                                 [(t(4, 4), [2, 2], [1, 4], 10), {}],  # last element = the storage's last
                                 [(t(32), [4, 8, 1, 1], [8, 1, 1, 1], 0), {}],  # AdaptiveAvgPool1d's backward
                                 [(t(4, 4), [3, 0, 5], [100, 7, 1], 16), {}]],  # empty, offset at the end
    "aten::view_as_complex.default": [[(t(3, 4, 2),), {}], [(t(3, 2, dtype="float64"),), {}],
                                      [(t(5, 2, dtype="float16"),), {}]],
    "aten::view_as_real.default": [[(t(3, 4, dtype="complex64"),), {}], [(t(3, dtype="complex128"),), {}]],
    "aten::polar.default": [[(t(3, 4), t(4)), {}], [(t(3, dtype="float64"), t(3, dtype="float64")), {}]],
    "aten::_conj.default": [[(t(3, 4, dtype="complex64"),), {}], [(t(3, dtype="complex128"),), {}]],
    "aten::unbind.int": [[(t(3, 4), 0), {}], [(t(3, 4), -1), {}]],
    "aten::div.Tensor_mode": [[(t(3, 4, dtype=L, fill=("int", -5, 5)), t(3, 4, dtype=L, fill=("int", 1, 5))),
                               {"rounding_mode": "trunc"}],
                              [(t(3, 4), t(4)), {"rounding_mode": "floor"}]],
    "aten::div.Scalar_mode": [[(t(3, 4, dtype=L, fill=("int", -5, 5)), 2), {"rounding_mode": "trunc"}],
                              [(t(3, 4), 2.0), {"rounding_mode": "floor"}]],
}

#: Hand-made cases at the edges of a contract: (label, [args, kwargs]); refused or run like mutations.
_MIN = ("const", -(1 << 63))
_BN_STATS = (t(4, 3, 5), t(4, 3, 5), t(3))  # grad_out, input, weight of native_batch_norm_backward
EDGES: dict[str, list] = {
    # kernels that crashed (a signal) on arguments that pass every shape check
    "aten::div.Tensor_mode": [
        ("int64_min_by_minus_one_trunc", [(t(3, dtype=L, fill=_MIN), t(3, dtype=L, fill=("const", -1))),
                                          {"rounding_mode": "trunc"}]),
        ("int32_min_by_minus_one_trunc", [(t(3, dtype="int32", fill=("const", -(1 << 31))),
                                           t(3, dtype="int32", fill=("const", -1))), {"rounding_mode": "trunc"}]),
        ("broadcast_min_by_minus_one_trunc", [(t(3, 4, dtype=L, fill=_MIN), t(4, dtype=L, fill=("const", -1))),
                                              {"rounding_mode": "trunc"}]),
        ("int64_min_by_minus_one_floor", [(t(3, dtype=L, fill=_MIN), t(3, dtype=L, fill=("const", -1))),
                                          {"rounding_mode": "floor"}]),
    ],
    "aten::div.Scalar_mode": [
        ("int64_min_by_minus_one_trunc", [(t(3, dtype=L, fill=_MIN), -1), {"rounding_mode": "trunc"}]),
        ("int32_min_by_minus_one_trunc", [(t(3, dtype="int32", fill=("const", -(1 << 31))), -1),
                                          {"rounding_mode": "trunc"}]),
    ],
    "aten::_scaled_dot_product_flash_attention_for_cpu.default": [
        ("empty_query", [(t(2, 3, 0, 8), t(2, 3, 6, 8), t(2, 3, 6, 8)), {}]),
        ("empty_key", [(t(2, 3, 5, 8), t(2, 3, 0, 8), t(2, 3, 0, 8)), {}]),
        ("no_heads", [(t(2, 0, 5, 8), t(2, 0, 6, 8), t(2, 0, 6, 8)), {}]),
    ],
    "aten::_scaled_dot_product_flash_attention_for_cpu_backward.default": [
        ("empty_query", [(t(2, 3, 0, 8), t(2, 3, 0, 8), t(2, 3, 6, 8), t(2, 3, 6, 8), t(2, 3, 0, 8), t(2, 3, 0),
                          0.0, False), {}]),
        ("empty_key", [(t(2, 3, 5, 8), t(2, 3, 5, 8), t(2, 3, 0, 8), t(2, 3, 0, 8), t(2, 3, 5, 8), t(2, 3, 5),
                        0.0, False), {}]),
    ],
    "aten::_embedding_bag.default": [
        ("max_last_offset_single", [(t(10, 4), t(6, dtype=L, fill=("int", 0, 10)), t(1, dtype=L, fill=("const", 0)),
                                     False, 2, False, None, True, -1), {}]),
        ("no_offsets", [(t(10, 4), t(6, dtype=L, fill=("int", 0, 10)), t(0, dtype=L), False, 0, False, None,
                         False, -1), {}]),
        ("no_offsets_slow_path", [(t(10, 4, stride=(1, 10)), t(6, dtype=L, fill=("int", 0, 10)), t(0, dtype=L),
                                   False, 0, False, None, False, -1), {}]),
        ("mean_padding_idx", [(t(10, 4), t(6, dtype=L, fill=("int", 0, 10)), t(2, dtype=L, fill=("const", 0)),
                               False, 1, False, None, False, 3), {}]),
    ],
    "aten::_adaptive_avg_pool2d_backward.default": [
        ("zero_input_height", [(t(1, 2, 3, 3), t(1, 2, 0, 6)), {}]),
        ("zero_channels", [(t(1, 0, 3, 3), t(1, 0, 6, 6)), {}]),
        ("zero_batch", [(t(0, 2, 3, 3), t(0, 2, 6, 6)), {}]),
    ],
    "aten::native_batch_norm.default": [
        ("eval_without_running_stats", [(t(4, 3, 5), t(3), t(3), None, None, False, 0.1, 1e-5), {}]),
        ("eval", [(t(4, 3, 5), t(3), t(3), t(3), t(3), False, 0.1, 1e-5), {}]),
    ],
    "aten::_native_batch_norm_legit.no_stats": [("eval", [(t(4, 3, 5), t(3), t(3), False, 0.1, 1e-5), {}])],
    "aten::native_batch_norm_backward.default": [
        ("eval_without_running_stats", [_BN_STATS + (None, None, t(3), t(3), False, 1e-5, [True] * 3), {}]),
        ("train_without_saved_stats", [_BN_STATS + (t(3), t(3), None, None, True, 1e-5, [True] * 3), {}]),
        ("eval_saved_stats_empty", [_BN_STATS + (t(3), t(3), t(0), t(0), False, 1e-5, [True] * 3), {}]),
        ("train_saved_stats_empty", [_BN_STATS + (t(3), t(3), t(0), t(0), True, 1e-5, [True] * 3), {}]),
    ],
    "aten::convolution_backward.default": [
        ("bias_grad_without_weight_grad", [(t(1, 6, 6, 6), t(1, 4, 6, 6), t(6, 2, 3, 3), [6], [1, 1], [1, 1], [1, 1],
                                            False, [0, 0], 2, [True, False, True]), {}]),
    ],
    "aten::as_strided.default": [
        ("one_past_the_end", [(t(4, 4), [2, 2], [1, 4], 11), {}]),
        ("huge_stride", [(t(4, 4), [2], [1 << 40]), {}]),
        ("stride_past_int48", [(t(4, 4), [1], [1 << 50]), {}]),
        ("negative_stride", [(t(4, 4), [2], [-1], 3), {}]),
        ("negative_size", [(t(4, 4), [-2], [1]), {}]),
        ("empty_huge_stride", [(t(4, 4), [0, 2], [1 << 40, 1], 0), {}]),
        ("empty_offset_past_the_end", [(t(4, 4), [0], [1], 17), {}]),
        ("empty_many_elements", [(t(4, 4), [0, 1 << 40, 1 << 40], [1, 1, 1]), {}]),
        ("offset_past_the_end", [(t(4, 4), [1], [1], 16), {}]),
        ("view_of_a_view", [(t(2, 4, offset=8, storage=1), [4, 2], [1, 4], 8), {}]),
        ("view_of_a_view_past_the_end", [(t(2, 4, offset=8, storage=1), [4, 2], [1, 4], 9), {}]),
        ("offset_default_of_a_shifted_input", [(t(2, 2, offset=12, storage=2), [4], [1]), {}]),
        ("short_stride", [(t(4, 4), [2, 2], [1]), {}]),
        ("zero_strides", [(t(4, 4), [1 << 20, 1 << 20], [0, 0]), {}]),
    ],
    "aten::view_as_complex.default": [
        ("last_dim_3", [(t(3, 3),), {}]), ("last_dim_1", [(t(3, 1),), {}]), ("zero_dim", [(t(),), {}]),
        ("last_stride_3", [(t(3, 2, stride=(1, 3)),), {}]), ("odd_stride", [(t(3, 2, stride=(3, 1)),), {}]),
        ("odd_offset", [(t(3, 2, offset=1),), {}]), ("bfloat16", [(t(3, 2, dtype="bfloat16"),), {}]),
        ("int64", [(t(3, 2, dtype="int64"),), {}]), ("complex64", [(t(3, 2, dtype="complex64"),), {}]),
        ("empty", [(t(0, 2),), {}]), ("stride0_pairs", [(t(3, 2, stride=(0, 1)),), {}]),
    ],
    "aten::view_as_real.default": [
        ("float32", [(t(3, 2),), {}]), ("empty", [(t(0, dtype="complex64"),), {}]),
        ("zero_dim", [(t(dtype="complex64"),), {}]), ("strided", [(t(3, dtype="complex64", stride=(2,)),), {}]),
    ],
    "aten::_conj.default": [("float32", [(t(3, 4),), {}]), ("int64", [(t(3, dtype="int64"),), {}])],
    "aten::unbind.int": [("many_views", [(t(1 << 22, 4, stride=(0, 1)), 0), {}]),
                         ("at_the_limit", [(t(1 << 16, 1, stride=(0, 1)), 0), {}])],
    "aten::split.Tensor": [("many_views", [(t(1 << 22, 4, stride=(0, 1)), 1), {}]), ("split_size_0", [(t(3, 4), 0), {}])],
    "aten::chunk.default": [("many_views", [(t(1 << 22, 4, stride=(0, 1)), 1 << 22), {}])],
    "aten::polar.default": [
        ("mixed_dtypes", [(t(3), t(3, dtype="float64")), {}]), ("half", [(t(3, dtype="float16"), t(3, dtype="float16")), {}]),
        ("no_broadcast", [(t(3), t(4)), {}]), ("int64", [(t(3, dtype="int64"), t(3, dtype="int64")), {}]),
    ],
}

_NAMED = {"mask": t(3, 4, dtype="bool"), "condition": t(3, 4, dtype="bool"), "index": t(3, 4, dtype=L),
          "indices": t(3, 4, dtype=L), "target": t(3, 4)}


def derived(op) -> list:
    """A valid argument set from the schema: [3, 4] float tensors, dim 1, two-tensor lists."""
    args, kwargs = [], {}
    for a in op._schema.arguments:
        ty, name = str(a.type), a.name
        if a.has_default_value():
            continue
        if ty == "Tensor":
            v = _NAMED.get(name, t(3, 4))
        elif ty == "List[Tensor]":
            v = [t(3, 4), t(5)]
        elif ty == "Optional[Tensor]":
            v = t(3, 4) if name in ("min", "max") else None
        elif ty == "int":
            v = 1 if "dim" in name else 2 if name in ("group_size", "chunks", "k") else 1
        elif ty in ("List[int]", "Optional[List[int]]"):
            v = [1] if "dim" in name else [3, 4]
        elif ty == "number":
            v = 2.0 if name != "min_val" else -1.0
        elif ty == "float":
            v = 0.5
        elif ty == "bool":
            v = False
        elif ty == "str":
            v = "sum"
        elif ty == "Any":
            v = G
        elif ty == "List[number]":
            v = [1.0, 2.0]
        else:
            v = None
        (kwargs.__setitem__(name, v) if a.kwarg_only else args.append(v))
    return [[tuple(args), kwargs]]


def samples(name: str, op) -> list:
    """The valid argument sets of ``name``, each with every flag the schema defaults spelled out
    (as a keyword, at its default), so the mutations flip every flag of every op."""
    return [_with_flags(op, args, kwargs) for args, kwargs in (SAMPLES.get(name) or derived(op))]


def _with_flags(op, args, kwargs) -> list:
    kwargs = dict(kwargs)
    for position, a in enumerate(op._schema.arguments):
        if (str(a.type) == "bool" and a.has_default_value() and position >= len(args)
                and a.name not in kwargs and isinstance(a.default_value, bool)):
            kwargs[a.name] = a.default_value
    return [args, kwargs]


# ------------------------------------------------------------------ mutations
_OTHER_DTYPES = ("float64", "int64", "bool", "bfloat16", "int32")
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1
#: what an int argument is replaced by: small, negative, huge and the int64 extremes
_INTS = (-1, -7, 1 << 40, 5, 0, 1, _INT64_MIN, _INT64_MAX)
_FLOATS = (float("nan"), float("inf"), float("-inf"), 0.0, -1.0, 1e30)
#: what a string argument is replaced by (reduction and rounding modes, and one no kernel knows)
_STRINGS = ("trunc", "floor", "sum", "mean", "none", "max", "nonsense")


def _tensor_mutations(r: T, other: T | None) -> list:
    out = []
    shape = r.shape
    out.append(("one_element", dataclasses.replace(r, shape=(1,), stride=None, offset=0, storage=None)))
    out.append(("zero_dim", dataclasses.replace(r, shape=(), stride=None, offset=0, storage=None)))
    if shape:
        out.append(("last_dim+1", dataclasses.replace(r, shape=shape[:-1] + (shape[-1] + 1,), stride=None)))
        out.append(("first_dim+3", dataclasses.replace(r, shape=(shape[0] + 3,) + shape[1:], stride=None)))
        out.append(("stride0", dataclasses.replace(r, stride=(0,) * len(shape), offset=0, storage=None)))
        out.append(("noncontiguous", dataclasses.replace(r, stride=tuple(2 * s for s in r.strides()))))
        out.append(("transposed_layout", dataclasses.replace(
            r, stride=tuple(reversed([s for s in T(tuple(reversed(shape))).strides()])))))
        out.append(("drop_dim", dataclasses.replace(r, shape=shape[1:], stride=None)))
        out.append(("huge_view", dataclasses.replace(r, shape=(1 << 22,) + shape, stride=(0,) + r.strides())))
        out.append(("empty", dataclasses.replace(r, shape=(0,) + shape[1:], stride=None)))
        for k in range(1, len(shape)):  # a zero size in every dimension, not only the first
            out.append((f"empty_dim{k}", dataclasses.replace(r, shape=shape[:k] + (0,) + shape[k + 1:], stride=None)))
    out.append(("extra_dim", dataclasses.replace(r, shape=(2,) + shape, stride=None)))
    for d in _OTHER_DTYPES:
        if d != r.dtype:
            fill = ("int", 0, 2) if d in ("int64", "int32") else "bool" if d == "bool" else "randn"
            out.append((f"dtype_{d}", dataclasses.replace(r, dtype=d, fill=fill)))
    if r.dtype in ("int64", "int32", "uint8") or isinstance(r.fill, tuple) and r.fill[0] == "int":
        n = max(r.elements(), 1)
        for v in (-1, -(1 << 30), 1 << 30, n, 1 << 16, 0):
            out.append((f"index_value_{v}", dataclasses.replace(r, fill=("const", v))))
        if r.dtype in ("int64", "int32"):  # the integer's extremes (INT_MIN / -1 traps in x86 division)
            info = torch.iinfo(getattr(torch, r.dtype))
            out.append(("int_min_values", dataclasses.replace(r, fill=("const", info.min))))
            out.append(("int_max_values", dataclasses.replace(r, fill=("const", info.max))))
    elif r.dtype not in ("bool",):  # floating: values no kernel should index or size anything by
        for label, v in (("nan", float("nan")), ("inf", float("inf")), ("neg_inf", float("-inf"))):
            out.append((f"{label}_values", dataclasses.replace(r, fill=("const", v))))
    if other is not None:  # alias: the same memory as another tensor argument
        out.append(("alias_identical", dataclasses.replace(other, storage=900)))
        out.append(("alias_shifted", dataclasses.replace(other, storage=900, offset=1)))
    return out


def _set(args, path, value):
    if not path:
        return value
    k, rest = path[0], path[1:]
    if isinstance(args, dict):
        out = dict(args)
        out[k] = _set(args[k], rest, value)
        return out
    out = list(args)
    out[k] = _set(args[k], rest, value)
    return tuple(out) if isinstance(args, tuple) else out


def _paths(v, path=()):
    """(path, value) for every leaf and list in ``v``."""
    if isinstance(v, dict):
        for k, x in v.items():
            yield from _paths(x, path + (k,))
    elif isinstance(v, (list, tuple)):
        if path:
            yield path, v
        for k, x in enumerate(v):
            yield from _paths(x, path + (k,))
    else:
        yield path, v


def _alias_into(args, path, target: T):
    """Put the aliased target recipe at ``path`` and give the tensor it copies the same storage."""
    return _set(args, path, target)


def mutations(base) -> list:
    """(label, [args, kwargs]) broken versions of one valid set."""
    out = []
    tensors = [(p, v) for p, v in _paths(base) if isinstance(v, T)]
    for p, r in tensors:
        other = next((v for q, v in tensors if q != p), None)
        for label, m in _tensor_mutations(r, other):
            mutated = _set(base, p, m)
            if label.startswith("alias") and other is not None:
                q = next(q for q, v in tensors if q != p)
                mutated = _set(mutated, q, dataclasses.replace(other, storage=900))
            out.append((f"{'.'.join(map(str, p))}:{label}", mutated))
    out += _resized_everywhere(base, tensors)
    for p, v in _paths(base):
        where = '.'.join(map(str, p))
        if isinstance(v, bool):  # every flag flipped (and each entry of a mask: its leaves come here too)
            out.append((f"{where}:flip", _set(base, p, not v)))
            continue
        if v is None or isinstance(v, T):
            continue
        if isinstance(v, int):
            for w in _INTS:
                if w != v:
                    out.append((f"{where}:int_{w}", _set(base, p, w)))
        elif isinstance(v, float):
            for w in _FLOATS:
                out.append((f"{where}:float_{w}", _set(base, p, w)))
        elif isinstance(v, str):
            for w in _STRINGS:
                if w != v:
                    out.append((f"{where}:str_{w}", _set(base, p, w)))
        elif isinstance(v, (list, tuple)) and v and all(isinstance(x, int) and not isinstance(x, bool) for x in v):
            for label, w in (("huge", [1 << 40] * len(v)), ("negative", [-3] * len(v)), ("short", list(v[:-1])),
                             ("long", list(v) + [1]), ("zeros", [0] * len(v)), ("minus_one", [-1] * len(v)),
                             ("int_min", [_INT64_MIN] * len(v))):
                out.append((f"{where}:ints_{label}", _set(base, p, w)))
        elif isinstance(v, (list, tuple)) and v and any(isinstance(x, T) for x in v):
            out.append((f"{'.'.join(map(str, p))}:list_short", _set(base, p, list(v[:-1]))))
            out.append((f"{'.'.join(map(str, p))}:list_dup", _set(base, p, [v[0], v[0]] + list(v[2:]))))
    return out


def _resized_everywhere(base, tensors: list) -> list:
    """A size changed consistently: every dimension of every tensor that has size ``n``, and every
    int argument equal to ``n``, set to 0 (then to 1). Zeroing one tensor alone mostly breaks the
    relations a contract checks; a sequence length of 0 in query, key and value alike is what
    crashed CPU flash attention."""
    sizes = sorted({n for _, r in tensors for n in r.shape if n > 1})
    out = []
    for n in sizes:
        for new in (0, 1):
            def resize(v, n=n, new=new):
                if isinstance(v, T):
                    if n not in v.shape or v.storage is not None:
                        return v
                    return dataclasses.replace(v, shape=tuple(new if d == n else d for d in v.shape), stride=None,
                                               offset=0)
                if isinstance(v, bool) or not isinstance(v, (int, list, tuple, dict)):
                    return v
                if isinstance(v, int):
                    return new if v == n else v
                if isinstance(v, dict):
                    return {k: resize(x) for k, x in v.items()}
                return type(v)(resize(x) for x in v)
            out.append((f"*:size_{n}_to_{new}", resize(base)))
    return out


#: What ``pair_mutations`` combines with a zero size elsewhere: layouts and dtypes that send a
#: kernel down another path, and flipped flags.
_PAIR_SECOND = ("transposed_layout", "noncontiguous", "stride0", "dtype_float64", "dtype_bfloat16")


def pair_mutations(base) -> list:
    """(label, [args, kwargs]) with two arguments broken at once: a zero size in one tensor, and
    another tensor's layout or dtype, or a flag, changed. Single mutations miss kernels whose
    slow path fails on an empty argument the fast path handles (``_embedding_bag`` with a
    transposed weight and no offsets crashed; each alone ran)."""
    tensors = [(p, v) for p, v in _paths(base) if isinstance(v, T)]
    empties, seconds = [], []
    for p, r in tensors:
        for label, m in _tensor_mutations(r, None):
            if label.startswith("empty"):
                empties.append((p, label, m))
            elif label in _PAIR_SECOND:
                seconds.append((p, label, m))
    seconds += [(p, "flip", not v) for p, v in _paths(base) if isinstance(v, bool)]
    out = []
    for p1, l1, m1 in empties:
        for p2, l2, m2 in seconds:
            if p2 != p1:
                label = f"{'.'.join(map(str, p1))}:{l1}+{'.'.join(map(str, p2))}:{l2}"
                out.append((label, _set(_set(base, p1, m1), p2, m2)))
    for label, resized in _resized_everywhere(base, tensors):  # a size 0 everywhere, and a layout or flag
        if not label.endswith("_to_0"):
            continue
        for p, r in ((p, v) for p, v in _paths(resized) if isinstance(v, T)):
            for l2, m in _tensor_mutations(r, None):
                if l2 in _PAIR_SECOND:
                    out.append((f"{label}+{'.'.join(map(str, p))}:{l2}", _set(resized, p, m)))
        for p, v in _paths(resized):
            if isinstance(v, bool):
                out.append((f"{label}+{'.'.join(map(str, p))}:flip", _set(resized, p, not v)))
    return out


# ------------------------------------------------------------------ the check (parent, meta)
def check(name: str, args, kwargs, limit: int) -> str | None:
    """None if the load-time check accepts the call, else why it refused it."""
    return checked(name, args, kwargs, limit)[0]


def checked(name: str, args, kwargs, limit: int, device: str = "cpu") -> tuple[str | None, Any]:
    """(None, the ``describe`` of what the load-time check derives for ``device``: the meta result,
    corrected where that device's kernel is known to differ, ``format/device_results.py``) if the
    check accepts the call, else (why, None)."""
    from spmd_aot.format.device_results import corrected
    from spmd_aot.format.serialize import DecodedNode, resolve_target
    from spmd_aot.format.validate import check_node

    op = resolve_target(name)
    margs, mkwargs = materialize(args, kwargs, "meta")
    node = DecodedNode("call_function", "fuzz", op, tuple(margs), dict(mkwargs))
    try:
        value = corrected(device, op, tuple(margs), dict(mkwargs), check_node(node, tuple(margs), dict(mkwargs), limit))
    except Exception as exc:  # noqa: BLE001 - every refusal counts
        return f"{type(exc).__name__}: {str(exc)[:200]}", None
    return None, describe(value)


def describe(value) -> Any:
    """What is compared between the meta and the real result: each tensor's shape and dtype."""
    if isinstance(value, torch.Tensor):
        return (tuple(value.shape), str(value.dtype).removeprefix("torch."))
    if isinstance(value, (list, tuple)):
        return [describe(v) for v in value]
    return None


# ------------------------------------------------------------------ the heap checker
MALLOC_DEBUG = "libc_malloc_debug.so.0"
NO_CHECKER = 87  # a child's exit status when the heap checker is not loaded


def checker_env(env: dict) -> dict:
    """``env`` with glibc's heap checker on: ``MALLOC_CHECK_=3`` and, on glibc 2.34+, the
    library that implements it preloaded (without it the variable is ignored)."""
    env = dict(env, MALLOC_CHECK_="3")
    if ctypes.util.find_library("c_malloc_debug"):  # glibc 2.34+: the checker lives in its own library
        env["LD_PRELOAD"] = " ".join(p for p in (MALLOC_DEBUG, env.get("LD_PRELOAD", "")) if p)
    return env


#: One byte written past a tensor's storage, then the storage freed: glibc's heap checker aborts
#: the process at the free (SIGABRT); without the checker the byte lands in padding unnoticed.
_OVERFLOW = ("import ctypes, torch; t = torch.empty(1000, dtype=torch.uint8); "
             "ctypes.memset(t.data_ptr(), 7, 1001); del t")


def checker_catches_overflow(env: dict | None = None) -> bool:
    """Whether a child started with ``env`` (default: the children's) dies on a one-byte heap
    overflow past a tensor's storage: the checker is not only mapped but catches what we look for."""
    env = env if env is not None else checker_env(dict(os.environ))
    run = subprocess.run([sys.executable, "-c", _OVERFLOW], env=env, capture_output=True, timeout=120)
    return run.returncode not in (0, 1)


def checker_loaded() -> bool:
    """Whether this process's heap allocations are checked: ``MALLOC_CHECK_`` set and, where
    glibc keeps the checker in ``libc_malloc_debug``, that library mapped into this process."""
    if os.environ.get("MALLOC_CHECK_") != "3":
        return False
    if not ctypes.util.find_library("c_malloc_debug"):
        return True  # glibc before 2.34: the checker is part of libc itself
    with open("/proc/self/maps") as f:
        return "libc_malloc_debug" in f.read()


# ------------------------------------------------------------------ the child (real runs)
def child(case_file: str, start: int, progress: str, device: str = "cpu") -> None:
    """Run cases from ``start`` on ``device``. A CUDA error (an illegal access, a device-side
    assert) leaves the process's CUDA context unusable: the child reports it on stderr and exits
    at once, so the parent records that case as a crash and starts a new child after it."""
    import faulthandler

    faulthandler.enable()
    import torch.distributed as dist

    from spmd_aot.format.contracts import VALUE_CHECKS
    from spmd_aot.format.serialize import resolve_target

    if not checker_loaded():
        print(f"the heap checker is not loaded (MALLOC_CHECK_=3 with LD_PRELOAD={MALLOC_DEBUG}): "
              f"/proc/self/maps has no libc_malloc_debug", file=sys.stderr, flush=True)
        os._exit(NO_CHECKER)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    group = dist.group.WORLD.group_name
    with open(case_file, "rb") as f:
        cases = pickle.load(f)
    with open(progress, "a", buffering=1) as log:
        for i in range(start, len(cases)):
            name, label, (args, kwargs), expected = cases[i]
            log.write(f"S {i}\n")
            outcome = "ok"
            try:
                op = resolve_target(name)
                rargs, rkwargs = materialize(args, kwargs, device, group)
                if "device" in rkwargs:
                    rkwargs["device"] = None if device == "cpu" else torch.device(device)
                check_values = VALUE_CHECKS.get(name)
                if check_values:
                    check_values(tuple(rargs), dict(rkwargs))
                result = op(*rargs, **rkwargs)
                if name.startswith("_c10d_functional") and isinstance(result, torch.Tensor):
                    torch.ops._c10d_functional.wait_tensor(result)
                if device == "cuda":
                    torch.cuda.synchronize()  # kernels are asynchronous: their faults surface here
                real = describe(result)
                if real != expected:
                    log.write(f"D {i} {json.dumps([expected, real])}\n")
            except Exception as exc:  # noqa: BLE001 - a Python error is a safe refusal
                if device == "cuda" and _is_cuda_fault(exc):
                    print(f"CUDA fault: {str(exc).strip().splitlines()[0][:300]}", file=sys.stderr, flush=True)
                    os._exit(86)
                outcome = "raised"
            log.write(f"E {i} {outcome}\n")
    dist.destroy_process_group()


def _is_cuda_fault(exc: Exception) -> bool:
    """An error of the device, not of the arguments: after one, the CUDA context is unusable."""
    text = str(exc)
    return isinstance(exc, getattr(torch, "AcceleratorError", ())) or any(
        s in text for s in ("CUDA error", "illegal memory access", "device-side assert", "misaligned address",
                            "unspecified launch failure", "CUBLAS_STATUS_EXECUTION_FAILED"))


def run_children(cases: list, timeout: float, verbose: bool, device: str = "cpu",
                 deadline: float = float("inf")) -> dict:
    """Run ``cases`` in child processes; restart after a crash or hang from the next case. No
    child starts after ``deadline`` (``time.monotonic``): the cases left are counted as not run."""
    stats = {"ok": 0, "raised": 0, "crashes": [], "not_run": 0, "divergences": []}
    with tempfile.TemporaryDirectory() as tmp:
        case_file, progress = os.path.join(tmp, "cases.pkl"), os.path.join(tmp, "progress")
        with open(case_file, "wb") as f:
            pickle.dump(cases, f)
        start = 0
        env = checker_env(dict(os.environ, PYTHONFAULTHANDLER="1", OMP_NUM_THREADS="1"))
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout
        env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
        while start < len(cases):
            if time.monotonic() > deadline:
                stats["not_run"] = len(cases) - start
                break
            open(progress, "w").close()
            proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child", case_file, str(start),
                                     progress, "--device", device], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            last, since, hung = -1, time.monotonic(), False
            while proc.poll() is None:
                time.sleep(0.05)
                lines = open(progress).read().split("\n")
                started = [int(x.split()[1]) for x in lines if x.startswith("S ")]
                if started and started[-1] != last:
                    last, since = started[-1], time.monotonic()
                elif time.monotonic() - since > timeout:
                    proc.kill()
                    hung = True
            err = proc.stderr.read().decode(errors="replace")
            if proc.returncode == NO_CHECKER:
                raise RuntimeError(f"fuzz child ran without glibc's heap checker: {err.strip()[-300:]}")
            lines = open(progress).read().split("\n")
            for x in lines:
                if x.startswith("D "):
                    _, i, pair = x.split(" ", 2)
                    meta, real = json.loads(pair)
                    name, label = cases[int(i)][:2]
                    stats["divergences"].append((name, label, meta, real))
            ended = {}
            for x in lines:
                if x.startswith("E "):
                    _, i, outcome = x.split()
                    ended[int(i)] = outcome
            for outcome in ended.values():
                stats[outcome] += 1
            started = [int(x.split()[1]) for x in lines if x.startswith("S ")]
            if proc.returncode == 0 and not hung:
                break
            bad = started[-1] if started else start
            if bad in ended:  # died after its last case (teardown): not a case's crash
                bad = None
            if bad is not None:
                name, label = cases[bad][:2]
                why = "hang" if hung else f"exit {proc.returncode}"
                stats["crashes"].append((name, label, why, err.strip().splitlines()[-3:] if err else []))
                if verbose:
                    print(f"CRASH {name} {label}: {why}", file=sys.stderr)
                start = bad + 1
            else:
                start = (max(ended) + 1) if ended else start + 1
    return stats


def allowed_ops() -> list[str]:
    """The overloads of the list this torch release uses (``allowlist.choose_list``), read now:
    the list may have grown since import."""
    from spmd_aot.format.allowlist import _parse, chosen_list
    return sorted(_parse(chosen_list().path.read_text())[1])


#: Ops a review or a fuzz run found crashing or diverging: every slice (CI's) fuzzes them.
REVIEW_OPS = ("aten::_fused_adam_.default", "aten::_fused_adamw_.tensor_lr", "aten::_fused_sgd_.default",
              "aten::native_layer_norm_backward.default", "aten::native_batch_norm.default",
              "aten::max_pool2d_with_indices_backward.default", "aten::embedding_dense_backward.default",
              "aten::div.Tensor_mode", "aten::div.Scalar_mode", "aten::_embedding_bag.default",
              "aten::_scaled_dot_product_flash_attention_for_cpu.default",
              "aten::_scaled_dot_product_flash_attention_for_cpu_backward.default",
              "aten::_adaptive_avg_pool2d_backward.default", "aten::native_batch_norm_backward.default",
              "aten::_native_batch_norm_legit.no_stats", "aten::_native_batch_norm_legit_no_training.default",
              "aten::convolution_backward.default", "aten::threshold_backward.default",
              "aten::mse_loss_backward.default", "aten::native_dropout.default",
              "aten::native_dropout_backward.default")


def fuzz(ops: list[str], *, timeout: float = 20.0, verbose: bool = False, limit: int = 16 << 20,
         device: str = "cpu", deadline: float = float("inf"), pairs: bool = False) -> dict:
    """Generate, check and run; returns the figures (and the cases behind any failure): per op,
    the crashes and the results whose shape or dtype differ from the meta kernel's. ``pairs``:
    ``pair_mutations`` too (about twice the argument sets)."""
    from spmd_aot.format.serialize import resolve_target

    tried = refused = 0
    accepted: list = []
    bad_samples = []
    for name in ops:
        op = resolve_target(name)
        for base in samples(name, op):
            why, expected = checked(name, base[0], base[1], limit, device)
            if why is not None:
                bad_samples.append((name, why))
                if verbose:
                    print(f"SAMPLE REFUSED {name}: {why}", file=sys.stderr)
            else:
                accepted.append((name, "valid", base, expected))
            tried += 1
            for label, (args, kwargs) in mutations(base) + (pair_mutations(base) if pairs else []):
                tried += 1
                why, expected = checked(name, args, kwargs, limit, device)
                if why is None:
                    accepted.append((name, label, [args, kwargs], expected))
                else:
                    refused += 1
        for label, (args, kwargs) in EDGES.get(name, ()):
            tried += 1
            why, expected = checked(name, args, kwargs, limit, device)
            if why is None:
                accepted.append((name, f"edge:{label}", [args, kwargs], expected))
            else:
                refused += 1
                if verbose:
                    print(f"EDGE REFUSED {name} {label}: {why}", file=sys.stderr)
    stats = run_children(accepted, timeout, verbose, device, deadline)
    by_op: dict[str, dict] = {}
    for name, *_ in accepted:
        by_op.setdefault(name, {"run": 0, "crashes": 0, "divergences": 0})["run"] += 1
    for name, *_ in stats["crashes"]:
        by_op[name]["crashes"] += 1
    for name, *_ in stats["divergences"]:
        by_op[name]["divergences"] += 1
    return {"ops": len(ops), "tried": tried, "refused": refused + len(bad_samples), "run": len(accepted),
            "run_ok": stats["ok"], "run_raised": stats["raised"], "crashes": stats["crashes"],
            "not_run": stats["not_run"], "divergences": stats["divergences"], "by_op": by_op,
            "valid_samples_refused": bad_samples}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    p.add_argument("--slice", type=int, default=1, help="fuzz every Nth op (plus the review's crash ops)")
    p.add_argument("--op", action="append", help="fuzz only these overloads")
    p.add_argument("--timeout", type=float, default=20.0, help="seconds one case may run")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="where accepted cases run (cuda: the kernels a CUDA artifact calls)")
    p.add_argument("--budget-seconds", type=float, default=float("inf"),
                   help="start no child after this long; the cases left are reported as not run")
    p.add_argument("--no-pairs", dest="pairs", action="store_false",
                   help="break one argument at a time only (by default also two at once: a zero size with a "
                        "layout, dtype or flag change)")
    p.add_argument("-v", "--verbose", action="store_true")
    a = p.parse_args(argv)
    if a.child:
        child(a.child[0], int(a.child[1]), a.child[2], a.device)
        return 0
    if a.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no CUDA device visible", file=sys.stderr)
        return 2
    if not checker_catches_overflow():
        print("glibc's heap checker does not catch a one-byte overflow past a tensor's storage in a child "
              f"(MALLOC_CHECK_=3, LD_PRELOAD={MALLOC_DEBUG}): no run of this fuzzer could see heap corruption",
              file=sys.stderr)
        return 2
    from spmd_aot.format.allowlist import chosen_list
    print(f"# allowlist: {chosen_list().describe()}; torch {torch.__version__}; accepted cases run on {a.device}")
    ops = allowed_ops()
    if a.op:
        ops = [o for o in ops if o in a.op]
    elif a.slice > 1:
        ops = sorted(set(ops[::a.slice]) | (set(REVIEW_OPS) & set(ops)))
    start = time.monotonic()
    r = fuzz(ops, timeout=a.timeout, verbose=a.verbose, device=a.device, deadline=start + a.budget_seconds,
             pairs=a.pairs)
    print(f"ops {r['ops']}, argument sets {r['tried']}, refused {r['refused']}, accepted and run {r['run']} "
          f"({r['run_ok']} returned, {r['run_raised']} raised), crashes {len(r['crashes'])}, "
          f"valid samples refused {len(r['valid_samples_refused'])}, not run (budget) {r['not_run']} "
          f"({time.monotonic() - start:.0f} s)")
    print(f"heap checker: MALLOC_CHECK_=3 + {MALLOC_DEBUG} (mapped in every child; caught a 1-byte overflow "
          "past a tensor's storage before the run); "
          f"meta/real result divergences {len(r['divergences'])}")
    for c in r["crashes"]:
        print("CRASH", *c)
    for name, label, meta, real in r["divergences"]:
        print("DIVERGES", name, label, "meta", meta, "real", real)
    for name, counts in sorted(r["by_op"].items()):
        if counts["crashes"] or counts["divergences"] or a.verbose:
            print(f"op {name}: run {counts['run']}, crashes {counts['crashes']}, divergences {counts['divergences']}")
    for name, why in r["valid_samples_refused"]:
        print("VALID SAMPLE REFUSED", name, why)
    return 1 if r["crashes"] or r["divergences"] else 0


if __name__ == "__main__":
    # One recipe class whoever pickled the cases: a parent that imported this file as ``fuzz_ops``
    # (the tests) pickles ``fuzz_ops.T``, which must unpickle as this process's ``T``, or no case
    # would materialize and every one would merely raise.
    sys.modules.setdefault("fuzz_ops", sys.modules[__name__])
    sys.exit(main())

"""Collectives the compiled library can call without Inductor's Python: ``spmd_aot::all_gather``,
``spmd_aot::reduce_scatter`` and ``spmd_aot::all_to_all``, thin operators over ``_c10d_functional``'s.

Why: in torch 2.13 Inductor's C++ wrapper calls ``_c10d_functional.all_reduce`` and
``wait_tensor`` through C shims, but ``all_gather_into_tensor``, ``reduce_scatter_tensor`` and
``all_to_all_single`` (expert parallel's token exchange) have none, and their ``group_name`` is
typed ``Any`` (a name or a process group), which the wrapper can neither box for the dispatcher
nor hand to its Python fallback ("arg type Any is not yet supported by custom_op_wrapper"; that
fallback would import ``torch._inductor`` at run time anyway). The same operations declared with
``str group_name`` are called by the library through the dispatcher (boxed, no import); their
kernel calls the functional collective and waits for it.

Why they wait: to Inductor they are opaque extern calls, finished when they return, so it reuses
or frees their input buffer right after (a 4-layer LM at world 2 lost 0.4 of its loss that way
when the collective was left in flight for the graph's ``wait_tensor``); waiting inside makes
that true, and the graph's ``wait_tensor`` then finds nothing in flight. The cost is overlap:
the library issues each all-gather, reduce-scatter and all-to-all synchronously. Defining them imports nothing
beyond ``torch.library``; both the build (``building/kernels.py``, which rewrites the graph it
compiles to them) and a load (``runtime/kernel_load.py``) import this module.
"""

from __future__ import annotations

import torch

__all__ = ["REWRITES"]

_LIB = torch.library.Library("spmd_aot", "DEF")
_LIB.define("all_gather(Tensor input, int group_size, str group_name) -> Tensor")
_LIB.define("reduce_scatter(Tensor input, str reduce_op, int group_size, str group_name) -> Tensor")
_LIB.define("all_to_all(Tensor input, SymInt[] output_split_sizes, SymInt[] input_split_sizes, str group_name) "
            "-> Tensor")


def _all_gather(input, group_size, group_name):
    out = torch.ops._c10d_functional.all_gather_into_tensor(input, group_size, group_name)
    return torch.ops._c10d_functional.wait_tensor(out)


def _reduce_scatter(input, reduce_op, group_size, group_name):
    out = torch.ops._c10d_functional.reduce_scatter_tensor(input, reduce_op, group_size, group_name)
    return torch.ops._c10d_functional.wait_tensor(out)


def _all_to_all(input, output_split_sizes, input_split_sizes, group_name):
    out = torch.ops._c10d_functional.all_to_all_single(input, output_split_sizes, input_split_sizes, group_name)
    return torch.ops._c10d_functional.wait_tensor(out)


def _all_gather_meta(input, group_size, group_name):
    return input.new_empty((input.shape[0] * group_size, *input.shape[1:]))


def _reduce_scatter_meta(input, reduce_op, group_size, group_name):
    return input.new_empty((input.shape[0] // group_size, *input.shape[1:]))


def _all_to_all_meta(input, output_split_sizes, input_split_sizes, group_name):
    rows = sum(output_split_sizes) if output_split_sizes else input.shape[0]  # none given: equal splits
    return input.new_empty((rows, *input.shape[1:]))


_LIB.impl("all_gather", _all_gather, "CompositeExplicitAutograd")
_LIB.impl("all_to_all", _all_to_all, "CompositeExplicitAutograd")
_LIB.impl("all_to_all", _all_to_all_meta, "Meta")
_LIB.impl("reduce_scatter", _reduce_scatter, "CompositeExplicitAutograd")
_LIB.impl("all_gather", _all_gather_meta, "Meta")
_LIB.impl("reduce_scatter", _reduce_scatter_meta, "Meta")

#: The functional collectives the build rewrites to the operators above, same arguments.
REWRITES = {
    torch.ops._c10d_functional.all_gather_into_tensor.default: torch.ops.spmd_aot.all_gather.default,
    torch.ops._c10d_functional.reduce_scatter_tensor.default: torch.ops.spmd_aot.reduce_scatter.default,
    torch.ops._c10d_functional.all_to_all_single.default: torch.ops.spmd_aot.all_to_all.default,
}

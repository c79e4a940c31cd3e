"""Run the user's factories (model, optimizer, batch) on fake tensors as they run on real ones.

Two things real factories do break under a bare ``FakeTensorMode``:

**Changing dtype or device** (``model.to(torch.bfloat16)``, ``.double()``, ``.half()``,
``.to("cuda")``). ``nn.Module._apply`` always swaps a fake parameter with its converted copy
(``torch.utils.swap_tensors``), and the swap refuses tensors that have weak references. Fake
tensors made under ``FakeTensorMode`` are weakly held by the mode's converter memos (caches
from a source tensor to its fake, which only save work), so every conversion failed with
"Couldn't swap ... Cannot swap t1 because it has weakref associated with it". While
``convertible_fakes()`` is active, a swap first drops the two tensors' entries from those
weak-value caches, then swaps: the parameter object is kept (optimizers and tied weights still
see it) and holds the converted fake, as on real tensors.

**Reading a value while initializing.** ``nn.init.trunc_normal_`` (ViT, most vision models)
loops ``while mask.any()``: a fake tensor has no values, so ``bool()`` of it raised
``DataDependentOutputException``. In a factory, ``valueless_scalars()`` answers such a read
with zero (``False``, ``0``, ``0.0``: a rejection loop then ends). This is safe for the cache:
parameter values are never part of the graph, and whatever structure a factory builds is in the
key, which the job computes again from its real model, so a factory that branched differently
on real values misses; it never loads a wrong graph. Tracing the step keeps the strict rule.

**Copying a module** (``copy.deepcopy(model)`` for an EMA, teacher or frozen reference). A
fake tensor's deepcopy clones it (in the active mode) and then deep-copies its ``__dict__``,
which holds its ``fake_mode``: the copy's parameters belonged to a *second* ``FakeTensorMode``,
and tracing failed with "fake mode ... from fake tensor input 0 doesn't match mode". While
``shared_fake_mode()`` is active a ``FakeTensorMode`` deep-copies to itself (a mode is the
context tensors live in, not data), so the copy's parameters are fakes of the factory's mode.
"""

from __future__ import annotations

import contextlib
import weakref

import torch
import torch.utils._python_dispatch

__all__ = ["fake_factories", "convertible_fakes", "valueless_scalars", "shared_fake_mode"]


def _forget_weak_entries(t: torch.Tensor) -> None:
    """Remove ``t`` from every ``WeakValueDictionary`` that holds it (its only weak refs)."""
    refs = weakref.getweakrefs(t)
    while refs:  # pop each: a ref still held here would itself keep a weak reference alive
        ref = refs.pop()
        callback = ref.__callback__  # WeakValueDictionary's remover: its default arg is the dict
        owner = callback.__defaults__[0]() if callback is not None and callback.__defaults__ else None
        if isinstance(owner, weakref.WeakValueDictionary) and owner.data.get(ref.key) is ref:
            del owner.data[ref.key]
        ref = owner = callback = None


@contextlib.contextmanager
def convertible_fakes():
    """Within it, ``Module._apply`` can convert fake parameters (see the module docstring)."""
    from torch._subclasses.fake_tensor import FakeTensor

    original = torch.utils.swap_tensors

    def swap_tensors(t1, t2):
        if isinstance(t1, FakeTensor) and isinstance(t2, FakeTensor):
            _forget_weak_entries(t1)
            _forget_weak_entries(t2)
        return original(t1, t2)

    torch.utils.swap_tensors = swap_tensors
    try:
        yield
    finally:
        torch.utils.swap_tensors = original


class valueless_scalars(torch.utils._python_dispatch.TorchDispatchMode):
    """Above ``FakeTensorMode``: a scalar read of a fake tensor with no known value is zero."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch._subclasses.fake_tensor import DataDependentOutputException

        try:
            return func(*args, **(kwargs or {}))
        except DataDependentOutputException:
            if func is not torch.ops.aten._local_scalar_dense.default:
                raise
            dtype = args[0].dtype
            return False if dtype == torch.bool else 0.0 if dtype.is_floating_point or dtype.is_complex else 0


@contextlib.contextmanager
def shared_fake_mode():
    """Within it, deep-copying a fake tensor keeps its ``FakeTensorMode`` (module docstring)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    saved = FakeTensorMode.__dict__.get("__deepcopy__")  # None: the class defines none
    FakeTensorMode.__deepcopy__ = lambda self, memo: self
    try:
        yield
    finally:
        if saved is not None:
            FakeTensorMode.__deepcopy__ = saved
        else:
            del FakeTensorMode.__deepcopy__


@contextlib.contextmanager
def fake_factories(fake_mode):
    """Run factories under ``fake_mode`` with the allowances above."""
    with fake_mode, convertible_fakes(), valueless_scalars(), shared_fake_mode():
        yield

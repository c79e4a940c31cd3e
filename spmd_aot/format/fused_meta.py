"""Meta kernels for the fused optimizer steps: the strict argument contract, and nothing else.

Why: a FakeTensor op without a meta kernel runs for real (FakeTensor's "unsafe fallback"): it
makes a real tensor of every fake argument's size and computes on them. The step is traced
with the learning rate as a tensor (a graph input), and torch 2.13 has meta kernels for
``_fused_adam(w)_`` with a float learning rate only: so tracing a fused AdamW step over a
70B-shaped model's fake parameters allocated their real bytes (four fake 1 GiB tensors: 16 GiB
and 28 s). These steps update their tensor lists in place and create nothing, so a meta kernel
only has to check the arguments. Torch's own meta kernels for the ``.default`` overloads accept
1-element state tensors and stride-0 parameters that the CPU kernel then indexes out of bounds,
so the load-time check (``validate.py``) uses ``standin`` for every overload in ``FUSED_STEPS``,
and tracing registers it where torch has none (``registered``). Both check
``contracts.fused_step``: the lists line up, every state tensor has its parameter's exact shape,
dtype and contiguity, counters and scalars hold one value.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator

import torch

from .contracts import check_call

__all__ = ["FUSED_STEPS", "standin", "registered"]

_aten = torch.ops.aten
FUSED_STEPS = (_aten._fused_adamw_.tensor_lr, _aten._fused_adamw_.default,
               _aten._fused_adam_.tensor_lr, _aten._fused_adam_.default,
               _aten._fused_sgd_.tensor_lr, _aten._fused_sgd_.default)


@functools.cache
def standin(op) -> Callable[..., None]:
    """A meta kernel for fused step ``op``: raises ``contracts.Broken`` (a ValueError) when the
    arguments break the contract, else returns nothing (the step only writes in place)."""
    def check(*args, **kwargs) -> None:
        check_call(op, args, kwargs)
    check.__name__ = f"{op._schema.name.split('::')[1]}_meta"
    return check


_lock = threading.Lock()
_users = 0
_library: torch.library.Library | None = None


@contextlib.contextmanager
def registered() -> Iterator[None]:
    """``standin`` as the Meta kernel of every fused step in ``FUSED_STEPS`` that has none, for
    the duration of the block (re-entrant; removed when the last block exits, so torch is left
    as it was found)."""
    global _users, _library
    with _lock:
        if _users == 0:
            missing = [op for op in FUSED_STEPS
                       if not torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "Meta")]
            if missing:
                _library = torch.library.Library("aten", "IMPL")
                for op in missing:
                    _library.impl(op.name().split("::", 1)[1], standin(op), "Meta")
        _users += 1
    try:
        yield
    finally:
        with _lock:
            _users -= 1
            if _users == 0 and _library is not None:
                _library._destroy()
                _library = None

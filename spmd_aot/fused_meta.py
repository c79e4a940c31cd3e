"""Meta kernels for the fused optimizer steps torch has none for.

Why: a FakeTensor op without a meta kernel runs for real (FakeTensor's "unsafe fallback"): it
makes a real tensor of every fake argument's size and computes on them. The step is traced
with the learning rate as a tensor (a graph input), and torch 2.13 has meta kernels for
``_fused_adam(w)_`` with a float learning rate only: so tracing a fused AdamW step over a
70B-shaped model's fake parameters allocated their real bytes (four fake 1 GiB tensors: 16 GiB
and 28 s). These steps update their tensor lists in place and create nothing, so a meta kernel
only has to check that the lists line up: ``check_lists``, used while tracing (``registered``)
and by the load-time check of a stored graph (``validate.py``).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator

import torch

__all__ = ["FUSED_STEPS", "check_lists", "registered"]

_aten = torch.ops.aten
FUSED_STEPS = (_aten._fused_adamw_.tensor_lr, _aten._fused_adam_.tensor_lr,
               _aten._fused_sgd_.tensor_lr, _aten._fused_sgd_.default)


def check_lists(*args, **kwargs) -> None:
    """What a fused step needs of its arguments' metadata: parallel tensor lists (the first is
    the parameters; the others as long, or empty), each state tensor shaped as its parameter
    or a single value (a step counter), scalar arguments single values."""
    lists = [a for a in args if isinstance(a, (list, tuple))]
    params = lists[0]
    for other in lists[1:]:
        if len(other) not in (0, len(params)):
            raise ValueError(f"tensor lists of lengths {len(params)} and {len(other)}")
        for p, t in zip(params, other):
            if not isinstance(t, torch.Tensor) or (t.shape != p.shape and t.numel() != 1):
                raise ValueError(f"a state tensor of shape {getattr(t, 'shape', t)} for a parameter "
                                 f"of shape {tuple(p.shape)}")
    for value in kwargs.values():
        if isinstance(value, torch.Tensor) and value.numel() != 1:
            raise ValueError(f"a scalar argument is a tensor of shape {tuple(value.shape)}")


_lock = threading.Lock()
_users = 0
_library: torch.library.Library | None = None


@contextlib.contextmanager
def registered() -> Iterator[None]:
    """``check_lists`` as the Meta kernel of every fused step in ``FUSED_STEPS`` that has none,
    for the duration of the block (re-entrant; removed when the last block exits, so torch is
    left as it was found)."""
    global _users, _library
    with _lock:
        if _users == 0:
            missing = [op for op in FUSED_STEPS
                       if not torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "Meta")]
            if missing:
                _library = torch.library.Library("aten", "IMPL")
                for op in missing:
                    _library.impl(op.name().split("::", 1)[1], check_lists, "Meta")
        _users += 1
    try:
        yield
    finally:
        with _lock:
            _users -= 1
            if _users == 0 and _library is not None:
                _library._destroy()
                _library = None

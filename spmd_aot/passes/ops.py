"""The operator sets the tracer and the passes look for, one definition each, named by purpose.

Which views a walk may look through depends on what it must keep: a gradient's origin survives
any view, a matmul's flat element order only some, and only plain reshapes fold into one.
"""

from __future__ import annotations

import torch

__all__ = ["WAIT", "is_wait", "GRADIENT_PATH_VIEWS", "FLAT_ORDER_VIEWS", "FOLDABLE_VIEWS"]

_aten = torch.ops.aten

#: Blocks until a functional collective's result is ready; it does not communicate itself.
WAIT = torch.ops._c10d_functional.wait_tensor.default


def is_wait(node) -> bool:
    """Whether an FX node waits for a functional collective."""
    return getattr(node, "target", None) is WAIT


#: What a gradient may pass through between the collective that made it and its leaf (the
#: tracer names a parameter's gradient collectives by walking back through these and waits).
GRADIENT_PATH_VIEWS = frozenset({_aten.view.default, _aten._unsafe_view.default, _aten.alias.default,
                                 _aten.reshape.default, _aten.detach.default})

#: Views behind which a matmul's output may still be read in its flat element order (the bucket
#: pass checks contiguity and offset node by node).
FLAT_ORDER_VIEWS = frozenset({_aten.view.default, _aten._unsafe_view.default, _aten.t.default,
                              _aten.transpose.int, _aten.permute.default})

#: Plain reshapes: a chain of them folds into one.
FOLDABLE_VIEWS = (_aten.view.default, _aten._unsafe_view.default)

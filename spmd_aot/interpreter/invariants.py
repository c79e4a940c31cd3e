"""Run-time invariants: every value a step reads has the metadata the load's meta check derived.

Why: a loaded graph's safety rests on the meta check (``format/validate.py``), which checks
every op's contract on the *meta* results of the ops before it. Several admitted ops give
results of another shape or dtype on CPU than on meta (``_native_batch_norm_legit_no_training``'s
saved mean/invstd are ``[C]`` on meta and ``[0]`` on CPU; ``_embedding_bag``'s offset2bag;
``mse_loss_backward`` and ``threshold_backward`` on mixed dtypes; ``native_dropout`` on an empty
input; ``native_group_norm``'s statistics on a bf16 input with fp32 weights). A crafted graph that ``cat``s
such a value gets a buffer large on meta and small on CPU,
and an op whose CPU kernel trusts its contract (a fused optimizer step) then writes past the
real buffer. Contracts proven on meta values hold for the real values only if the real values
have the same metadata.

So the interpreter checks, by induction over the step: every value some op reads (or the step
returns, or an op writing in place hands back) must have exactly the shape and dtype that the
meta check derived for it, and its strides, checked right after the op that made it and before
any op reads it. If every value an op reads matches, the op's arguments on CPU are those its
contract passed on meta. A divergence raises ``DivergedValueError`` naming the node; nothing
has read the value yet.

Strides may legitimately differ: the meta check lays every input out contiguously, and a real
batch may be a slice of a larger tensor (so everything computed from it by views has other
strides). A value whose strides differ passes if it is a plain layout as far as memory goes:
its ``numel`` elements from its first one lie inside its storage (what a kernel that assumes a
dense layout touches), unless the meta value itself overlapped (an ``expand``), whose readers'
contracts were checked on an overlapping layout already. The storage offset is not compared
either (a slice of a batch starts anywhere); a CPU view made by a kernel lies inside its
storage (the one admitted view op that takes raw sizes and strides, ``as_strided``, has a
contract that its extent fits its input's storage, and torch's CPU ``as_strided`` checks the
real storage again).

Values no op reads are not checked (a benign divergence such as eval-mode batch norm's unused
saved statistics costs nothing and breaks nothing), and neither are arguments an op is known
to ignore (``IGNORED_READS``: ``native_batch_norm_backward`` with ``train=False`` normalises
with the running statistics, never the saved ones, which are ``[0]`` on CPU in eval mode: a
model with frozen batch norm in a training step).

Why every op and not only those known to diverge: the list above comes from a fuzzer, not from
a proof, while the check is one tuple compare per value, about 0.3-0.8 us (0.3-0.45 ms a step
for the 559 values of the 4-layer, d_model 128 bench LM, whose step takes ~70 ms here).
"""

from __future__ import annotations

from typing import Any
from collections.abc import Callable

import torch

from ..errors import CorruptArtifactError
from ..format.contracts import op_name
from ..format.serialize import DecodedNode, refs_in

__all__ = ["DivergedValueError", "describe", "matches", "check", "reads", "IGNORED_READS"]


class DivergedValueError(CorruptArtifactError):
    """An op's real result differs in shape, strides or dtype from what the load's meta check
    derived for it, so the contracts checked on meta would not hold for what reads it."""


def describe(value: Any) -> Any:
    """What the check expects of a meta result: ``(shape, strides, dtype)`` for a tensor, a list
    of descriptions for a list or tuple, ``("=", v)`` for an int or bool, None (no check) else."""
    if isinstance(value, torch.Tensor):
        return (tuple(value.shape), tuple(value.stride()), value.dtype)
    if isinstance(value, (list, tuple)):
        return [describe(v) for v in value]
    if isinstance(value, (bool, int)):
        return ("=", value)
    return None


def matches(value: Any, expect: Any) -> bool:
    """Whether a real ``value`` has the metadata ``expect`` (a ``describe`` result) says."""
    if expect is None:
        return True
    if isinstance(expect, list):
        return (isinstance(value, (list, tuple)) and len(value) == len(expect)
                and all(matches(v, e) for v, e in zip(value, expect)))
    if expect[0] == "=":
        return type(value) is type(expect[1]) and value == expect[1]
    if not isinstance(value, torch.Tensor) or value.shape != expect[0] or value.dtype != expect[2]:
        return False
    return value.stride() == expect[1] or _fits(value) or not _dense(*expect[:2])


def _dense(shape: tuple, stride: tuple) -> bool:
    """Whether a tensor of these sizes and strides has no two elements at one address, so its
    elements span at least ``numel`` of them (on meta, every view lies inside its storage)."""
    numel, span = 1, 1
    for n, s in zip(shape, stride):
        if n == 0:
            return True
        numel *= n
        span += (n - 1) * abs(s)
    return numel <= span


def _fits(value: torch.Tensor) -> bool:
    """``numel`` elements from the tensor's first one lie inside its storage: what a kernel that
    assumes a contiguous (or merely dense) layout reads or writes."""
    n = value.numel()
    return n == 0 or value.untyped_storage().nbytes() >= (value.storage_offset() + n) * value.element_size()


def _shown(v: Any) -> str:
    if isinstance(v, torch.Tensor):
        return f"shape {list(v.shape)}, strides {list(v.stride())}, {v.dtype}"
    if isinstance(v, (list, tuple)):
        return "[" + "; ".join(_shown(x) for x in v[:4]) + ("; ..." if len(v) > 4 else "") + "]"
    return repr(v)[:80]


def _shown_expect(e: Any) -> str:
    if isinstance(e, list):
        return "[" + "; ".join(_shown_expect(x) for x in e[:4]) + ("; ..." if len(e) > 4 else "") + "]"
    if isinstance(e, tuple) and len(e) == 3:
        return f"shape {list(e[0])}, strides {list(e[1])}, {e[2]}"
    return repr(e)[:80]


def check(value: Any, expect: Any, index: int, what: str) -> None:
    """Raise ``DivergedValueError`` unless ``value`` (node ``index``'s result, made by ``what``)
    has the metadata ``expect``."""
    if matches(value, expect):
        return
    raise DivergedValueError(
        f"node {index} ({what}) produced {_shown(value)} where the load's meta check derived "
        f"{_shown_expect(expect)}; the op contracts checked on meta would not hold for the ops "
        "that read it, so the step stops before any of them runs. The artifact's graph relies on "
        "a value whose meta and real results differ (a crafted or corrupted entry): remove the "
        "entry (spmd-aot gc / rm) and build it again.")


def _batch_norm_backward_saved(args: tuple, kwargs: dict) -> tuple[int, ...]:
    """``native_batch_norm_backward(grad, input, weight, running_mean, running_var, save_mean,
    save_invstd, train, eps, mask)``: with ``train`` False its kernels normalise with the
    running statistics and never read the saved ones (positions 5 and 6)."""
    train = args[7] if len(args) > 7 else kwargs.get("train")
    return (5, 6) if train is False else ()


#: Op name -> (args, kwargs) -> positions of arguments the op's kernels never read.
IGNORED_READS: dict[str, Callable[[tuple, dict], tuple[int, ...]]] = {
    "aten::native_batch_norm_backward.default": _batch_norm_backward_saved,
}


def reads(node: DecodedNode) -> set[int]:
    """The values ``node`` reads, without those at positions its op ignores."""
    target = getattr(node.target, "overload", node.target)  # a value-checked op: the op it wraps
    rule = IGNORED_READS.get(op_name(target)) if hasattr(target, "_overloadname") else None
    if rule is None:
        return node.refs
    ignored = rule(node.args, node.kwargs)
    if not ignored:
        return node.refs
    args = [None if pos in ignored else a for pos, a in enumerate(node.args)]
    return refs_in(args) | refs_in(node.kwargs)

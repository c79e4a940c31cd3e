"""Gradients a step leaves on its parameters, and whether it may leave them.

PyTorch's tutorial step clears gradients first and leaves this step's on the parameters::

    optim.zero_grad(); loss = ...; loss.backward(); optim.step(); return loss

After it, eager's ``p.grad`` holds the step's gradient (DDP: the averaged one; FSDP2: the
parameter's shard as a DTensor). The stored step cannot leave state behind by itself, so each
such gradient becomes an extra output of the graph and the runtime puts it on ``p.grad`` after
every call (``runtime/step.py``).

That is sound only when the gradient left at the end does not depend on the ``p.grad`` the step
found on entry, which the graph never reads: every parameter that ends with a gradient must
have been cleared before its first gradient arrived (``zero_grad`` on an optimizer or a module,
``set_to_none`` True or False, or ``p.grad = None``). A step that leaves gradients it did not
clear first accumulates them across steps, which is refused.

``Clearing`` records those clears while the step is traced. ``zero_grad`` is recorded at its
call, not by its effect: with the traced parameters' gradients still None it changes nothing
(``set_to_none=False`` zeroes only existing gradients). A subclass that overrides ``zero_grad``
without calling the base's is not seen, so its steps are refused, never run wrong.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch

from ..errors import UnsupportedError

__all__ = ["Clearing", "GradientsLeft"]


@dataclasses.dataclass(frozen=True)
class GradientsLeft:
    """Which parameters (indices into ``TrainState.params``) get a gradient output, in output
    order, and whether the step cleared each with ``set_to_none=False`` (eager then keeps the
    ``.grad`` tensor and writes into it)."""

    params: tuple[int, ...] = ()
    keep: tuple[bool, ...] = ()


class Clearing:
    """While active, records which traced leaves were cleared before their first gradient.

    ``leaves`` are the step's traced parameters; ``cleared`` maps a leaf's id to the
    ``set_to_none`` of its last clear before any gradient reached it.
    """

    def __init__(self, leaves):
        self.ids = {id(leaf) for leaf in leaves}
        self.arrived: set[int] = set()
        self.cleared: dict[int, bool] = {}
        for leaf in leaves:
            if leaf.requires_grad:
                leaf.register_hook(self._arrival(id(leaf)))

    def _arrival(self, leaf_id: int):
        def hook(grad):
            self.arrived.add(leaf_id)

        return hook

    def _clear(self, params, set_to_none) -> None:
        for p in params:
            if id(p) in self.ids and id(p) not in self.arrived:
                self.cleared[id(p)] = bool(set_to_none)

    def left(self, leaves, names: list[str], step) -> tuple[GradientsLeft, list[torch.Tensor]]:
        """After the step: which parameters it leaves a gradient on, and those gradients' local
        parts (the graph's last outputs); refused where the step did not clear them before
        their first gradient (``names`` are the parameters' names, ``step`` the user's function)."""
        left = [i for i, leaf in enumerate(leaves) if leaf.grad is not None]
        uncleared = [names[i] for i in left if id(leaves[i]) not in self.cleared]
        if uncleared:
            code = getattr(step, "__code__", None)
            where = f"{code.co_filename}:{code.co_firstlineno}: " if code is not None else ""
            raise UnsupportedError(
                f"{where}the step leaves gradients on {len(uncleared)} parameter(s) (first: {uncleared[0]}) that it "
                "did not clear before their first backward(), so they would accumulate across steps, which a stored "
                "step cannot carry: call optim.zero_grad() at the start of the step (before the forward) or at "
                "its end")
        found = GradientsLeft(tuple(left), tuple(not self.cleared[id(leaves[i])] for i in left))
        return found, [_local(leaves[i].grad) for i in left]

    @contextlib.contextmanager
    def recording(self):
        optimizer_zero_grad = torch.optim.Optimizer.zero_grad
        module_zero_grad = torch.nn.Module.zero_grad
        grad = torch._C.TensorBase.grad
        clear = self._clear

        def optimizer_cleared(optim, set_to_none: bool = True):
            clear([p for g in optim.param_groups for p in g["params"]], set_to_none)
            return optimizer_zero_grad(optim, set_to_none)

        def module_cleared(module, set_to_none: bool = True):
            clear(list(module.parameters()), set_to_none)
            return module_zero_grad(module, set_to_none)

        def set_grad(tensor, value):
            if value is None:
                clear([tensor], True)
            grad.__set__(tensor, value)

        torch.optim.Optimizer.zero_grad = optimizer_cleared
        torch.nn.Module.zero_grad = module_cleared
        # ``p.grad = None``: a property on torch.Tensor shadows the C attribute for the trace only
        torch.Tensor.grad = property(grad.__get__, set_grad, grad.__delete__, grad.__doc__)
        try:
            yield self
        finally:
            del torch.Tensor.grad
            torch.nn.Module.zero_grad = module_zero_grad
            torch.optim.Optimizer.zero_grad = optimizer_zero_grad


def _local(grad):
    """A gradient's local part: a DTensor's (Replicate under replicate, the parameter's padded
    shard under shard: reduced by the end of the step), a plain tensor as it is."""
    if not hasattr(grad, "to_local"):
        return grad
    if any(p.is_partial() for p in grad.placements):
        raise AssertionError(f"a gradient left unreduced ({grad.placements}) at the end of the step")
    return grad.to_local()

"""Several optimizers in one step: a list, tuple or dict of optimizers (matrices with one,
vectors with another, as Muon + AdamW recipes do), called ``step(model, optims, batch)``.

``OptimizerSet`` presents the container as the one optimizer the rest of spmd-aot reads: its
``param_groups`` are the members' group dicts, concatenated in member order (the very dicts,
so a learning-rate scheduler's writes are seen and each group's learning rate stays a graph
input), and its ``state`` is a mapping over the members' state dicts. Tracing swaps each
member (``trace._each_optimizer_swapped``) and calls the user's step with the user's container,
so ``for o in optims: o.step()`` runs every member's own update with its own hyperparameters.
"""

from __future__ import annotations

import collections
from typing import Any

import torch

from ..errors import UnsupportedError

__all__ = ["OptimizerSet", "as_optimizer", "members", "user_object"]


def members(optim) -> list:
    """The optimizers behind ``optim`` (itself alone when it is one optimizer)."""
    return list(optim.members) if isinstance(optim, OptimizerSet) else [optim]


def user_object(optim):
    """What the user's step is called with: the container for a set."""
    return optim.container if isinstance(optim, OptimizerSet) else optim


def as_optimizer(optim):
    """``optim`` itself, or an ``OptimizerSet`` for a list, tuple or dict of optimizers."""
    if optim is None or not isinstance(optim, (list, tuple, dict)):
        return optim
    return OptimizerSet(optim)


class _MergedState(collections.abc.MutableMapping):
    """Parameter -> state entries, read from (and written to) the member that optimizes it."""

    def __init__(self, owner: "OptimizerSet"):
        self.owner = owner

    def _member(self, p):
        for m in self.owner.members:
            if p in m.state or any(q is p for g in m.param_groups for q in g["params"]):
                return m
        raise KeyError(p)

    def __getitem__(self, p):
        return self._member(p).state[p]

    def __setitem__(self, p, value):
        self._member(p).state[p] = value

    def __delitem__(self, p):
        del self._member(p).state[p]

    def __contains__(self, p):
        return any(p in m.state for m in self.owner.members)

    def get(self, p, default=None):
        for m in self.owner.members:
            if p in m.state:
                return m.state[p]
        return default

    def __iter__(self):
        for m in self.owner.members:
            yield from m.state

    def __len__(self):
        return sum(len(m.state) for m in self.owner.members)


class OptimizerSet:
    """A container of optimizers seen as one (see the module docstring)."""

    def __init__(self, container):
        items = list(container.values()) if isinstance(container, dict) else list(container)
        bad = [type(o).__qualname__ for o in items if not isinstance(o, torch.optim.Optimizer)]
        if bad or not items:
            raise UnsupportedError(
                f"the optimizer is a {type(container).__name__} holding {bad or 'nothing'}; a list, tuple or "
                "dict must hold torch.optim.Optimizer objects (one per parameter set), each "
                "parameter in one of them"
            )
        self.container = container
        self.members = items
        self.structure: Any = sorted(container) if isinstance(container, dict) else [type(container).__name__,
                                                                                   len(items)]
        self._state = None

    def holds(self, container) -> bool:
        """The same container with the same optimizers in it (else the step is re-resolved)."""
        if container is not self.container:
            return False
        now = list(container.values()) if isinstance(container, dict) else list(container)
        return len(now) == len(self.members) and all(a is b for a, b in zip(now, self.members))

    @property
    def param_groups(self) -> list[dict]:
        return [g for m in self.members for g in m.param_groups]

    @property
    def defaults(self) -> dict:
        merged: dict = {}
        for m in self.members:
            merged.update(m.defaults)
        return merged

    @property
    def state(self) -> _MergedState:
        """One object while no member's state dict is replaced (``load_state_dict``), so the
        runtime's identity check on it keeps working."""
        dicts = [m.state for m in self.members]
        if self._state is None or not all(a is b for a, b in zip(self._state[0], dicts)):
            self._state = (dicts, _MergedState(self))
        return self._state[1]

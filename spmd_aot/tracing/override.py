"""The seed's hooks for what tracing cannot do alone, applied at build time.

``Override.replacement(fqn, submodule)`` swaps an untraceable submodule (data-dependent control
flow, say) for a traceable stand-in while the step is traced; the stand-in must expose the same
parameters under the same names. ``Override.transform(gm, layout)`` rewrites the expanded
graph. A ``gm_transformation`` callable ``f(gm) -> gm | None`` rewrites it too. What they
produce is what is stored; their identity (qualified name, source hash, settings) is part of
the cache key, so editing one rebuilds.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Sequence

import torch

from ..errors import UnsupportedError

__all__ = ["Override", "Transforms", "swapped_submodules"]


class Override:
    """Subclass and override either method; the defaults change nothing."""

    def replacement(self, fqn: str, submodule: torch.nn.Module) -> torch.nn.Module:
        """Return a traceable stand-in for ``submodule`` (or ``submodule`` itself)."""
        return submodule

    def transform(self, gm: torch.fx.GraphModule, layout: list[dict]) -> torch.fx.GraphModule:
        """Rewrite the expanded graph; ``layout`` describes every graph input in order."""
        return gm


@contextlib.contextmanager
def swapped_submodules(model: torch.nn.Module, overrides: Sequence[Override]):
    """Swap in every override's replacements for the duration of the trace, then restore."""
    swaps: list[tuple[torch.nn.Module, str, torch.nn.Module]] = []

    def visit(prefix: str, module: torch.nn.Module):
        for name, child in list(module.named_children()):
            fqn = f"{prefix}.{name}" if prefix else name
            new = child
            for override in overrides:
                new = override.replacement(fqn, new)
            if new is child:
                visit(fqn, child)
                continue
            before = {f"{fqn}.{n}": tuple(p.shape) for n, p in child.named_parameters()}
            after = {f"{fqn}.{n}": tuple(p.shape) for n, p in new.named_parameters()}
            if before != after:
                raise UnsupportedError(
                    f"override replacement for {fqn} ({type(child).__qualname__} -> "
                    f"{type(new).__qualname__}) must keep the same parameters; expected "
                    f"{sorted(before.items())}, got {sorted(after.items())}"
                )
            swaps.append((module, name, child))
            setattr(module, name, new)

    try:
        visit("", model)
        yield
    finally:
        for parent, name, child in reversed(swaps):
            setattr(parent, name, child)


@dataclasses.dataclass(frozen=True)
class Transforms:
    """User hooks applied at build time (``Override`` above, and a ``gm_transformation`` of the traced graph)."""

    module_override: Sequence[Override] = ()
    gm_transformation: Callable | None = None

    def identities(self) -> list:
        """What goes into the key's ``transformations`` ingredient."""
        return list(self.module_override) + ([self.gm_transformation] if self.gm_transformation else [])

"""The interface of one parallelism axis: what it does over its named mesh dimensions.

An axis holds no state; every method takes the ``Plan`` it serves. What a configuration *is*
(its mesh roles, its parameters' layouts) is the plan value's arithmetic (``plan.py``); an axis
is the mechanics above it: the context the step is traced in, what buffers look like inside
the step, graph passes after tracing, the collectives it may add. ``axes.AXES`` lists them.
"""

from __future__ import annotations

from typing import ClassVar

__all__ = ["Axis"]


class Axis:
    name: ClassVar[str]
    roles: ClassVar[tuple[str, ...]]  # the mesh dimensions it owns (``dims.ROLES``)

    def active(self, plan) -> bool:
        """Whether ``plan``'s mesh has one of this axis' dimensions (or the axis otherwise applies)."""
        return any(role in plan.mesh_roles for role in self.roles) and plan.world_size > 1

    def tracing(self, plan, model, mesh):
        """A context manager the step is traced in (with a ``budget()`` of the collectives its
        calls added), or None. It may also have ``batch(leaves) -> leaves``: the batch's
        flattened leaves as the step sees them (context parallel cuts them to the rank's tokens),
        called before the step runs, and ``buffers(names, buffers) -> buffers``: the buffers
        (each with its attribute names) as the step sees them, called after ``batch``."""
        return None

    def traced_buffers(self, plan, buffers: list, mesh) -> list:
        """Buffers as the step sees them."""
        return buffers

    def graph_passes(self, gm, plan, traced) -> None:
        """Passes over the expanded graph."""

    def budget(self, plan, slots, groups, forward_only: bool) -> dict[str, int | None]:
        """The most collectives of each kind this axis may add for ``slots`` (None: no bound)."""
        return {}

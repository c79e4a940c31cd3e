"""How a step is spread over ranks: world size, device mesh, placements, device type."""

from __future__ import annotations

import dataclasses
import fnmatch
from typing import Mapping

from .errors import SpmdAotError

__all__ = ["Plan", "PLACEMENTS"]

# placement name -> what it means for parameters, optimizer state and the batch.
PLACEMENTS = {
    "replicate": "DDP: parameters and optimizer state Replicate, batch Shard(0), gradients averaged",
    "shard": "FSDP/ZeRO-3: parameters and optimizer state Shard(0) (HSDP on a 2-D mesh: Replicate "
             "on dim 0, Shard(0) on dim 1), all-gather for compute, reduce-scatter for gradients",
}


@dataclasses.dataclass(frozen=True)
class Plan:
    """One build configuration. ``param_placements`` maps FQN patterns (fnmatch) to a placement
    for matching parameters, e.g. ``{"*norm*": "replicate", "*.bias": "replicate"}`` under
    ``shard``; the first matching pattern wins."""

    world_size: int
    placement: str = "replicate"
    device_type: str = "cpu"
    mesh_shape: tuple[int, ...] | None = None
    param_placements: tuple[tuple[str, str], ...] | Mapping[str, str] = ()

    def __post_init__(self):
        if not isinstance(self.world_size, int) or self.world_size < 1:
            raise SpmdAotError(f"world size must be a positive integer, got {self.world_size!r}")
        if self.placement not in PLACEMENTS:
            raise SpmdAotError(
                f"unknown placement {self.placement!r}; expected one of: {', '.join(PLACEMENTS)}"
            )
        mesh = tuple(self.mesh_shape) if self.mesh_shape else (self.world_size,)
        product = 1
        for d in mesh:
            if not isinstance(d, int) or d < 1:
                raise SpmdAotError(f"mesh shape {mesh} must be positive integers")
            product *= d
        if product != self.world_size:
            raise SpmdAotError(
                f"mesh shape {mesh} has {product} ranks but the world size is {self.world_size}"
            )
        if len(mesh) > 2 or (len(mesh) == 2 and self.placement != "shard"):
            raise SpmdAotError(
                f"mesh shape {mesh} with placement {self.placement!r} is not supported; 2-D meshes "
                "(replicas, shards) are for placement 'shard' (HSDP)"
            )
        overrides = self.param_placements
        overrides = tuple(overrides.items()) if isinstance(overrides, Mapping) else tuple(map(tuple, overrides))
        for pattern, placement in overrides:
            if placement not in PLACEMENTS:
                raise SpmdAotError(
                    f"param_placements[{pattern!r}] is {placement!r}; expected one of: {', '.join(PLACEMENTS)}"
                )
            if placement == "shard" and self.placement == "replicate":
                raise SpmdAotError(
                    f"param_placements[{pattern!r}] asks for 'shard' under placement 'replicate'; use "
                    "placement='shard' and mark the parameters to keep whole as 'replicate'"
                )
        object.__setattr__(self, "mesh_shape", mesh)
        object.__setattr__(self, "param_placements", overrides)

    @property
    def shards(self) -> int:
        """Ranks a sharded parameter is split over (the last mesh dimension)."""
        return self.mesh_shape[-1]

    def placement_for(self, fqn: str, shape) -> str:
        """'replicate' or 'shard' for one parameter (scalars are never sharded)."""
        for pattern, placement in self.param_placements:
            if fnmatch.fnmatchcase(fqn, pattern):
                return placement if len(shape) else "replicate"
        return self.placement if len(shape) else "replicate"

    def describe(self) -> str:
        mesh = "x".join(map(str, self.mesh_shape))
        extra = f" +{len(self.param_placements)} overrides" if self.param_placements else ""
        return f"world={self.world_size} mesh={mesh} {self.placement}{extra} {self.device_type}"

"""How a step is spread over ranks: world size, device mesh shape, placement, device type."""

from __future__ import annotations

import dataclasses

from .errors import SpmdAotError

__all__ = ["Plan", "PLACEMENTS"]

# placement name -> what it means for parameters, optimizer state and the batch.
PLACEMENTS = {
    "replicate": "DDP: parameters and optimizer state Replicate, batch Shard(0), gradients averaged",
}


@dataclasses.dataclass(frozen=True)
class Plan:
    world_size: int
    placement: str = "replicate"
    device_type: str = "cpu"
    mesh_shape: tuple[int, ...] | None = None

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
            product *= d
        if product != self.world_size:
            raise SpmdAotError(
                f"mesh shape {mesh} has {product} ranks but the world size is {self.world_size}"
            )
        object.__setattr__(self, "mesh_shape", mesh)

    def describe(self) -> str:
        mesh = "x".join(map(str, self.mesh_shape))
        return f"world={self.world_size} mesh={mesh} {self.placement} {self.device_type}"

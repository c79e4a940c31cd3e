"""How one parameter (or optimizer state shaped like it) lies over the device mesh.

Its own module, below everything that reads layouts (placements, the plan, the expansion, the
state and the job-start sharding), so that each of them can import it without a cycle.
"""

from __future__ import annotations

import dataclasses

__all__ = ["TensorLayout"]


@dataclasses.dataclass(frozen=True)
class TensorLayout:
    """One tensor's layout. ``placement`` is the parameter's placement over the data-parallel
    mesh dimensions (a name in ``PLACEMENTS``: ``"replicate"`` or ``"shard"``)."""

    placement: str
    global_shape: tuple[int, ...]
    local_shape: tuple[int, ...]  # the graph input: padded shard, or the whole tensor
    mesh_ndim: int
    shards: int = 1  # ranks of the mesh dimension dim 0 is sharded over (1: not sharded)

    @property
    def sharded(self) -> bool:
        """Dim 0 is split over the data-parallel shard dimension (and the tensor communicates
        through its shard group)."""
        return self.placement == "shard"

    @property
    def placements(self) -> list[str]:
        """DTensor placements per mesh dimension, as text (for the layout and schema map)."""
        if self.sharded:
            return ["Replicate()"] * (self.mesh_ndim - 1) + ["Shard(0)"]
        return ["Replicate()"] * self.mesh_ndim

    def dtensor_placements(self) -> list:
        """``placements`` as DTensor placement objects."""
        from torch.distributed.tensor import Replicate, Shard

        return [Shard(0) if p == "Shard(0)" else Replicate() for p in self.placements]

    @property
    def dtensor_shape(self) -> tuple[int, ...]:
        """The global shape of the DTensor over the padded storage (dim 0 rounded up to a
        multiple of the shard count, so every rank's shard has the same size)."""
        if self.sharded:
            return (self.local_shape[0] * self.shards,) + tuple(self.local_shape[1:])
        return tuple(self.global_shape)

    def shard_rows(self) -> list[int]:
        """Real (unpadded) dim-0 rows each shard holds; the rest of its storage is padding."""
        if not self.sharded:
            return []
        chunk, n = self.local_shape[0], self.global_shape[0]
        return [max(0, min(chunk, n - i * chunk)) for i in range(self.shards)]

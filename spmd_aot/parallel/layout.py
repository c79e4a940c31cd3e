"""How one parameter (or optimizer state shaped like it) lies over the device mesh.

Its own module, below everything that reads layouts (placements, the plan, the expansion, the
state and the job-start sharding), so that each of them can import it without a cycle.

The mesh's dimensions are the data-parallel ones, then, with context parallel, one ``cp``
dimension, then, with a tensor-parallel plan, one TP dimension last. A tensor is whole over
``cp`` (its ranks hold the same parameters and see different tokens), and its gradient is
averaged over ``cp`` as over a data-parallel dimension. A tensor is first split over TP (``tp_dim``: the
tensor dimension split evenly
over the TP ranks, or None when every TP rank holds it whole); that TP-local tensor is what a
module computes with (``gathered_shape``). Under ``shard`` its dim 0 is then split over the
data-parallel shard dimension, padded up to a multiple of the shard count as FSDP2 pads, so
one graph serves every rank; the local storage is what the graph reads (``local_shape``).

With an expert-parallel dimension (``ep``, just before TP), an expert module's parameters are
split on dim 0 (the experts) over it (``ep_split``) before the data-parallel shard; every other
parameter is whole over ``ep``, whose ranks see different tokens, so its gradient is averaged
over ``ep`` like a data-parallel dimension (``dp_mesh_dims``).
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
    local_shape: tuple[int, ...]  # the graph input: padded shard, or the whole (TP-local) tensor
    mesh_ndim: int
    shards: int = 1  # ranks of the mesh dimension dim 0 is sharded over (1: not sharded)
    tp: int = 0  # ranks of the TP mesh dimension (the last one); 0: the mesh has none
    tp_dim: int | None = None  # tensor dimension split over TP; None: whole on every TP rank
    ep: int = 0  # ranks of the expert-parallel mesh dimension; 0: the mesh has none
    ep_split: bool = False  # dim 0 (the experts) split over ``ep``: an expert module's parameter
    cp: int = 0  # ranks of the context-parallel mesh dimension (just before TP); 0: the mesh has none

    @property
    def sharded(self) -> bool:
        """Dim 0 is split over the data-parallel shard dimension (and the tensor communicates
        through its shard group)."""
        return self.placement == "shard"

    @property
    def tp_mesh_dim(self) -> int | None:
        return self.mesh_ndim - 1 if self.tp else None

    @property
    def ep_mesh_dim(self) -> int | None:
        """The expert-parallel mesh dimension (just before TP), or None."""
        return self.mesh_ndim - (2 if self.tp else 1) if self.ep else None

    @property
    def cp_mesh_dim(self) -> int | None:
        """The context-parallel mesh dimension (before ``ep`` and TP), or None."""
        return self.mesh_ndim - 1 - (1 if self.tp else 0) - (1 if self.ep else 0) if self.cp else None

    @property
    def dp_mesh_dims(self) -> list[int]:
        """The mesh dimensions gradients are averaged over: every one but the TP dimension (the
        data-parallel ones, ``cp``, and ``ep`` unless the tensor is split over it)."""
        return [d for d in range(self.mesh_ndim)
                if d != self.tp_mesh_dim and not (self.ep_split and d == self.ep_mesh_dim)]

    @property
    def shard_mesh_dim(self) -> int | None:
        """The mesh dimension a sharded tensor's dim 0 is split over (the last data-parallel
        one; the ones before it, under HSDP, replicate); None when the mesh has none."""
        dims = [d for d in self.dp_mesh_dims if d not in (self.cp_mesh_dim, self.ep_mesh_dim)]
        return dims[-1] if dims else None

    @property
    def replica_mesh_dims(self) -> list[int]:
        """The dimensions a sharded tensor is whole over whose ranks average its gradient after
        the shard dimension's reduce_scatter: HSDP's replicas, ``cp``, and ``ep`` for a tensor
        whole over it."""
        return [d for d in self.dp_mesh_dims if d != self.shard_mesh_dim]

    @property
    def gathered_shape(self) -> tuple[int, ...]:
        """The TP-local tensor: what a module computes with, after any shard group's gather."""
        shape = list(self.global_shape)
        if self.ep_split:
            shape[0] //= self.ep
        if self.tp_dim is not None:
            shape[self.tp_dim] //= self.tp
        return tuple(shape)

    def _placement_parts(self) -> list[tuple]:
        """(kind, tensor dim, split factor) per mesh dimension."""
        parts = [("replicate", None, 1)] * self.mesh_ndim
        if self.sharded:
            # dim 0 already split over TP or EP: the data-parallel shards interleave with those,
            # which DTensor (and FSDP2 over a TP or EP model) writes _StridedShard
            factor = (self.tp if self.tp_dim == 0 and self.tp > 1 else 1) * (self.ep if self.ep_split else 1)
            parts[self.shard_mesh_dim] = ("strided" if factor > 1 else "shard", 0, factor)
        if self.ep_split:
            parts[self.ep_mesh_dim] = ("shard", 0, 1)
        if self.tp:
            parts[self.tp_mesh_dim] = ("shard", self.tp_dim, 1) if self.tp_dim is not None else ("replicate", None, 1)
        return parts

    @property
    def placements(self) -> list[str]:
        """DTensor placements per mesh dimension, as text (for the layout and schema map)."""
        text = {"replicate": lambda d, f: "Replicate()", "shard": lambda d, f: f"Shard({d})",
                "strided": lambda d, f: f"_StridedShard({d}, sf={f})"}
        return [text[kind](dim, factor) for kind, dim, factor in self._placement_parts()]

    def dtensor_placements(self) -> list:
        """``placements`` as DTensor placement objects."""
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.placement_types import _StridedShard

        make = {"replicate": lambda d, f: Replicate(), "shard": lambda d, f: Shard(d),
                "strided": lambda d, f: _StridedShard(d, split_factor=f)}
        return [make[kind](dim, factor) for kind, dim, factor in self._placement_parts()]

    @property
    def dtensor_shape(self) -> tuple[int, ...]:
        """The global shape of the DTensor over the padded storage (dim 0 rounded up to a
        multiple of the shard count, so every rank's shard has the same size)."""
        shape = list(self.local_shape)
        if self.sharded:
            shape[0] *= self.shards
        if self.ep_split:
            shape[0] *= self.ep
        if self.tp_dim is not None:
            shape[self.tp_dim] *= self.tp
        return tuple(shape)

    def shard_rows(self) -> list[int]:
        """Real (unpadded) dim-0 rows each shard holds; the rest of its storage is padding."""
        if not self.sharded:
            return []
        chunk, n = self.local_shape[0], self.gathered_shape[0]
        return [max(0, min(chunk, n - i * chunk)) for i in range(self.shards)]

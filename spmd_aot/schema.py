"""Earlier spellings of ``spmd_aot.ParallelOptions``, kept so that existing code runs unchanged.

``Schema("shard", mesh_shape=(2, 4), comm=Comm(shard_groups=("blocks.*",)),
mixed_precision=policy)`` is ``ParallelOptions.of(placement="shard", mesh_shape=(2, 4),
comm=..., mixed_precision=policy)``: it returns the ``ParallelOptions`` every entry point takes
(``options.py`` documents each field). ``Comm`` groups the communication fields.
"""

from __future__ import annotations

import dataclasses

from .options import ParallelOptions

__all__ = ["COMM_FIELDS", "Comm", "Schema"]


@dataclasses.dataclass(frozen=True)
class Comm:
    """The communication fields of ``ParallelOptions`` as one value (``options.py`` documents them)."""

    bucket_cap_mb: float = 25.0
    first_bucket_cap_mb: float = 1.0
    shard_groups: tuple[str, ...] = ()
    reshard_after_forward: bool = True


COMM_FIELDS = tuple(f.name for f in dataclasses.fields(Comm))


def Schema(placement: str = "replicate", *, comm: Comm | None = None, mixed_precision=None,
           **options) -> ParallelOptions:
    """The ``ParallelOptions`` for ``placement`` and ``options`` (its fields), ``comm`` (a
    ``Comm``) and ``mixed_precision`` (a ``MixedPrecisionPolicy``, ours or FSDP2's, or a mapping)."""
    return ParallelOptions.of(placement=placement, comm=comm, mixed_precision=mixed_precision, **options)

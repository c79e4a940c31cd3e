"""``spmd_aot.Schema``: the one options object for how a step is spread over ranks.

``build``, ``compile``, ``SPMD`` and the CLI all take one; their placement keywords
(``placement=``, ``mesh_shape=``, ``tp_plan=``, ``bucket_cap_mb=``, ...) are sugar that builds it
once (``Schema.of``). A schema is validated when it is made, not at a job's first collective
call; with the world size (from the process group, or the build's) and the device type it
becomes the ``Plan`` that is stored and hashed (``Schema.plan``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping, Sequence

from .parallel.mixed_precision import MixedPrecisionPolicy
from .parallel.plan import Plan

__all__ = ["Schema", "Comm", "COMM_FIELDS"]


@dataclasses.dataclass(frozen=True)
class Comm:
    """Communication options (docs/parallelism.md). ``replicate``: gradients averaged in
    buckets of at most ``bucket_cap_mb`` MiB, the first ``first_bucket_cap_mb`` (DDP's
    defaults). ``shard``: ``shard_groups`` FQN patterns, one communication group each (empty:
    one per block); ``reshard_after_forward`` gathers parameters again in backward (FSDP2's
    default)."""

    bucket_cap_mb: float = 25.0
    first_bucket_cap_mb: float = 1.0
    shard_groups: tuple[str, ...] = ()
    reshard_after_forward: bool = True


COMM_FIELDS = tuple(f.name for f in dataclasses.fields(Comm))
_LAYOUT_FIELDS = ("placement", "mesh_shape", "param_placements", "tp_plan", "mixed_precision")


class Schema:
    """How parameters are spread: ``placement`` ("replicate" or "shard"), ``mesh_shape`` (its
    dimensions named as ``Plan`` says: HSDP, DDP x TP, HSDP x TP, ...), ``param_placements``
    (FQN pattern -> placement), ``tp_plan`` (module FQN pattern -> TP style, or "hf") and the
    communication options, as ``comm=Comm(...)`` or as its keywords; ``mixed_precision`` a
    ``MixedPrecisionPolicy`` (ours or torch's FSDP2 one: compute, reduce and output dtypes)."""

    def __init__(self, placement: str = "replicate", *, mesh_shape: Sequence[int] | None = None,
                 param_placements: Mapping[str, str] | Sequence = (), tp_plan=(), comm: Comm | None = None,
                 mixed_precision: MixedPrecisionPolicy | None = None, **comm_options):
        unknown = sorted(set(comm_options) - set(COMM_FIELDS))
        if unknown:
            raise TypeError(f"unknown option(s) {', '.join(unknown)}; a schema takes "
                            f"{', '.join(_LAYOUT_FIELDS + COMM_FIELDS)}")
        if comm is not None and comm_options:
            raise TypeError("pass the communication options as comm=Comm(...) or as keywords, not both")
        comm = comm if comm is not None else Comm(**comm_options)
        mesh = tuple(mesh_shape) if mesh_shape else None
        # the checks that need no world size run now; a plan over the mesh's own ranks normalizes
        checked = Plan(math.prod(mesh) if mesh else 1, placement, mesh_shape=mesh,
                       param_placements=param_placements, tp_plan=tp_plan, **dataclasses.asdict(comm))
        self.placement = placement
        self.mesh_shape = mesh
        self.param_placements = checked.param_placements
        self.tp_plan = tp_plan if isinstance(tp_plan, str) else checked.tp_plan
        self.comm = Comm(checked.bucket_cap_mb, checked.first_bucket_cap_mb, checked.shard_groups,
                         checked.reshard_after_forward)
        self.mixed_precision = MixedPrecisionPolicy.of(mixed_precision)

    @classmethod
    def of(cls, schema: "Schema | None" = None, **options) -> "Schema":
        """``schema``, or one made from keyword ``options`` (the sugar ``build``/``compile`` take)."""
        if schema is None:
            return cls(**options)
        if not isinstance(schema, Schema):
            raise TypeError(f"schema must be a spmd_aot.Schema, got {type(schema).__name__}")
        if options:
            raise TypeError(f"pass {', '.join(sorted(options))} in the Schema, not beside it")
        return schema

    def plan(self, world_size: int, device_type: str = "cpu") -> Plan:
        """The configuration this schema gives at ``world_size`` ranks of ``device_type``."""
        return Plan(world_size, self.placement, device_type, self.mesh_shape, self.param_placements,
                    tp_plan=self.tp_plan, mixed_precision=self.mixed_precision, **dataclasses.asdict(self.comm))

    def options(self) -> dict:
        """Every option as a keyword (``Schema(**schema.options())`` is ``schema``)."""
        return {"placement": self.placement, "mesh_shape": self.mesh_shape,
                "param_placements": self.param_placements, "tp_plan": self.tp_plan, "comm": self.comm,
                "mixed_precision": self.mixed_precision}

    def __eq__(self, other) -> bool:
        return isinstance(other, Schema) and self.options() == other.options()

    def __hash__(self) -> int:
        return hash(tuple(self.options().items()))

    def __repr__(self) -> str:
        extra = "".join(f", {k}={v!r}" for k, v in self.options().items()
                        if k != "placement" and v and v != Comm())
        return f"Schema({self.placement!r}{extra})"

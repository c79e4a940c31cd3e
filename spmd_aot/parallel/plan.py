"""How a step is spread over ranks: world size, device mesh, placements, tensor-parallel plan,
device type. A pure value: names and arithmetic (the mesh's named dimensions, each parameter's
layout), no mechanics; the axes that act on it are ``parallel/axes.py``'s."""

from __future__ import annotations

import dataclasses
import fnmatch
import math
from collections.abc import Mapping

from ..errors import SpmdAotError
from .layout import TensorLayout
from .mixed_precision import MixedPrecisionPolicy
from .dims import BATCH_ROLES, PLACEMENT_NAMES, mesh_roles
from .tp_plan import MODEL_PLAN_NAMES, resolve_tp_plan, split_dim, style_name

__all__ = ["Plan", "PLACEMENT_NAMES"]


@dataclasses.dataclass(frozen=True)
class Plan:
    """One build configuration. ``param_placements`` maps FQN patterns (fnmatch) to a placement
    for matching parameters, e.g. ``{"*norm*": "replicate", "*.bias": "replicate"}`` under
    ``shard``; the first matching pattern wins.

    ``tp_plan`` maps module FQN patterns (fnmatch, first match wins) to a tensor-parallel style
    (``tensor_parallel.py``: ``"colwise"``, ``"rowwise"`` and the sequence-parallel styles), e.g.
    ``{"blocks.*.attn.q": "colwise", "blocks.*.attn.o": "rowwise"}``. With one, the last mesh
    dimension is ``tp``. The mesh's dimensions are named (``mesh_roles``, ``parallel/dims.py``):
    ``replicate`` takes ``(dp_replicate,)``, with TP ``(tp,)`` (TP alone) or ``(dp_replicate, tp)``
    (DDP x TP); ``shard`` takes ``(dp_shard,)`` or ``(dp_replicate, dp_shard)`` (HSDP), with TP
    ``(dp_shard, tp)`` (FSDP x TP) or ``(dp_replicate, dp_shard, tp)`` (HSDP x TP).

    ``context_parallel`` splits the batch's sequence (dim 1 of every batch tensor) over a ``cp``
    mesh dimension after the data-parallel ones and before TP (``context_parallel.py``), e.g.
    ``(cp,)``, ``(dp_shard, cp)`` or ``(dp_shard, cp, tp)``; its size is that dimension's.
    ``context_parallel_buffers`` are FQN patterns of buffers whose dim 0 is the sequence (a RoPE
    table sliced by the model), cut as the batch is.

    ``expert_parallel`` names the mixture-of-experts modules whose experts split over an ``ep``
    mesh dimension just before TP (``expert_parallel.py``): module FQN patterns, or ``"auto"``
    (every module with a ``num_experts`` whose own parameters, stacked matrices among them, all
    have that many rows), e.g.
    ``(dp_shard, ep)`` or ``(dp_shard, ep, tp)``. ``expert_capacity_factor`` (None: no token is
    ever dropped) bounds the tokens each expert takes per step, Switch/GShard style."""

    world_size: int
    placement: str = "replicate"
    device_type: str = "cpu"
    mesh_shape: tuple[int, ...] | None = None
    param_placements: tuple[tuple[str, str], ...] | Mapping[str, str] = ()
    # Communication layout (see README "Communication"). replicate: gradients are averaged in
    # flat buckets of at most ``bucket_cap_mb`` MiB, the first one ``first_bucket_cap_mb``
    # (DDP's defaults), so the first all_reduce starts early in backward. shard: parameters are
    # gathered and their gradients reduce-scattered per group: ``shard_groups`` are FQN
    # patterns, one group each (a parameter joins the first group that matches); empty means
    # one group per child of every ModuleList/Sequential/ModuleDict (``groups.block_prefixes``)
    # plus one for the remaining parameters (as ``fully_shard`` per block). ``reshard_after_forward`` frees gathered
    # parameters after forward and gathers them again for backward (FSDP2's default).
    bucket_cap_mb: float = 25.0
    first_bucket_cap_mb: float = 1.0
    shard_groups: tuple[str, ...] = ()
    reshard_after_forward: bool = True
    tp_plan: tuple[tuple[str, str], ...] | Mapping[str, str] = ()
    # dtypes of compute, gradient reduction and outputs (``mixed_precision.py``); None: the model's own
    mixed_precision: MixedPrecisionPolicy | None = None
    # the batch's sequence split over a ``cp`` mesh dimension (``context_parallel.py``)
    context_parallel: bool = False
    context_parallel_buffers: tuple[str, ...] = ()
    # mixture-of-experts modules whose experts split over an ``ep`` mesh dimension, and the
    # opt-in capacity factor that drops tokens past each expert's capacity (``expert_parallel.py``)
    expert_parallel: tuple[str, ...] | str = ()
    expert_capacity_factor: float | None = None
    # derived: the role of each mesh dimension (``parallel/dims.py``), e.g. ("dp_shard", "tp")
    mesh_roles: tuple[str, ...] = dataclasses.field(init=False, repr=False, compare=False, default=())
    # derived by ``for_model``: patterns of the model's own tp_plan ("hf") that name modules it
    # lacks, dropped as transformers drops them (``tp_plan.resolve_tp_plan``); in the build's stats
    tp_skipped: tuple[str, ...] = dataclasses.field(init=False, repr=False, compare=False, default=())

    def __post_init__(self):
        if not isinstance(self.world_size, int) or self.world_size < 1:
            raise SpmdAotError(f"world size must be a positive integer, got {self.world_size!r}")
        if self.placement not in PLACEMENT_NAMES:
            raise SpmdAotError(
                f"unknown placement {self.placement!r}; expected one of: {', '.join(PLACEMENT_NAMES)}"
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
        object.__setattr__(self, "mesh_shape", mesh)
        tp_plan = self.tp_plan
        if isinstance(tp_plan, str):  # the model's own plan, bound by ``for_model``
            if tp_plan not in MODEL_PLAN_NAMES:
                raise SpmdAotError(f"tp_plan={tp_plan!r}: a string names the model's own plan "
                                   f"({' or '.join(map(repr, MODEL_PLAN_NAMES))}); otherwise pass PATTERN: STYLE pairs")
            tp_plan = MODEL_PLAN_NAMES[0]
        else:
            tp_plan = tuple(tp_plan.items()) if isinstance(tp_plan, Mapping) else tuple(map(tuple, tp_plan))
            for entry in tp_plan:
                if len(entry) != 2 or not isinstance(entry[0], str) or not entry[0]:
                    raise SpmdAotError(f"tp_plan entries are (module FQN pattern, style) pairs, got {entry!r}")
            tp_plan = tuple((pattern, style_name(pattern, style)) for pattern, style in tp_plan)
        object.__setattr__(self, "tp_plan", tp_plan)
        object.__setattr__(self, "context_parallel_buffers", _checked_context_parallel(self))
        experts = self._normalize_experts()
        others = (("cp",) if self.context_parallel else ()) + (("ep",) if experts else ()) + \
            (("tp",) if tp_plan else ())
        roles = mesh_roles(self.placement, mesh, others if self.world_size > 1 else ())
        if isinstance(roles, str):
            raise SpmdAotError(roles)
        object.__setattr__(self, "mesh_roles", roles)
        overrides = self.param_placements
        overrides = tuple(overrides.items()) if isinstance(overrides, Mapping) else tuple(map(tuple, overrides))
        for pattern, placement in overrides:
            if placement not in PLACEMENT_NAMES:
                raise SpmdAotError(
                    f"param_placements[{pattern!r}] is {placement!r}; expected one of: {', '.join(PLACEMENT_NAMES)}"
                )
            if placement != self.placement and self.placement == "replicate":
                raise SpmdAotError(
                    f"param_placements[{pattern!r}] asks for {placement!r} under placement 'replicate'; use "
                    f"placement={placement!r} and mark the parameters to keep whole as 'replicate'"
                )
        for name in ("bucket_cap_mb", "first_bucket_cap_mb"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1 << 20:
                raise SpmdAotError(f"{name} must be a positive number of MiB, got {value!r}")
            object.__setattr__(self, name, float(value))
        groups = (self.shard_groups,) if isinstance(self.shard_groups, str) else tuple(self.shard_groups)
        if not all(isinstance(g, str) and g for g in groups):
            raise SpmdAotError(f"shard_groups must be non-empty FQN patterns, got {groups!r}")
        if not isinstance(self.reshard_after_forward, bool):
            raise SpmdAotError(f"reshard_after_forward must be True or False, got {self.reshard_after_forward!r}")
        object.__setattr__(self, "param_placements", overrides)
        object.__setattr__(self, "shard_groups", groups)
        object.__setattr__(self, "mixed_precision", MixedPrecisionPolicy.of(self.mixed_precision))

    def _normalize_experts(self) -> tuple[str, ...] | str:
        """Check and normalize ``expert_parallel`` and ``expert_capacity_factor``; returns the former."""
        experts = self.expert_parallel
        if isinstance(experts, str):
            if experts != "auto":
                raise SpmdAotError(f"expert_parallel={experts!r}: a string must be 'auto' (every module with "
                                   "num_experts); otherwise pass module FQN patterns")
        else:
            experts = tuple(experts)
            if not all(isinstance(e, str) and e for e in experts):
                raise SpmdAotError(f"expert_parallel holds module FQN patterns, got {experts!r}")
        object.__setattr__(self, "expert_parallel", experts)
        factor = self.expert_capacity_factor
        if factor is not None and (isinstance(factor, bool) or not isinstance(factor, (int, float)) or
                                   not 0 < factor <= 1024):
            raise SpmdAotError(f"expert_capacity_factor must be a positive number (or None: drop no token), "
                               f"got {factor!r}")
        if factor is not None and not experts:
            raise SpmdAotError("expert_capacity_factor is set without expert_parallel; name the expert modules "
                               "(expert_parallel='auto' or FQN patterns) or drop the factor")
        object.__setattr__(self, "expert_capacity_factor", None if factor is None else float(factor))
        return experts

    def for_model(self, model) -> Plan:
        """This plan with its ``tp_plan`` bound to ``model`` (``tensor_parallel.resolve_tp_plan``:
        the model's own plan for ``"hf"``, transformers' base-model-relative patterns prefixed),
        and ``expert_parallel="auto"`` to the FQNs of the model's expert modules."""
        if self.expert_parallel == "auto":
            from .expert_parallel import expert_modules

            self = dataclasses.replace(self, expert_parallel=tuple(expert_modules(model)))
        if not self.tp_plan:
            return self
        skipped: list[str] = []
        resolved = resolve_tp_plan(self.tp_plan, model, skipped)
        if resolved == self.tp_plan:
            return self
        bound = dataclasses.replace(self, tp_plan=resolved)
        object.__setattr__(bound, "tp_skipped", tuple(skipped))
        return bound

    def mesh_dim(self, role: str) -> int | None:
        """The mesh dimension that has ``role``; None when the mesh has none (or one rank)."""
        if self.world_size == 1 or role not in self.mesh_roles:
            return None
        return self.mesh_roles.index(role)

    def size(self, role: str) -> int:
        """Ranks along the dimension that has ``role`` (1 without one)."""
        dim = self.mesh_dim(role)
        return 1 if dim is None else self.mesh_shape[dim]

    @property
    def tp(self) -> int:
        """Ranks of the TP mesh dimension; 0 when the plan has no TP (or one rank)."""
        return self.size("tp") if self.mesh_dim("tp") is not None else 0

    @property
    def cp(self) -> int:
        """Ranks of the context-parallel mesh dimension; 0 when the plan has none (or one rank)."""
        return self.size("cp") if self.mesh_dim("cp") is not None else 0

    @property
    def ep(self) -> int:
        """Ranks of the expert-parallel mesh dimension; 0 when the plan has none (or one rank)."""
        return self.size("ep") if self.mesh_dim("ep") is not None else 0

    def is_expert_param(self, fqn: str) -> bool:
        """Whether parameter ``fqn`` belongs to a module ``expert_parallel`` names (bound by
        ``for_model`` when it is ``"auto"``)."""
        owner = fqn.rpartition(".")[0]
        return isinstance(self.expert_parallel, tuple) and \
            any(fnmatch.fnmatchcase(owner, pattern) for pattern in self.expert_parallel)

    @property
    def dp_size(self) -> int:
        """Ranks that see different batches: the data-parallel mesh dimensions and ``ep`` (TP ranks
        share one)."""
        return math.prod(self.size(role) for role in BATCH_ROLES)

    @property
    def dtensor_leaves(self) -> bool:
        """Graph leaves (what the optimizer and ``model.parameters()`` see in the step) are
        DTensors: on every mesh but DDP's alone, or with context parallel (a shard or split
        dimension, more than one rank); ``cp`` ranks hold whole parameters, as DDP's."""
        return self.world_size > 1 and not set(self.mesh_roles) <= {"dp_replicate", "cp"}

    def batch_placements(self) -> list[str]:
        """A batch leaf per mesh dimension: split on dim 0 over the data-parallel dimensions and
        ``ep`` (each rank passes its own share), whole over the others (their ranks pass the same)."""
        return ["Shard(0)" if role in BATCH_ROLES else "Replicate()" for role in self.mesh_roles]

    def placement_for(self, fqn: str, shape) -> str:
        """'replicate' or 'shard' for one parameter (scalars are never sharded)."""
        for pattern, placement in self.param_placements:
            if fnmatch.fnmatchcase(fqn, pattern):
                return placement if len(shape) else "replicate"
        return self.placement if len(shape) else "replicate"

    def layout_for(self, fqn: str, shape) -> TensorLayout:
        """How parameter ``fqn`` (and optimizer state shaped like it) lies over the mesh: split
        over ``tp`` as its module's style says, then dim 0 of that TP-local tensor split over
        ``dp_shard`` under ``shard`` (padded up to a multiple of the shard count, as FSDP2 pads)."""
        shape = tuple(shape)
        placement = self.placement_for(fqn, shape) if self.world_size > 1 else "replicate"
        local, tp_dim = shape, None
        if self.tp:
            style, tp_dim = split_dim(self.tp_plan, fqn) or (None, None)
            if tp_dim is not None and (tp_dim >= len(shape) or shape[tp_dim] % self.tp):
                raise SpmdAotError(
                    f"parameter {fqn} of shape {list(shape)} cannot be split {style} over {self.tp} TP "
                    f"ranks: its dim {tp_dim} must divide evenly; change the TP size or the tp_plan")
            if tp_dim is not None:
                local = shape[:tp_dim] + (shape[tp_dim] // self.tp,) + shape[tp_dim + 1:]
        shards = 1
        ep_split = bool(self.ep) and self.is_expert_param(fqn)
        if ep_split:
            if tp_dim is not None:
                raise SpmdAotError(f"parameter {fqn} is an expert's and split by the tp_plan; experts split over "
                                   "ep run whole on every TP rank: leave the expert modules out of the tp_plan")
            if not shape or shape[0] % self.ep:
                raise SpmdAotError(
                    f"expert parameter {fqn} of shape {list(shape)} cannot be split over {self.ep} ep ranks: "
                    f"its dim 0 (the experts) must divide evenly; change the ep size")
            local = (local[0] // self.ep,) + local[1:]
        if placement == "shard":
            shards = self.size("dp_shard")
            local = (math.ceil(local[0] / shards),) + local[1:]
        return TensorLayout(placement, shape, local, len(self.mesh_shape), shards, tp=self.tp, tp_dim=tp_dim,
                            cp=self.cp, ep=self.ep, ep_split=ep_split)

    def to_dict(self) -> dict:
        """The plan's one text form: stored in manifests, hashed into the key, shown by the CLI."""
        return {"world_size": self.world_size, "placement": self.placement,
                "device_type": self.device_type, "mesh_shape": list(self.mesh_shape),
                "param_placements": [list(p) for p in self.param_placements],
                "bucket_cap_mb": self.bucket_cap_mb, "first_bucket_cap_mb": self.first_bucket_cap_mb,
                "shard_groups": list(self.shard_groups),
                "reshard_after_forward": self.reshard_after_forward,
                # only when set: plans without TP keep the text (and keys) they always had
                **({"tp_plan": [list(p) for p in self.tp_plan]} if self.tp_plan else {}),
                **({"mixed_precision": self.mixed_precision.to_dict()} if self.mixed_precision else {}),
                **({"context_parallel": True} if self.context_parallel else {}),
                **({"context_parallel_buffers": list(self.context_parallel_buffers)}
                   if self.context_parallel_buffers else {}),
                **({"expert_parallel": self.expert_parallel if isinstance(self.expert_parallel, str)
                    else list(self.expert_parallel)} if self.expert_parallel else {}),
                **({"expert_capacity_factor": self.expert_capacity_factor}
                   if self.expert_capacity_factor is not None else {})}

    @classmethod
    def from_dict(cls, d: Mapping) -> Plan:
        """Inverse of ``to_dict``; raises ``SpmdAotError`` on anything it would not have written."""
        optional = {"tp_plan", "mixed_precision", "context_parallel", "context_parallel_buffers", "expert_parallel",
                    "expert_capacity_factor"}
        if not isinstance(d, Mapping) or set(d) - optional != set(_FIELDS) - optional or \
                d.get("tp_plan", True) == [] or d.get("context_parallel", True) is not True:
            raise SpmdAotError(f"a plan has exactly the fields {', '.join(_FIELDS)} (tp_plan, "
                               "mixed_precision and context_parallel only when set)")
        pairs = ("param_placements", "tp_plan")
        if not all(isinstance(d.get(f, []), list) for f in ("mesh_shape", "shard_groups", *pairs)) or \
                not all(isinstance(p, list) and len(p) == 2 and all(isinstance(x, str) for x in p)
                        for f in pairs for p in d.get(f, [])) or not isinstance(d["device_type"], str):
            raise SpmdAotError("a plan's mesh_shape, param_placements, shard_groups and tp_plan are lists")
        return cls(d["world_size"], d["placement"], d["device_type"], tuple(d["mesh_shape"]),
                   tuple(tuple(p) for p in d["param_placements"]), d["bucket_cap_mb"],
                   d["first_bucket_cap_mb"], tuple(d["shard_groups"]), d["reshard_after_forward"],
                   tuple(tuple(p) for p in d.get("tp_plan", [])),
                   MixedPrecisionPolicy.from_dict(d["mixed_precision"]) if "mixed_precision" in d else None,
                   context_parallel="context_parallel" in d,
                   context_parallel_buffers=_patterns(d.get("context_parallel_buffers", [])),
                   expert_parallel=_expert_modules(d.get("expert_parallel", ())),
                   expert_capacity_factor=d.get("expert_capacity_factor"))

    def describe(self) -> str:
        mesh = "x".join(map(str, self.mesh_shape))
        extra = f" +{len(self.param_placements)} overrides" if self.param_placements else ""
        extra += f" cp={self.cp}" if self.cp else ""
        extra += f" ep={self.ep}" if self.ep else ""
        extra += f" tp={self.tp}" if self.tp else ""
        extra += f" {self.mixed_precision.describe()}" if self.mixed_precision else ""
        return f"world={self.world_size} mesh={mesh} {self.placement}{extra} {self.device_type}"


def _checked_context_parallel(plan) -> tuple[str, ...]:
    """``plan.context_parallel`` checked; its ``context_parallel_buffers`` as a tuple of patterns."""
    if not isinstance(plan.context_parallel, bool):
        raise SpmdAotError(f"context_parallel must be True or False, got {plan.context_parallel!r}")
    buffers = plan.context_parallel_buffers
    buffers = (buffers,) if isinstance(buffers, str) else tuple(buffers)
    if not all(isinstance(b, str) and b for b in buffers):
        raise SpmdAotError(f"context_parallel_buffers holds buffer FQN patterns, got {buffers!r}")
    if buffers and not plan.context_parallel:
        raise SpmdAotError("context_parallel_buffers is set without context_parallel; set context_parallel=True "
                           "or drop the buffers")
    return buffers


def _patterns(value) -> tuple[str, ...]:
    """A stored list of FQN patterns."""
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise SpmdAotError("a plan's context_parallel_buffers is a list of buffer FQN patterns")
    return tuple(value)


def _expert_modules(value):
    """A stored ``expert_parallel``: ``"auto"`` or a list of patterns."""
    if value == "auto" or value == ():
        return value
    if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
        raise SpmdAotError("a plan's expert_parallel is 'auto' or a non-empty list of module FQN patterns")
    return tuple(value)


_FIELDS = tuple(f.name for f in dataclasses.fields(Plan) if f.init)

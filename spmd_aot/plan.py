"""How a step is spread over ranks: world size, device mesh, placements, tensor-parallel plan,
device type."""

from __future__ import annotations

import dataclasses
import fnmatch
from typing import Mapping

from .errors import SpmdAotError
from .layout import TensorLayout
from .placements import PLACEMENTS, Placement
from .tensor_parallel import MODEL_PLAN_NAMES, TPStyle, resolve_tp_plan, style_for, style_name

__all__ = ["Plan", "PLACEMENTS"]


@dataclasses.dataclass(frozen=True)
class Plan:
    """One build configuration. ``param_placements`` maps FQN patterns (fnmatch) to a placement
    for matching parameters, e.g. ``{"*norm*": "replicate", "*.bias": "replicate"}`` under
    ``shard``; the first matching pattern wins.

    ``tp_plan`` maps module FQN patterns (fnmatch, first match wins) to a tensor-parallel style
    (``tensor_parallel.py``: ``"colwise"``, ``"rowwise"`` and the sequence-parallel styles), e.g.
    ``{"blocks.*.attn.q": "colwise", "blocks.*.attn.o": "rowwise"}``. With one, the last mesh
    dimension is the TP dimension: under ``replicate`` the whole (1-D) mesh is TP (TP alone);
    under ``shard`` the mesh is ``(dp, tp)``, FSDP over dp and TP over tp."""

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
    # one group per child of every ModuleList/Sequential plus one for the remaining
    # parameters (as ``fully_shard`` per block). ``reshard_after_forward`` frees gathered
    # parameters after forward and gathers them again for backward (FSDP2's default).
    bucket_cap_mb: float = 25.0
    first_bucket_cap_mb: float = 1.0
    shard_groups: tuple[str, ...] = ()
    reshard_after_forward: bool = True
    tp_plan: tuple[tuple[str, str], ...] | Mapping[str, str] = ()

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
        self.strategy.check(self)
        overrides = self.param_placements
        overrides = tuple(overrides.items()) if isinstance(overrides, Mapping) else tuple(map(tuple, overrides))
        for pattern, placement in overrides:
            if placement not in PLACEMENTS:
                raise SpmdAotError(
                    f"param_placements[{pattern!r}] is {placement!r}; expected one of: {', '.join(PLACEMENTS)}"
                )
            self.strategy.check_override(pattern, placement)
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

    def for_model(self, model) -> "Plan":
        """This plan with its ``tp_plan`` bound to ``model`` (``tensor_parallel.resolve_tp_plan``:
        the model's own plan for ``"hf"``, transformers' base-model-relative patterns prefixed)."""
        if not self.tp_plan:
            return self
        resolved = resolve_tp_plan(self.tp_plan, model)
        return self if resolved == self.tp_plan else dataclasses.replace(self, tp_plan=resolved)

    @property
    def strategy(self) -> Placement:
        """The placement object (``placements.py``) that ``placement`` names."""
        return PLACEMENTS[self.placement]

    @property
    def tp(self) -> int:
        """Ranks of the TP mesh dimension (the last one); 0 when the plan has no TP (or one rank)."""
        return self.mesh_shape[-1] if self.tp_plan and self.world_size > 1 else 0

    @property
    def dp_size(self) -> int:
        """Ranks that see different batches: the data-parallel mesh dimensions (TP ranks share one)."""
        return self.world_size // max(self.tp, 1)

    def batch_placements(self) -> list[str]:
        """A batch leaf per mesh dimension: split on dim 0 over the data-parallel dimensions
        (each rank passes its own share), whole over TP (the TP ranks of one share pass the same)."""
        dp = len(self.mesh_shape) - (1 if self.tp else 0)
        return ["Shard(0)"] * dp + (["Replicate()"] if self.tp else [])

    def tp_style_for(self, module_fqn: str) -> TPStyle | None:
        return style_for(self.tp_plan, module_fqn) if self.tp else None

    def placement_for(self, fqn: str, shape) -> str:
        """'replicate' or 'shard' for one parameter (scalars are never sharded)."""
        for pattern, placement in self.param_placements:
            if fnmatch.fnmatchcase(fqn, pattern):
                return placement if len(shape) else "replicate"
        return self.placement if len(shape) else "replicate"

    def layout_for(self, fqn: str, shape) -> TensorLayout:
        """How parameter ``fqn`` (and optimizer state shaped like it) lies over the mesh."""
        shape = tuple(shape)
        placement = self.placement_for(fqn, shape) if self.world_size > 1 else "replicate"
        owner, _, name = fqn.rpartition(".")
        style = self.tp_style_for(owner)
        tp_dim = style.param_dims.get(name) if style is not None else None
        if tp_dim is not None and (tp_dim >= len(shape) or shape[tp_dim] % self.tp):
            raise SpmdAotError(
                f"parameter {fqn} of shape {list(shape)} cannot be split {style.name} over {self.tp} TP "
                f"ranks: its dim {tp_dim} must divide evenly; change the TP size or the tp_plan")
        return PLACEMENTS[placement].layout(self, shape, tp_dim)

    def to_dict(self) -> dict:
        """The plan's one text form: stored in manifests, hashed into the key, shown by the CLI."""
        return {"world_size": self.world_size, "placement": self.placement,
                "device_type": self.device_type, "mesh_shape": list(self.mesh_shape),
                "param_placements": [list(p) for p in self.param_placements],
                "bucket_cap_mb": self.bucket_cap_mb, "first_bucket_cap_mb": self.first_bucket_cap_mb,
                "shard_groups": list(self.shard_groups),
                "reshard_after_forward": self.reshard_after_forward,
                # only when set: plans without TP keep the text (and keys) they always had
                **({"tp_plan": [list(p) for p in self.tp_plan]} if self.tp_plan else {})}

    @classmethod
    def from_dict(cls, d: Mapping) -> "Plan":
        """Inverse of ``to_dict``; raises ``SpmdAotError`` on anything it would not have written."""
        if not isinstance(d, Mapping) or set(d) - {"tp_plan"} != set(_FIELDS) - {"tp_plan"} or \
                d.get("tp_plan", True) == []:
            raise SpmdAotError(f"a plan has exactly the fields {', '.join(_FIELDS)} (tp_plan only when not empty)")
        pairs = ("param_placements", "tp_plan")
        if not all(isinstance(d.get(f, []), list) for f in ("mesh_shape", "shard_groups", *pairs)) or \
                not all(isinstance(p, list) and len(p) == 2 and all(isinstance(x, str) for x in p)
                        for f in pairs for p in d.get(f, [])) or not isinstance(d["device_type"], str):
            raise SpmdAotError("a plan's mesh_shape, param_placements, shard_groups and tp_plan are lists")
        return cls(d["world_size"], d["placement"], d["device_type"], tuple(d["mesh_shape"]),
                   tuple(tuple(p) for p in d["param_placements"]), d["bucket_cap_mb"],
                   d["first_bucket_cap_mb"], tuple(d["shard_groups"]), d["reshard_after_forward"],
                   tuple(tuple(p) for p in d.get("tp_plan", [])))

    def describe(self) -> str:
        mesh = "x".join(map(str, self.mesh_shape))
        extra = f" +{len(self.param_placements)} overrides" if self.param_placements else ""
        extra += f" tp={self.tp}" if self.tp else ""
        return f"world={self.world_size} mesh={mesh} {self.placement}{extra} {self.device_type}"


_FIELDS = tuple(f.name for f in dataclasses.fields(Plan))

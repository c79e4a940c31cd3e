"""The options every entry point takes: ``ParallelOptions`` (how a step is spread, keyed) and
``RunOptions`` (where its entry lives, what a load trusts, which hooks a trace runs).

``spmd_aot.build``, ``spmd_aot.compile``, ``CompiledStep``, ``SPMD`` and the ``spmd-aot`` CLI all
take the same two objects, so a job passes to ``compile`` exactly what its build was given. Each
field is written once, here: its default, its documentation (``doc``, whose first sentence is the
CLI's help) and how it appears on the command line (``Flag``: the flag, its argument group, how
its text is parsed and how a value is printed back). ``cli/option_flags.py`` generates the CLI's
arguments and ``--help`` groups from these fields, ``hints.py`` prints build commands from them and
``docs/options.md`` is checked against them by a test. Adding an option is one field here (for a
``ParallelOptions`` field, with the ``Plan`` field of the same name that it becomes).

The layout follows FSDP2's public option classes (``MixedPrecisionPolicy``, ``OffloadPolicy``):
frozen values, validated when made, one documented field per choice. ``ParallelOptions`` turns
into the stored, hashed ``Plan`` in one place (``ParallelOptions.plan``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any
from collections.abc import Callable, Mapping

from .parallel.dims import PLACEMENT_NAMES
from .errors import SpmdAotError
from .parallel.mixed_precision import DTYPES, MixedPrecisionPolicy
from .parallel.pipeline_parallel import SCHEDULES, Pipeline
from .parallel.plan import Plan

__all__ = ["Flag", "ParallelOptions", "RunOptions", "option_doc", "split_options"]


@dataclasses.dataclass(frozen=True)
class Flag:
    """How one option appears on the ``spmd-aot`` command line.

    ``kind``: ``"value"`` (one ``FLAG TEXT``), ``"repeat"`` (``FLAG TEXT`` given any number of
    times; the field holds ``collect(items)``) or ``"switch"`` (a bare ``FLAG`` that sets the
    field to ``switched``). ``parse`` turns one TEXT into an item (raising ``ValueError`` with a
    message for the user); ``text`` prints an item back, so a value becomes a command line that
    parses to it again. ``commands``: the subcommands that take the flag (``"*"``: every one).
    ``placements``: the data-parallel placements that read the option (None: every one); the CLI
    applies it to those alone when a build names several. ``with_axes``: it is also every
    placement's once another axis takes a mesh dimension. ``takes_mesh_dim``: a non-default value
    of this option takes a mesh dimension (an axis beside data parallelism, e.g. tensor parallel).
    """

    flag: str
    group: str
    kind: str = "value"
    metavar: str | None = None
    short: str | None = None
    parse: Callable[[str], Any] | None = None
    choices: tuple[str, ...] | None = None
    collect: Callable[[list], Any] = tuple
    text: Callable[[Any], str] = str
    switched: Any = True
    commands: tuple[str, ...] = ("build", "explain")
    placements: tuple[str, ...] | None = None
    with_axes: bool = False
    takes_mesh_dim: bool = False
    help: str | None = None  # the --help line when the flag is not the field's first sentence (a switch off)

    def __post_init__(self):
        if self.kind not in ("value", "repeat", "switch"):
            raise ValueError(f"Flag {self.flag}: kind must be 'value', 'repeat' or 'switch', got {self.kind!r}")
        if not self.flag.startswith("--"):
            raise ValueError(f"Flag {self.flag}: a long flag starting with '--'")

    def words(self, value) -> list[str]:
        """``value`` as command-line words (empty when the flag cannot say it: a switch off)."""
        if self.kind == "switch":
            return [self.flag] if value == self.switched else []
        if self.kind == "repeat":
            items = [value] if isinstance(value, str) else list(value)
            return [w for item in items for w in (self.flag, self.text(item))]
        return [self.flag, self.text(value)]


def option(default, doc: str, flag: Flag | None = None, *, api_only: str | None = None):
    """One documented field. ``flag``: its command-line form; or ``api_only``: why it has none."""
    if (flag is None) == (api_only is None):
        raise TypeError("an option has a Flag or says why it is api_only, not both")
    metadata = {"doc": " ".join(doc.split()), "flag": flag, "api_only": api_only}
    return dataclasses.field(default=default, metadata=metadata)


def option_doc(cls, name: str) -> str:
    """The documentation of field ``name`` of an options class."""
    return next(f.metadata["doc"] for f in dataclasses.fields(cls) if f.name == name)


# ------------------------------------------------------------------ text forms (parse / print)
def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"expected a positive number, got {text!r}") from None
    if not value > 0:
        raise ValueError(f"expected a positive number, got {value}")
    return value


def _mesh_shape(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(x) for x in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"expected a mesh shape like 2x4, got {text!r}") from None
    if not shape or min(shape) < 1:
        raise ValueError(f"expected a mesh shape like 2x4, got {text!r}")
    return shape


def _pattern_pair(text: str, what: str, choices) -> tuple[str, str]:
    """``PATTERN=VALUE`` (the last ``=`` splits) with VALUE one of ``choices``."""
    pattern, sep, value = text.rpartition("=")
    if not sep or not pattern or value not in choices:
        raise ValueError(f"expected PATTERN={what} with {what} one of {', '.join(choices)}, got {text!r}")
    return pattern, value


def _param_placement(text: str) -> tuple[str, str]:
    return _pattern_pair(text, "PLACEMENT", PLACEMENT_NAMES)


def _tp_entry(text: str) -> tuple[str, str] | str:
    """``PATTERN=STYLE`` (ours or transformers' style names), or ``hf``/``auto``: the model's own plan."""
    from .parallel.tp_plan import HF_REFUSED_STYLES, HF_STYLE_NAMES, MODEL_PLAN_NAMES, STYLE_NAMES

    if text in MODEL_PLAN_NAMES:
        return text
    return _pattern_pair(text, "STYLE", [*STYLE_NAMES, *HF_STYLE_NAMES, *HF_REFUSED_STYLES])


def _tp_plan(entries: list) -> tuple | str:
    """Repeated ``--tp-plan`` entries as ``tp_plan`` takes them: pairs, or the model's own plan alone."""
    named = [e for e in entries if isinstance(e, str)]
    if named and len(entries) > 1:
        raise ValueError(f"--tp-plan {named[0]} takes the model's own plan; it cannot be combined with "
                         "other --tp-plan entries")
    return named[0] if named else tuple(entries)


def _expert_modules(entries: list) -> tuple | str:
    """Repeated ``--expert-parallel`` entries: module FQN patterns, or ``auto`` alone."""
    if "auto" in entries and len(entries) > 1:
        raise ValueError("--expert-parallel auto finds every expert module; it cannot be combined with patterns")
    return "auto" if entries == ["auto"] else tuple(entries)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"expected a positive whole number, got {text!r}") from None
    if value < 1:
        raise ValueError(f"expected a positive whole number, got {value}")
    return value


def _pair_text(pair) -> str:
    return f"{pair[0]}={pair[1]}"


def _dtype_text(dtype) -> str:
    return next(name for name, d in DTYPES.items() if d is dtype)


def _x_text(shape) -> str:
    return "x".join(map(str, shape))


# --------------------------------------------------------------------------- the options
_DP, _TP, _COMM, _MP = "data parallel", "tensor parallel", "communication", "mixed precision"
_CACHE, _PP = "cache and trust", "pipeline parallel"
_POLICY_FIELDS = ("param_dtype", "reduce_dtype", "output_dtype", "cast_forward_inputs")
# a pipeline is its own entry kind (``parallel/pipeline_parallel.py``), not a ``Plan``: these fields
# become a ``Pipeline`` (``ParallelOptions.pipeline``), keyed with it
_PIPELINE_FIELDS = ("pipeline_stages", "microbatches", "schedule", "stages_per_rank", "split_points")
_BUILD_ONLY = ("build",)  # ``explain`` looks up whole-step entries only


@dataclasses.dataclass(frozen=True)
class ParallelOptions:
    """How a step is spread over ranks: placement, mesh, tensor-parallel plan, communication and
    mixed precision. Keyed: with the world size and device type it is the stored ``Plan``
    (``plan``), so a job compiles with the options its build was given. Validated when made."""

    placement: str = option("replicate", """How parameters lie over the data-parallel ranks: 'replicate' or
        'shard'. 'replicate' keeps them whole on every rank and averages gradients (DDP); 'shard' keeps a
        shard per rank, gathered for compute, and reduce-scatters gradients (FSDP2's fully_shard).""",
        Flag("--placement", _DP, short="-p", choices=PLACEMENT_NAMES, metavar="PLACEMENT"))
    mesh_shape: tuple[int, ...] | None = option(None, """The device mesh's shape, e.g. (2, 4), 2x4 on the
        command line; default: one dimension of every rank. Data-parallel dimensions come first, then one
        per other axis: under 'shard' a 2-D mesh RxS is R replicas of S shards (HSDP); with a tp_plan the
        last dimension is tensor parallel (DPxTP: DDP x TP under 'replicate', FSDP x TP under 'shard';
        RxSxTP: HSDP x TP).""",
        Flag("--mesh-shape", _DP, metavar="RxS", parse=_mesh_shape, text=_x_text, placements=("shard",),
             with_axes=True))
    param_placements: tuple[tuple[str, str], ...] = option((), """Placements of single parameters, by FQN
        pattern. Each entry is (fnmatch pattern, placement) and the first match wins, e.g. '*.bias' ->
        'replicate' keeps biases whole under 'shard'.""",
        Flag("--param-placement", _DP, "repeat", "PATTERN=PLACEMENT", parse=_param_placement, text=_pair_text,
             placements=("shard",)))
    bucket_cap_mb: float = option(25.0, """Gradient bucket size in MiB under 'replicate'. Gradients are
        averaged in flat buckets of at most this size, as DDP's bucket_cap_mb.""",
        Flag("--bucket-cap-mb", _COMM, metavar="MIB", parse=_positive_float, text=repr))
    first_bucket_cap_mb: float = option(1.0, """Size in MiB of the first gradient bucket under 'replicate'.
        A small first bucket starts the first all_reduce early in backward, as DDP does.""",
        Flag("--first-bucket-cap-mb", _COMM, metavar="MIB", parse=_positive_float, text=repr))
    shard_groups: tuple[str, ...] = option((), """Communication groups under 'shard', one FQN pattern each.
        A group's parameters are gathered and their gradients reduce-scattered together (a parameter joins
        the first group that matches); default: one group per block of every ModuleList, Sequential and
        ModuleDict, as fully_shard per block.""",
        Flag("--shard-group", _DP, "repeat", "PATTERN", placements=("shard",)))
    reshard_after_forward: bool = option(True, """Under 'shard', free gathered parameters after forward.
        They are gathered again for backward (FSDP2's default); False keeps them from forward to backward:
        more memory, fewer all_gathers.""",
        Flag("--keep-params-after-forward", _DP, "switch", switched=False, placements=("shard",),
             help="Under 'shard', keep gathered parameters from forward to backward instead of gathering "
                  "them again (reshard_after_forward=False)."))
    tp_plan: tuple[tuple[str, str], ...] | str = option((), """Tensor parallel: module FQN patterns and the
        style each runs. Entries are (fnmatch pattern, style), first match wins: 'colwise', 'rowwise' or a
        sequence-parallel style (docs/parallelism.md), e.g. 'blocks.*.attn.q' -> 'colwise'; or 'hf': a
        transformers model's own plan (config.base_model_tp_plan). TP takes the last mesh dimension, or
        the whole world without a mesh_shape (placement 'replicate').""",
        Flag("--tp-plan", _TP, "repeat", "PATTERN=STYLE", parse=_tp_entry, collect=_tp_plan, text=lambda e:
             e if isinstance(e, str) else _pair_text(e), takes_mesh_dim=True))
    context_parallel: bool = option(False, """Context parallel: split the batch's sequence over a 'cp' mesh
        dimension. The sequence is dim 1 of every batch tensor; the 'cp' dimension comes after the data-parallel
        ones and before TP; the split is load-balanced for causal attention, with scaled_dot_product_attention
        computed over the whole sequence (docs/context_parallel.md); its size is that dimension's, e.g. mesh_shape
        DPxCPxTP.""",
        Flag("--context-parallel", "context parallel", "switch", takes_mesh_dim=True))
    context_parallel_buffers: tuple[str, ...] = option((), """Context parallel: buffers whose dim 0 is the
        sequence, cut as the batch is. FQN patterns (fnmatch) of read-only buffers the model slices by its
        input's length, e.g. a RoPE table 'freqs_cis' of exactly the batch's sequence length, as torch's
        context_parallel(buffers=...) shards them.""",
        Flag("--context-parallel-buffer", "context parallel", "repeat", "PATTERN"))
    expert_parallel: tuple[str, ...] | str = option((), """Expert parallel: the mixture-of-experts modules whose
        experts split over an 'ep' mesh dimension. The 'ep' dimension comes after the data-parallel ones and before
        TP, tokens exchanged with all-to-all (docs/expert_parallel.md): module FQN patterns, or 'auto' (every module
        with a num_experts whose parameters are stacked per expert, as transformers' MoE experts); its size is that
        dimension's, e.g. mesh_shape DPxEPxTP.""",
        Flag("--expert-parallel", "expert parallel", "repeat", "PATTERN", collect=_expert_modules,
             takes_mesh_dim=True))
    expert_capacity_factor: float | None = option(None, """Expert parallel: a capacity factor that bounds each
        expert's tokens. Each expert takes at most ceil(factor * tokens * top_k / experts) of a rank's (token,
        choice) pairs per step and drops the rest, as Switch Transformer and GShard do; default: capacity for every
        pair, so no token is dropped and results equal the unsplit model's.""",
        Flag("--expert-capacity-factor", "expert parallel", metavar="FACTOR", parse=_positive_float, text=repr))
    param_dtype: Any = option(None, """Mixed precision: the dtype parameters compute in (bf16, fp16, fp32).
        The parameters the optimizer updates keep their own dtype, as FSDP2's param_dtype.""",
        Flag("--param-dtype", _MP, metavar="DTYPE", choices=tuple(DTYPES), text=_dtype_text))
    reduce_dtype: Any = option(None, """Mixed precision: the dtype gradients are averaged in. Default: the
        param_dtype; the averaged gradient is cast to the parameter's dtype, as FSDP2's reduce_dtype.""",
        Flag("--reduce-dtype", _MP, metavar="DTYPE", choices=tuple(DTYPES), text=_dtype_text))
    output_dtype: Any = option(None, """Mixed precision: the dtype the model's floating-point outputs are cast
        to. As FSDP2's output_dtype.""",
        Flag("--output-dtype", _MP, metavar="DTYPE", choices=tuple(DTYPES), text=_dtype_text))
    cast_forward_inputs: bool = option(True, """Mixed precision: cast the model's floating-point inputs to the
        param_dtype. As FSDP2's cast_forward_inputs; False leaves them in their dtype.""",
        Flag("--no-cast-forward-inputs", _MP, "switch", switched=False,
             help="Mixed precision: leave the model's floating-point inputs in their dtype "
                  "(cast_forward_inputs=False)."))

    pipeline_stages: int = option(1, """Pipeline parallel: the number of stages the model is cut into. Each
        stage runs on its own ranks of a first 'pp' mesh dimension, before the others: the world is
        pipeline_stages (over stages_per_rank) x the ranks of mesh_shape (a stage's data-parallel replicas,
        then its TP ranks with a tp_plan), and the step is the loss function (docs/pipeline_parallel.md).""",
        Flag("--pipeline-stages", _PP, metavar="N", parse=_positive_int, commands=_BUILD_ONLY))
    microbatches: int = option(1, """Pipeline parallel: the micro-batches each step's batch is split into on
        dim 0. Every stage runs a forward and a backward per micro-batch; gradients are the mean over them.""",
        Flag("--microbatches", _PP, metavar="N", parse=_positive_int, commands=_BUILD_ONLY))
    schedule: str = option("gpipe", """Pipeline parallel: the order of micro-batch forwards and backwards,
        'gpipe', '1f1b' or 'interleaved_1f1b'. As torch.distributed.pipelining's ScheduleGPipe, Schedule1F1B and
        ScheduleInterleaved1F1B; keyed as data.""",
        Flag("--schedule", _PP, metavar="SCHEDULE", choices=SCHEDULES, commands=_BUILD_ONLY))
    stages_per_rank: int = option(1, """Pipeline parallel: stages each 'pp' rank runs, under schedule
        'interleaved_1f1b'. Rank r runs stages r, r + P, ... of the P = pipeline_stages / stages_per_rank ranks (as
        ScheduleInterleaved1F1B's looped stages).""",
        Flag("--stages-per-rank", _PP, metavar="V", parse=_positive_int, commands=_BUILD_ONLY))
    split_points: tuple[str, ...] = option((), """Pipeline parallel: the module FQNs that begin stages 1 and
        later, in forward order. pipeline_stages - 1 of them, as pipeline()'s SplitPoint.BEGINNING; default: the
        model's repeated blocks cut where the stages' parameter counts come nearest to equal.""",
        Flag("--split-point", _PP, "repeat", "FQN", commands=_BUILD_ONLY))

    def __post_init__(self):
        # dtypes by name or torch dtype, checked as FSDP2's policy (fp16 reductions refused)
        policy = MixedPrecisionPolicy(*(getattr(self, f) for f in _POLICY_FIELDS))
        for name in _POLICY_FIELDS:
            object.__setattr__(self, name, getattr(policy, name))
        mesh = tuple(self.mesh_shape) if self.mesh_shape else None
        # the checks that need no world size run now; a plan over the mesh's own ranks normalizes
        checked = self.plan(math.prod(mesh) if mesh else 1, mesh_shape=mesh)
        object.__setattr__(self, "mesh_shape", mesh)
        for name in ("param_placements", "bucket_cap_mb", "first_bucket_cap_mb", "shard_groups",
                     "context_parallel_buffers"):
            object.__setattr__(self, name, getattr(checked, name))
        if not isinstance(self.tp_plan, str):  # a string names the model's own plan, bound per model
            object.__setattr__(self, "tp_plan", checked.tp_plan)
        object.__setattr__(self, "split_points", (self.split_points,) if isinstance(self.split_points, str)
                           else tuple(self.split_points))
        self.pipeline()  # the pipeline fields' checks that need no world size

    def pipeline(self, world_size: int | None = None) -> Pipeline | None:
        """The ``Pipeline`` these options ask for (None when ``pipeline_stages`` is 1): its stages,
        schedule, placement over a stage's replicas and TP inside the stages. ``world_size`` checks
        the world against ``mesh_shape`` and sizes TP when no ``mesh_shape`` gives it."""
        if self.pipeline_stages == 1:
            stray = [f for f in _PIPELINE_FIELDS[1:] if getattr(self, f) != _DEFAULTS[f]]
            if stray:
                raise SpmdAotError(f"{stray[0]}={getattr(self, stray[0])!r} is set without pipeline_stages; "
                                   "set pipeline_stages=N (2 or more) or drop it")
            return None
        unsupported = [f for f in _NOT_WITH_PIPELINES if getattr(self, f) != _DEFAULTS[f]]
        if isinstance(self.tp_plan, str):
            unsupported.insert(0, "tp_plan")
        if unsupported:
            raise SpmdAotError(
                f"pipeline_stages={self.pipeline_stages} does not combine with {unsupported[0]}="
                f"{getattr(self, unsupported[0])!r} (docs/pipeline_parallel.md lists what a pipeline supports); "
                f"drop {unsupported[0]}" + (" or name the modules (PATTERN=STYLE)" if unsupported[0] == "tp_plan" else ""))
        if self.mesh_shape and len(self.mesh_shape) > (2 if self.tp_plan else 1):
            raise SpmdAotError(
                f"pipeline_stages={self.pipeline_stages} with mesh_shape {_x_text(self.mesh_shape)}: a pipeline "
                "stage's mesh is its data-parallel replicas, then its TP ranks with a tp_plan (DP or DPxTP); "
                "HSDP inside a stage is not supported")
        per_stage = math.prod(self.mesh_shape) if self.mesh_shape else None
        if world_size is not None:
            ranks = max(self.pipeline_stages // self.stages_per_rank, 1)  # the 'pp' dimension
            if per_stage is not None and world_size != ranks * per_stage:
                raise SpmdAotError(
                    f"{ranks} pipeline ranks x mesh_shape {_x_text(self.mesh_shape)} is {ranks * per_stage} ranks, "
                    f"but the world size is {world_size}; the mesh_shape of a pipeline is one stage's (its "
                    "replicas, then its TP ranks)")
            per_stage = per_stage or max(world_size // ranks, 1)
        tp = 1
        if self.tp_plan:
            tp = self.mesh_shape[-1] if self.mesh_shape else per_stage
            if tp is None:  # no world size yet: a placeholder TP size for the checks that need none
                tp = 2
        return Pipeline(self.pipeline_stages, self.microbatches, self.schedule, self.split_points, self.placement,
                        tp, self.tp_plan, self.stages_per_rank)

    @property
    def mixed_precision(self) -> MixedPrecisionPolicy | None:
        """The four mixed-precision fields as a policy; None when it casts nothing."""
        return MixedPrecisionPolicy.of(MixedPrecisionPolicy(*(getattr(self, f) for f in _POLICY_FIELDS)))

    def plan(self, world_size: int, device_type: str = "cpu", **replace) -> Plan:
        """The configuration these options give at ``world_size`` ranks of ``device_type``: the one
        place options become the stored, hashed ``Plan`` (a field here is the Plan field of its name)."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                  if f.name not in _POLICY_FIELDS + _PIPELINE_FIELDS}
        values.update(replace)
        return Plan(world_size, device_type=device_type, mixed_precision=self.mixed_precision, **values)

    @classmethod
    def from_plan(cls, plan: Plan) -> ParallelOptions:
        """The options that give ``plan`` (at its world size and device type)."""
        policy = plan.mixed_precision or MixedPrecisionPolicy()
        mesh = plan.mesh_shape if len(plan.mesh_shape) > 1 else None
        values = {f.name: getattr(plan, f.name) for f in dataclasses.fields(cls)
                  if f.name not in _POLICY_FIELDS + _PIPELINE_FIELDS and f.name != "mesh_shape"}
        return cls(mesh_shape=mesh, **values, **{f: getattr(policy, f) for f in _POLICY_FIELDS})

    @classmethod
    def of(cls, options: ParallelOptions | None = None, *, comm=None, mixed_precision=None,
           **fields) -> ParallelOptions:
        """``options``, or options made from keywords: this class's fields, and the spellings
        ``comm=Comm(...)`` (its communication fields) and ``mixed_precision=`` (a policy, ours or
        FSDP2's, or a mapping) for the four mixed-precision fields."""
        if options is not None:
            if not isinstance(options, ParallelOptions):
                raise TypeError(f"expected a spmd_aot.ParallelOptions, got {type(options).__name__}")
            given = sorted([*fields, *(["comm"] if comm is not None else []),
                            *(["mixed_precision"] if mixed_precision is not None else [])])
            if given:
                raise TypeError(f"pass {', '.join(given)} in the ParallelOptions, not beside it")
            return options
        if comm is not None:
            clash = sorted(set(fields) & {f.name for f in dataclasses.fields(comm)})
            if clash:
                raise TypeError("pass the communication options as comm=Comm(...) or as keywords, not both")
            fields.update(dataclasses.asdict(comm))
        if mixed_precision is not None:
            clash = sorted(set(fields) & set(_POLICY_FIELDS))
            if clash:
                raise TypeError(f"pass mixed_precision= or {', '.join(clash)}, not both")
            policy = MixedPrecisionPolicy.of(mixed_precision) or MixedPrecisionPolicy()
            fields.update({f: getattr(policy, f) for f in _POLICY_FIELDS})
        return cls(**fields)

    @classmethod
    def for_placement(cls, placement: str, **fields) -> ParallelOptions:
        """Options for ``placement`` from ``fields``, leaving out those only other placements read
        (``Flag.placements``): what the CLI builds when one command names several placements."""
        read = cls.read_by(placement, fields)
        return cls(placement=placement, **{name: value for name, value in fields.items() if name in read})

    @classmethod
    def read_by(cls, placement: str, fields: Mapping) -> set[str]:
        """The names among ``fields`` (field values) that ``placement`` reads (``Flag.placements``;
        ``Flag.with_axes`` ones too when another axis takes a mesh dimension)."""
        axes = any(f.metadata["flag"].takes_mesh_dim and fields.get(f.name, f.default) != f.default
                   for f in dataclasses.fields(cls))
        return {f.name for f in dataclasses.fields(cls)
                if f.name in fields and applies(f.metadata["flag"], placement, axes)}

    def words(self, skip: tuple[str, ...] = ()) -> list[str]:
        """The command-line words that give these options: fields not at their default that
        this placement reads (``for_placement`` keeps the same ones), except ``skip``."""
        axes = any(f.metadata["flag"].takes_mesh_dim and getattr(self, f.name) != f.default
                   for f in dataclasses.fields(self))
        return [w for f in dataclasses.fields(self)
                if f.name not in skip and getattr(self, f.name) != f.default
                and applies(f.metadata["flag"], self.placement, axes)
                for w in f.metadata["flag"].words(getattr(self, f.name))]


_DEFAULTS = {f.name: f.default for f in dataclasses.fields(ParallelOptions)}
# options a pipeline does not read: refused beside pipeline_stages rather than silently ignored
_NOT_WITH_PIPELINES = ("param_placements", "bucket_cap_mb", "first_bucket_cap_mb", "shard_groups",
                       "reshard_after_forward", "context_parallel", "context_parallel_buffers", "expert_parallel",
                       "expert_capacity_factor", *_POLICY_FIELDS)


def applies(flag: Flag, placement: str, other_axes: bool) -> bool:
    """Whether ``placement`` reads the option of ``flag`` (``other_axes``: another axis takes a
    mesh dimension)."""
    return flag.placements is None or placement in flag.placements or (flag.with_axes and other_axes)


@dataclasses.dataclass(frozen=True)
class RunOptions:
    """Where a step's entry is stored and found, what a load may trust, and what a trace runs
    beside the step. Pass a job's ``compile`` the same as its build: ``kernels``, the hooks and
    ``extra_sources`` are part of the key; the others are how to reach and trust the cache."""

    cache_dir: Any = option(None, """The cache directory, or a store URL such as s3://bucket/prefix. A URL
        is written through a local cache; default: $SPMD_AOT_CACHE_DIR, else $XDG_CACHE_HOME/spmd_aot, else
        ~/.cache/spmd_aot.""",
        Flag("--cache-dir", _CACHE, metavar="DIR", commands=("*",)))
    trust_cache: bool | None = option(None, """Use a cache directory other users can write, without a signing
        key. As $SPMD_AOT_TRUST_CACHE=1 (read when this is None); docs/security.md.""",
        Flag("--trust-cache", _CACHE, "switch", commands=("*",)))
    allow_ops: tuple[str, ...] = option((), """Operator overloads beyond the op allowlist that stored graphs
        may call, as 'namespace::op.overload'. As $SPMD_AOT_ALLOW_OPS; every job loading such an entry must
        opt in to the same ones.""",
        Flag("--allow-op", _CACHE, "repeat", "OP", commands=("*",)))
    kernels: bool = option(False, """Also compile the graph with Inductor into the entry. Its kernels are
        native code: they run only from a signed entry or a trusted cache, else the interpreted graph runs;
        keyed.""",
        Flag("--kernels", "what to build", "switch"))
    store: Any = option(None, """An open store (store/protocol.py) to use instead of cache_dir.""",
                        api_only="an object; --cache-dir takes store URLs")
    require_hit: bool = option(False, """Raise CacheMissError at a job's first call instead of tracing. For
        jobs whose entries must have been built ahead of time.""", api_only="a build traces on a miss")
    module_override: tuple = option((), """Override objects that swap untraceable submodules while tracing.
        They may patch the traced graph after (tracing/override.py); keyed.""", api_only="Python objects")
    gm_transformation: Callable | None = option(None, """A function applied to the traced graph module
        before it is stored. See tracing/override.py; keyed by its code.""", api_only="a Python function")
    extra_sources: tuple = option((), """Further modules, functions or files whose source the key covers.
        For code the step reaches that the key cannot see.""", api_only="Python objects")

    def __post_init__(self):
        for name in ("allow_ops", "module_override", "extra_sources"):
            value = getattr(self, name)
            object.__setattr__(self, name, (value,) if isinstance(value, str) else tuple(value))
        for name in ("kernels", "require_hit"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"RunOptions.{name} must be True or False, got {getattr(self, name)!r}")


_LEGACY = ("comm", "mixed_precision")


def split_options(parallel: ParallelOptions | None, run: RunOptions | None, keywords: Mapping,
                  where: str) -> tuple[ParallelOptions, RunOptions]:
    """The two options objects of an entry point called as ``where(..., parallel, run, **keywords)``:
    keywords naming a field are the convenience spelling of the object they belong to (and may
    not be given beside that object)."""
    parallel_names = {f.name for f in dataclasses.fields(ParallelOptions)} | set(_LEGACY)
    run_names = {f.name for f in dataclasses.fields(RunOptions)}
    unknown = sorted(set(keywords) - parallel_names - run_names)
    if unknown:
        raise TypeError(f"{where}() got unknown option(s) {', '.join(unknown)}; options are the fields of "
                        "spmd_aot.ParallelOptions and spmd_aot.RunOptions (docs/options.md)")
    run_keywords = {k: v for k, v in keywords.items() if k in run_names}
    if run is not None:
        if not isinstance(run, RunOptions):
            raise TypeError(f"{where}() run must be a spmd_aot.RunOptions, got {type(run).__name__}")
        if run_keywords:
            raise TypeError(f"{where}(): pass {', '.join(sorted(run_keywords))} in the RunOptions, not beside it")
    else:
        run = RunOptions(**run_keywords)
    try:
        parallel = ParallelOptions.of(parallel, **{k: v for k, v in keywords.items() if k in parallel_names})
    except TypeError as exc:
        raise TypeError(f"{where}(): {exc}") from None
    return parallel, run

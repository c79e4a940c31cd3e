"""Pipeline parallelism as a value: where the model is split into stages, and the schedule.

A pipeline-parallel step runs each stage's forward and backward once per micro-batch (the
step's batch split on dim 0), passing activations forward and their gradients back between the
ranks of neighbouring stages. Which stage does what, in which order, is decided before the first
step, so it is *data*: a list of ``(action, micro-batch)`` per stage, stored in the artifact and
hashed into the key, which the runtime (``runtime/pipeline_schedule.py``) executes as written.

The schedules are torch.distributed.pipelining's, action for action:

- ``gpipe`` (``ScheduleGPipe``): every forward, then every backward, in micro-batch order.
- ``1f1b`` (``Schedule1F1B``): stage ``s`` of ``S`` runs ``min(n, S - s)`` forwards, then
  alternates one backward and one forward while forwards remain, then the remaining backwards;
  fewer activations are held at once than under GPipe.
- ``interleaved_1f1b`` (``ScheduleInterleaved1F1B``): each of ``P`` ranks runs
  ``stages_per_rank`` (``v``) stages, rank ``r`` stages ``r, r + P, ...`` (looped); forwards go
  through the rank's stages in rounds of ``n / max(1, n // P)`` micro-batches, backwards through
  them in reverse; ``(v - 1) * round + 2 * (P - 1 - r)`` warm-up forwards, then one forward and
  one backward at a time, then the remaining backwards. The bubble shrinks by about ``v``.

Both accumulate each parameter's gradient over the micro-batches in micro-batch order and
divide it by ``n`` once at the end (torch's ``scale_grads=True``), so the update is the one of
the mean of the micro-batch losses.

Split points are module FQNs, each the *first* module of a new stage (``SplitPoint.BEGINNING``,
as ``pipeline(split_spec=...)`` takes them); with none, ``even_split_points`` picks them so the
stages hold about equal parameter counts.

Tensor parallelism inside a stage (``tp > 1`` with a ``tp_plan``, in ``tensor_parallel.py``'s
vocabulary) splits each stage's planned modules over ``tp`` ranks: the mesh is ``(pp, dp, tp)``
in row-major order, and the stage graphs compute on TP-local parameters with the TP collectives
in them, one graph for every TP rank of the stage.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from ..errors import SpmdAotError

__all__ = ["Pipeline", "SCHEDULES", "schedule_actions", "rank_actions", "even_split_points", "timeline", "bubble_fraction",
           "in_flight_peak"]

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")


@dataclasses.dataclass(frozen=True)
class Pipeline:
    """``stages`` pipeline stages, one per rank of the ``pp`` mesh dimension (``stages_per_rank``
    per rank under ``interleaved_1f1b``); ``microbatches`` per step; ``schedule`` one of
    ``SCHEDULES``; ``split_points`` the FQNs of the modules that begin stages 1.. (``stages - 1``
    of them), or empty for an even split by parameter count; ``placement`` how each stage lies
    over its data-parallel replicas when the world size is a multiple of the ``pp`` ranks;
    ``tp`` and ``tp_plan`` tensor parallel inside each stage (the mesh's last dimension)."""

    stages: int = 2
    microbatches: int = 2
    schedule: str = "gpipe"
    split_points: tuple[str, ...] = ()
    # how a stage lies over its data-parallel replicas (world size / stages ranks):
    # "replicate" (DDP: whole parameters, gradients averaged) or "shard" (FSDP2: parameters
    # Shard(0) DTensors, gathered for the step, gradients reduce-scattered)
    placement: str = "replicate"
    # tensor parallel inside each stage: ``tp`` ranks per stage replica (the last mesh
    # dimension) and the plan of module FQN patterns -> styles (``parallel/tensor_parallel.py``)
    tp: int = 1
    tp_plan: tuple[tuple[str, str], ...] = ()
    # stages each pp rank runs (``interleaved_1f1b``): rank r runs stages r, r + P, ... (P = stages / this)
    stages_per_rank: int = 1

    def __post_init__(self):
        for name in ("stages", "microbatches", "tp", "stages_per_rank"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise SpmdAotError(f"Pipeline({name}={value!r}): a positive integer is needed")
        schedule = str(self.schedule).lower()
        if schedule not in SCHEDULES:
            raise SpmdAotError(f"Pipeline(schedule={self.schedule!r}): expected one of {', '.join(SCHEDULES)}")
        object.__setattr__(self, "schedule", schedule)
        points = (self.split_points,) if isinstance(self.split_points, str) else tuple(self.split_points)
        if not all(isinstance(p, str) and p for p in points):
            raise SpmdAotError(f"Pipeline(split_points={self.split_points!r}): module FQNs are needed")
        if points and len(points) != self.stages - 1:
            raise SpmdAotError(
                f"Pipeline(split_points={points!r}) names {len(points)} split point(s) for {self.stages} stages; "
                f"name {self.stages - 1} (each the first module of a stage after the first) or none for an even split")
        object.__setattr__(self, "split_points", points)
        if self.placement not in ("replicate", "shard"):
            raise SpmdAotError(f"Pipeline(placement={self.placement!r}): expected 'replicate' (DDP over a stage's "
                               "replicas) or 'shard' (FSDP2)")
        object.__setattr__(self, "tp_plan", _tp_plan(self.tp_plan))
        v = self.stages_per_rank
        if (schedule == "interleaved_1f1b") != (v > 1):
            raise SpmdAotError(
                f"Pipeline(schedule={schedule!r}, stages_per_rank={v}): several stages per rank run under "
                "'interleaved_1f1b' only, and it needs stages_per_rank of 2 or more")
        if v > 1 and (self.stages % v or self.stages // v < 2):
            raise SpmdAotError(f"Pipeline(stages={self.stages}, stages_per_rank={v}): the stages split evenly over 2 "
                               f"or more ranks; use a multiple of {v} stages, at least {2 * v}")
        if v > 1 and self.microbatches % max(1, self.microbatches // self.ranks):
            raise SpmdAotError(
                f"Pipeline(microbatches={self.microbatches}) under interleaved_1f1b over {self.ranks} ranks: the "
                f"micro-batches split into rounds of about {self.ranks} (as ScheduleInterleaved1F1B); use a multiple "
                f"of {self.ranks}, or fewer micro-batches than ranks")
        if (self.tp > 1) != bool(self.tp_plan):
            raise SpmdAotError(
                f"Pipeline(tp={self.tp}, tp_plan={self.tp_plan!r}): tensor parallel inside the stages needs both a "
                "tp of 2 or more ranks and a tp_plan naming the modules it splits (or neither)")

    def to_dict(self) -> dict:
        """The text form stored in the manifest and hashed into the key (the schedule itself too)."""
        d = {"stages": self.stages, "microbatches": self.microbatches, "schedule": self.schedule,
             "split_points": list(self.split_points), "placement": self.placement,
             "actions": [[f"{a}{m}" for a, m in acts] for acts in schedule_actions(self)]}
        if self.tp > 1:  # only then: entries without TP keep the form they had
            d.update(tp=self.tp, tp_plan=[list(entry) for entry in self.tp_plan])
        if self.stages_per_rank > 1:  # each rank's order across its stages
            d.update(stages_per_rank=self.stages_per_rank,
                     rank_actions=[[f"{a}{m}@{s}" for a, s, m in acts] for acts in rank_actions(self)])
        return d

    @property
    def ranks(self) -> int:
        """The size of the ``pp`` mesh dimension: ranks running stages, ``stages / stages_per_rank``."""
        return self.stages // self.stages_per_rank

    def rank_of(self, stage: int) -> int:
        """The ``pp`` rank that runs ``stage`` (looped: stage ``s`` on rank ``s % ranks``)."""
        return stage % self.ranks

    @classmethod
    def from_dict(cls, d) -> Pipeline:
        if not isinstance(d, dict) or not isinstance(d.get("split_points"), list):
            raise SpmdAotError("a stored pipeline is a map with stages, microbatches, schedule and split_points")
        tp_plan = d.get("tp_plan", [])
        if not isinstance(tp_plan, list) or not all(isinstance(e, list) for e in tp_plan):
            raise SpmdAotError("a stored pipeline's tp_plan is a list of [pattern, style] pairs")
        return cls(d.get("stages"), d.get("microbatches"), d.get("schedule"), tuple(d["split_points"]),
                   d.get("placement"), d.get("tp", 1), tuple(map(tuple, tp_plan)), d.get("stages_per_rank", 1))

    def describe(self) -> str:
        shard = " (stages sharded over their replicas)" if self.placement == "shard" else ""
        tp = f", tp={self.tp} inside each stage" if self.tp > 1 else ""
        looped = f" ({self.stages_per_rank} per rank on {self.ranks} ranks)" if self.stages_per_rank > 1 else ""
        return f"pp={self.stages}{looped} {self.schedule} x{self.microbatches} micro-batches{shard}{tp}"


def _tp_plan(tp_plan) -> tuple[tuple[str, str], ...]:
    """``tp_plan`` as (pattern, style name) pairs, transformers' style names mapped."""
    from collections.abc import Mapping

    from .tp_plan import style_name

    if isinstance(tp_plan, str):
        raise SpmdAotError(f"Pipeline(tp_plan={tp_plan!r}): name the modules, {{PATTERN: STYLE, ...}}; a "
                           "model's own plan by name is not supported inside pipeline stages")
    pairs = tuple(tp_plan.items()) if isinstance(tp_plan, Mapping) else tuple(map(tuple, tp_plan))
    for entry in pairs:
        if len(entry) != 2 or not all(isinstance(v, str) for v in entry):
            raise SpmdAotError(f"Pipeline(tp_plan=...): entries are (module FQN pattern, style) pairs, got {entry!r}")
    return tuple((pattern, style_name(pattern, style)) for pattern, style in pairs)


def schedule_actions(pipeline: Pipeline) -> list[list[tuple[str, int]]]:
    """Per stage, its ``("F" | "B", micro-batch)`` actions in the order it runs them."""
    n, stages = pipeline.microbatches, pipeline.stages
    if pipeline.stages_per_rank > 1:  # each stage's share of its rank's order
        out: list[list[tuple[str, int]]] = [[] for _ in range(stages)]
        for acts in rank_actions(pipeline):
            for action, stage, m in acts:
                out[stage].append((action, m))
        return out
    out = []
    for s in range(stages):
        if pipeline.schedule == "gpipe":
            out.append([("F", m) for m in range(n)] + [("B", m) for m in range(n)])
            continue
        warmup = min(n, stages - s)
        acts = [("F", m) for m in range(warmup)]
        forward, backward = warmup, 0
        while forward < n:
            acts += [("B", backward), ("F", forward)]
            forward, backward = forward + 1, backward + 1
        acts += [("B", m) for m in range(backward, n)]
        out.append(acts)
    return out


def rank_actions(pipeline: Pipeline) -> list[list[tuple[str, int, int]]]:
    """Per ``pp`` rank, its ``("F" | "B", stage, micro-batch)`` actions in the order it runs them
    (one stage per rank: that stage's ``schedule_actions``; ``interleaved_1f1b``: torch's
    ``ScheduleInterleaved1F1B`` order, action for action)."""
    if pipeline.stages_per_rank == 1:
        return [[(a, s, m) for a, m in acts] for s, acts in enumerate(schedule_actions(pipeline))]
    n, v, ranks = pipeline.microbatches, pipeline.stages_per_rank, pipeline.ranks
    per_round = n // max(1, n // ranks)
    out = []
    for r in range(ranks):
        warmup = min((v - 1) * per_round + 2 * (ranks - 1 - r), n * v)
        steady = n * v - warmup
        forwards, backwards = [0] * pipeline.stages, [0] * pipeline.stages
        acts: list[tuple[str, int, int]] = []

        def forward(op, acts=acts, forwards=forwards, r=r):
            stage = (op // per_round) % v * ranks + r
            acts.append(("F", stage, forwards[stage]))
            forwards[stage] += 1

        def backward(op, acts=acts, backwards=backwards, r=r, warmup=warmup):
            stage = (v - 1 - (op - warmup) // per_round % v) * ranks + r
            acts.append(("B", stage, backwards[stage]))
            backwards[stage] += 1
        for op in range(warmup + steady + warmup):
            if op < warmup:
                forward(op)
            elif op < warmup + steady:
                forward(op)
                backward(op)
            else:
                backward(op)
        out.append(acts)
    return out


def _simulate(pipeline: Pipeline) -> list[list[tuple[int, str, int, int]]]:
    """Per ``pp`` rank, ``(tick, action, stage, micro-batch)``: every action takes one tick (a
    backward as long as a forward), starts when its rank is free and its input arrived (the
    previous stage's forward of the micro-batch, the next stage's backward of it)."""
    acts = rank_actions(pipeline)
    last = pipeline.stages - 1
    done: dict[tuple[int, str, int], int] = {}  # (stage, action, mb) -> tick it finished
    position, free = [0] * len(acts), [0] * len(acts)
    out: list[list[tuple[int, str, int, int]]] = [[] for _ in acts]
    remaining = sum(map(len, acts))
    while remaining:
        progressed = False
        for r, r_acts in enumerate(acts):
            if position[r] == len(r_acts):
                continue
            action, s, m = r_acts[position[r]]
            needs = (s - 1, "F", m) if action == "F" else (s + 1, "B", m)
            if action == "B" and s == last:
                needs = (s, "F", m)
            if action == "F" and s == 0:
                needs = None
            if needs is not None and needs not in done:
                continue
            start = max(free[r], done[needs] if needs is not None else 0)
            done[(s, action, m)] = free[r] = start + 1
            out[r].append((start, action, s, m))
            position[r] += 1
            remaining -= 1
            progressed = True
        if not progressed:
            raise AssertionError(f"schedule {pipeline.schedule} deadlocks")
    return out


def timeline(pipeline: Pipeline) -> list[str]:
    """One text line per stage (per rank with several stages per rank), one column per tick:
    ``F3`` a forward of micro-batch 3, ``B3`` its backward (``F3/5``: of stage 5), ``.`` idle
    (the bubble)."""
    runs = _simulate(pipeline)
    ticks = max(t for rank in runs for t, _, _, _ in rank) + 1
    looped = pipeline.stages_per_rank > 1
    width = len(str(pipeline.microbatches - 1)) + 1 + (len(str(pipeline.stages - 1)) + 1 if looped else 0)
    lines = []
    for r, rank in enumerate(runs):
        cells = ["." * width] * ticks
        for t, action, s, m in rank:
            cells[t] = (f"{action}{m}/{s}" if looped else f"{action}{m}").ljust(width)
        lines.append(f"{'rank' if looped else 'stage'} {r}: " + " ".join(cells))
    return lines


def bubble_fraction(pipeline: Pipeline) -> float:
    """The idle share of rank-ticks over the step (equal forward and backward times): for
    GPipe and 1F1B alike ``(S - 1) / (n + S - 1)``; with ``v`` stages per rank each action is
    one stage's, ``1 / v`` of a rank's model share."""
    runs = _simulate(pipeline)
    ticks = max(t for rank in runs for t, _, _, _ in rank) + 1
    busy = sum(len(rank) for rank in runs)
    return 1.0 - busy / (ticks * len(runs))


def in_flight_peak(actions: Iterable[tuple[str, int]]) -> int:
    """The most micro-batches whose forward ran and backward did not, at once, on one stage."""
    peak = held = 0
    for action, _ in actions:
        held += 1 if action == "F" else -1
        peak = max(peak, held)
    return peak


def even_split_points(model, stages: int) -> tuple[str, ...]:
    """Split points putting about ``1/stages`` of the parameters in each stage: the blocks of the
    model's largest ``nn.ModuleList`` / ``nn.Sequential`` / ``nn.ModuleDict`` (its repeated layers) are cut where
    the running parameter count (everything registered before the list counted with its first
    block) comes nearest each multiple of ``total / stages``."""
    import torch

    lists = [(fqn, m) for fqn, m in model.named_modules()
             if isinstance(m, (torch.nn.ModuleList, torch.nn.Sequential, torch.nn.ModuleDict)) and len(m) >= stages]
    if not lists:
        raise SpmdAotError(
            f"an even split into {stages} stages cuts the model's repeated blocks (an nn.ModuleList, "
            f"nn.Sequential or nn.ModuleDict of at least {stages}), and {type(model).__name__} has none: pass "
            "Pipeline(split_points=[...]) naming the first module of each stage after the first")
    fqn, blocks = max(lists, key=lambda item: sum(p.numel() for p in item[1].parameters()))
    total = sum(p.numel() for p in model.parameters())
    in_blocks = {id(p) for p in blocks.parameters()}
    before = 0
    for _, p in model.named_parameters():  # registration order: what comes before the blocks
        if id(p) in in_blocks:
            break
        before += p.numel()
    points, running = [], before
    names = [name for name, _ in blocks.named_children()]
    for i, child in enumerate(blocks.children()):
        if len(points) == stages - 1:
            break
        # a cut before block i when that leaves the stages so far nearer their share than after it
        target = total * (len(points) + 1) / stages
        size = sum(p.numel() for p in child.parameters())
        remaining_blocks = len(names) - i
        if i > 0 and (abs(running - target) <= abs(running + size - target)
                      or remaining_blocks == stages - 1 - len(points)):
            points.append(f"{fqn}.{names[i]}" if fqn else names[i])
        running += size
    if len(points) != stages - 1:
        raise SpmdAotError(f"{fqn or 'the model'} has {len(names)} blocks, too few to split evenly into "
                           f"{stages} stages; pass Pipeline(split_points=[...])")
    return tuple(points)

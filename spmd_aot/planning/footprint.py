"""A job's memory footprint on one rank, measured on fake tensors: the input of the plan's arithmetic.

One fake run of the user's unchanged step (forward, backward; the optimizer's ``step`` skipped)
on the whole model at one rank's batch, in the compute dtype, records over time the bytes of
every storage the step creates: activations (split into the part a tensor-parallel plan shards
and the part it leaves whole) and parameter gradients. A second fake run of the optimizer alone,
on the master (stored-dtype) parameters, gives its state per parameter byte and the temporaries of
its step. Nothing is allocated (fake tensors), so a 405B-shaped model is measured on a CPU box.

Why measure instead of a formula: the activations depend on the model's code (SDPA or written
attention, what autograd saves, checkpointing), which a formula per architecture would guess.

Which activations a tensor-parallel plan shards is followed through the forward: the output of a
'colwise' module is sharded, an op with a sharded input makes a sharded output, a 'rowwise'
module's output is whole again (Megatron's layout). Tensors made in backward are taken as sharded
in the forward's proportion (an approximation; docs/plan.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import functools
import weakref

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["Footprint", "OptimizerCost", "Params", "measure_activations", "measure_optimizer", "measure_params",
           "blocks_of", "checkpoint_blocks", "truncate_blocks", "Extrapolated"]


#: A sample: bytes alive after one op, by kind: (TP-sharded forward activations, whole forward
#: activations, tensors made in backward, parameter gradients).
Sample = tuple[int, int, int, int]
PHASES = ("forward", "backward, first half", "backward, second half")


@dataclasses.dataclass(frozen=True)
class Footprint:
    """One fake forward + backward at one rank's batch (one compute dtype, checkpointing on or off).

    ``phases``: the bytes alive after every op (``Sample``), by phase: the forward, and the two
    halves of the backward. A configuration weighs each kind differently (a TP degree divides the
    sharded activations, sharding divides the gradients), so its peak is the largest *weighted*
    sample (``peak``), wherever in the step that falls. Tensors made in backward count as sharded
    in the forward's proportion (``fwd_sharded`` of all forward activation bytes). ``tp_comm``:
    bytes per step, by collective kind, that a TP plan adds at any degree above 1 (Megatron: an
    all_reduce of each rowwise output in forward and of each colwise input's gradient in backward;
    with sequence parallelism an all_gather and a reduce_scatter instead; a recomputed forward
    counts again): payload bytes of the whole tensor, the same at every TP degree. ``depth``: the
    blocks kept when measured (None: the whole model)."""

    phases: dict
    fwd_sharded: int
    fwd_whole: int
    tp_comm: dict
    compute_dtype: torch.dtype
    checkpoint: bool
    depth: int | None = None

    @property
    def fraction(self) -> float:
        """The sharded part of the forward's activation bytes (and so of the backward's)."""
        return self.fwd_sharded / max(1, self.fwd_sharded + self.fwd_whole)

    def phase_peaks(self, tp: int, batch_div: float, grad_scale: float,
                    fraction: float | None = None) -> dict[str, tuple[float, float]]:
        """Per phase, (activation bytes, gradient bytes) per rank at its largest weighted sample:
        activations at TP degree ``tp`` over ``batch_div`` (a global batch's split), gradients
        times ``grad_scale``, the backward's sharded part ``fraction`` (default: ``self.fraction``)."""
        f = self.fraction if fraction is None else fraction
        ws, ww, wb = 1 / tp / batch_div, 1 / batch_div, (f / tp + 1 - f) / batch_div
        out = {}
        for name, samples in self.phases.items():
            best = (-1.0, 0.0, 0.0)
            for s, w, b, g in samples:
                act = s * ws + w * ww + b * wb
                if act + g * grad_scale > best[0]:
                    best = (act + g * grad_scale, act, g * grad_scale)
            out[name] = best[1:]
        return out

    def peak(self, tp: int, batch_div: float, grad_scale: float) -> tuple[float, float]:
        """(activation bytes, gradient bytes) per rank at the step's weighted peak (``phase_peaks``)."""
        return max(self.phase_peaks(tp, batch_div, grad_scale).values(), key=sum)


@dataclasses.dataclass(frozen=True)
class Extrapolated:
    """A model of ``depth`` identical blocks from footprints measured at two smaller depths: in each
    phase the weighted peak is affine in the number of blocks (each block adds its activations,
    gradients and collectives; within the backward the bytes alive change linearly block by block,
    so each half's peak sits at the same place at every depth), so each phase's peak is extrapolated
    on the line through the two, and the step's peak is the largest."""

    near: Footprint
    far: Footprint
    depth: int

    def _line(self, a: float, b: float) -> float:
        return max(0.0, a + (b - a) / (self.far.depth - self.near.depth) * (self.depth - self.near.depth))

    def peak(self, tp: int, batch_div: float, grad_scale: float) -> tuple[float, float]:
        sharded, whole = (self._line(getattr(self.near, k), getattr(self.far, k)) for k in ("fwd_sharded", "fwd_whole"))
        fraction = sharded / max(1.0, sharded + whole)  # the whole model's, for both depths
        near, far = (f.phase_peaks(tp, batch_div, grad_scale, fraction) for f in (self.near, self.far))
        return max(((self._line(near[p][0], far[p][0]), self._line(near[p][1], far[p][1])) for p in near), key=sum)

    @property
    def tp_comm(self) -> dict:
        return {k: round(self._line(self.near.tp_comm.get(k, 0), self.far.tp_comm.get(k, 0)))
                for k in set(self.near.tp_comm) | set(self.far.tp_comm)}

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.near.compute_dtype

    @property
    def checkpoint(self) -> bool:
        return self.near.checkpoint


@dataclasses.dataclass(frozen=True)
class OptimizerCost:
    """The optimizer measured on the master parameters: state bytes per parameter byte and the
    temporaries of one (second) step per parameter byte."""

    state_per_param_byte: float
    temp_per_param_byte: float


def blocks_of(model: torch.nn.Module) -> list[str]:
    """FQNs of the repeated blocks: the children of the model's largest ModuleList or Sequential
    (the groups a 'shard' placement gathers one at a time, and what checkpointing wraps)."""
    best: list[str] = []
    for name, m in model.named_modules():
        if isinstance(m, (torch.nn.ModuleList, torch.nn.Sequential)) and len(m) > len(best):
            best = [f"{name}.{c}" if name else c for c, _ in m.named_children()]
    return best


def _tensors(value) -> list[torch.Tensor]:
    return [v for v in pytree.tree_leaves(value) if isinstance(v, torch.Tensor)]


class _Timeline(TorchDispatchMode):
    """Bytes of the storages created under it, alive over time, by kind ('sharded' and 'whole'
    forward activations, 'bwd' tensors made in backward, 'grad' parameter gradients), kept as
    running totals so each op costs O(its outputs); ``samples``: the totals after every op, by phase."""

    KINDS = ("sharded", "whole", "bwd", "grad")

    def __init__(self):
        super().__init__()
        self.sizes: dict[int, int] = {}
        self.kind: dict[int, str] = {}
        self.live: dict[int, weakref.ref] = {}
        self.backward = False
        self.now = dict.fromkeys(self.KINDS, 0)
        self.peak_total = 0
        self.samples: dict[str, list[Sample]] = {"forward": [], "backward": []}
        self.fwd_bytes = {"sharded": 0, "whole": 0}  # every forward activation made, alive or not
        self.external: set[int] = set()  # storages made before the step (parameters, batch): not its

    def exclude(self, tensors) -> None:
        """Storages alive before the step (a view of a parameter is not an activation)."""
        self.external.update(k for k in map(self.key, tensors) if k is not None)

    @staticmethod
    def key(t):
        try:
            return t.untyped_storage()._cdata
        except Exception:
            return None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        sharded_in = not self.backward and any(self.kind.get(self.key(t)) == "sharded"
                                               for t in _tensors((args, kwargs)))
        for t in _tensors(out):
            try:
                st = t.untyped_storage()
            except Exception:
                continue
            k = st._cdata
            if k in self.live or k in self.external:
                continue
            kind = "bwd" if self.backward else ("sharded" if sharded_in else "whole")
            self.sizes[k], self.kind[k] = st.nbytes(), kind
            self.now[kind] += st.nbytes()
            if kind != "bwd":
                self.fwd_bytes[kind] += st.nbytes()
            self.live[k] = weakref.ref(st, functools.partial(self._gone, k))
        self.samples["backward" if self.backward else "forward"].append(tuple(self.now.values()))
        self.peak_total = max(self.peak_total, sum(self.now.values()))
        return out

    def _gone(self, k, _ref=None):
        if self.live.pop(k, None) is not None:
            self.now[self.kind.pop(k)] -= self.sizes.pop(k)

    def mark(self, t: torch.Tensor, kind: str) -> None:
        """``t``'s storage is of ``kind`` from now on (a TP module's output, a gradient)."""
        k = self.key(t)
        old = self.kind.get(k)
        if old is None or old == kind:
            return
        if old != "bwd" and kind in self.fwd_bytes:
            self.fwd_bytes[old] -= self.sizes[k]
            self.fwd_bytes[kind] += self.sizes[k]
        self.now[old] -= self.sizes[k]
        self.now[kind] += self.sizes[k]
        self.kind[k] = kind


#: TP styles whose module output is split over the TP ranks (by features or by sequence).
SHARDED_OUTPUT = frozenset({"colwise", "colwise_seq", "rowwise_seq", "sequence_parallel", "seq_shard_output"})


def _style_of(name: str, tp_plan) -> str | None:
    for pattern, style in tp_plan:
        if fnmatch.fnmatchcase(name, pattern):
            return style
    return None


def _cast(batch, dtype):
    return pytree.tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t,
                           batch)


def checkpoint_blocks(model: torch.nn.Module) -> None:
    """Wrap each block's forward in ``torch.utils.checkpoint`` (non-reentrant), as a job that
    checkpoints per block does."""
    from torch.utils.checkpoint import checkpoint

    for name in blocks_of(model):
        block = model.get_submodule(name)
        inner = block.forward
        block.forward = functools.partial(lambda f, *a, **k: checkpoint(f, *a, use_reentrant=False, **k), inner)


def truncate_blocks(model: torch.nn.Module, depth: int) -> list[str]:
    """Keep the first ``depth`` repeated blocks (``blocks_of``) of ``model``; the names kept."""
    names = blocks_of(model)
    if not names:
        return []
    parent_name = names[0].rpartition(".")[0]
    parent = model.get_submodule(parent_name) if parent_name else model
    kept = list(parent.children())[:depth]
    container = type(parent)(kept) if isinstance(parent, torch.nn.Sequential) else torch.nn.ModuleList(kept)
    if parent_name:
        owner, _, attr = parent_name.rpartition(".")
        setattr(model.get_submodule(owner) if owner else model, attr, container)
    return names[:depth]


def _tp_hooks(model: torch.nn.Module, plan, timeline: _Timeline, recompute: int) -> tuple[list, dict]:
    """Forward hooks on the modules ``plan`` names: each marks its output sharded or whole
    (``SHARDED_OUTPUT``) and counts the bytes its style communicates (``Footprint.tp_comm``)."""
    from ..parallel.tp_plan import style_name

    tp_comm = {"all_reduce": 0, "all_gather": 0, "reduce_scatter": 0}

    def hook(style):
        def run(mod, args, out):
            if timeline.backward or not isinstance(out, torch.Tensor):
                return
            timeline.mark(out, "sharded" if style in SHARDED_OUTPUT else "whole")
            x = args[0] if args and isinstance(args[0], torch.Tensor) else None
            out_bytes = out.numel() * out.element_size()
            in_bytes = x.numel() * x.element_size() if x is not None else 0
            if style in ("colwise", "colwise_gather_output"):  # the input's gradient is summed in backward
                tp_comm["all_reduce"] += in_bytes
            elif style in ("rowwise", "rowwise_split_input"):
                tp_comm["all_reduce"] += recompute * out_bytes
            elif style == "colwise_seq":  # gathered in forward, its gradient reduce-scattered
                tp_comm["all_gather"] += recompute * in_bytes
                tp_comm["reduce_scatter"] += in_bytes
            elif style == "rowwise_seq":
                tp_comm["reduce_scatter"] += recompute * out_bytes
                tp_comm["all_gather"] += out_bytes
        return run

    hooks = [m.register_forward_hook(hook(style_name(name, style))) for name, m in model.named_modules()
             if (style := _style_of(name, plan)) is not None]
    return hooks, tp_comm


@contextlib.contextmanager
def _recording(model: torch.nn.Module, timeline: _Timeline):
    """While the step runs: ``timeline.backward`` from the first ``backward()`` call on, and every
    parameter's accumulated gradient marked 'grad'."""
    real_backward = torch.Tensor.backward

    def backward(self, *a, **k):
        timeline.backward = True
        return real_backward(self, *a, **k)

    def grad_hook(p):
        if p.grad is not None:
            timeline.mark(p.grad, "grad")

    handles = [p.register_post_accumulate_grad_hook(grad_hook) for p in model.parameters() if p.requires_grad]
    torch.Tensor.backward = backward
    try:
        yield
    finally:
        torch.Tensor.backward = real_backward
        for h in handles:
            h.remove()


def measure_activations(job, *, compute_dtype: torch.dtype | None = None, checkpoint: bool = False,
                        tp_plan=(), cast_forward_inputs: bool = True, depth: int | None = None) -> Footprint:
    """Run ``job.step`` once on fake tensors (optimizer step skipped) and record its activations.

    ``depth``: keep only the first ``depth`` repeated blocks (``truncate_blocks``); raises
    ``ValueError`` when the step then runs another number of blocks (a model that counts its
    layers some other way), so a caller can measure the whole model instead."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from ..parallel.tp_plan import resolve_tp_plan

    timeline = _Timeline()
    with FakeTensorMode():
        torch.manual_seed(0)
        model = job.model()
        ran: list[int] = []
        if depth is not None:
            for name in truncate_blocks(model, depth):
                model.get_submodule(name).register_forward_pre_hook(lambda *_: ran.append(1))
        if compute_dtype is not None:  # the compute copies a mixed-precision step makes
            for t in [*model.parameters(), *model.buffers()]:
                if t.is_floating_point():
                    t.data = t.data.to(compute_dtype)
        dtype = compute_dtype or next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
        batch = job.batch()
        if compute_dtype is not None and cast_forward_inputs:
            batch = _cast(batch, compute_dtype)
        optim = job.optimizer(model) if job.optimizer is not None else None
        if checkpoint:
            checkpoint_blocks(model)
        plan = resolve_tp_plan(tp_plan, model) if tp_plan else ()
        hooks, tp_comm = _tp_hooks(model, plan, timeline, recompute=2 if checkpoint else 1)
        if optim is not None:
            optim.step = lambda *a, **k: None  # measured apart, on the master parameters
        with contextlib.ExitStack() as stack:
            stack.callback(lambda: [h.remove() for h in hooks])
            stack.enter_context(_recording(model, timeline))
            timeline.exclude([*model.parameters(), *model.buffers(), *_tensors(batch)])
            with timeline:
                if optim is not None:
                    job.step(model, optim, batch)
                else:
                    with torch.no_grad():
                        job.step(model, batch)
    if depth is not None and len(ran) != depth:
        raise ValueError(f"the step ran {len(ran)} blocks with {depth} kept")
    back = timeline.samples["backward"]
    phases = dict(zip(PHASES, (timeline.samples["forward"], back[:len(back) // 2], back[len(back) // 2:])))
    return Footprint(phases, timeline.fwd_bytes["sharded"], timeline.fwd_bytes["whole"],
                     {k: v for k, v in tp_comm.items() if v}, dtype, checkpoint, depth)


def measure_optimizer(job) -> OptimizerCost:
    """Two fake optimizer steps on the master parameters with zero gradients; the second's
    temporaries and the state it keeps, per parameter byte."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    if job.optimizer is None:
        return OptimizerCost(0.0, 0.0)
    with FakeTensorMode():
        torch.manual_seed(0)
        model = job.model()
        params = [p for p in model.parameters() if p.requires_grad]
        optim = job.optimizer(model)
        for p in params:
            p.grad = torch.zeros_like(p)
        optim.step()
        timeline = _Timeline()
        timeline.exclude([*params, *(p.grad for p in params), *(t for s in optim.state.values()
                                                              for t in s.values() if isinstance(t, torch.Tensor))])
        with timeline:
            optim.step()
        param_bytes = sum(p.numel() * p.element_size() for p in params) or 1
        state = sum(t.numel() * t.element_size() for s in optim.state.values() for t in s.values()
                    if isinstance(t, torch.Tensor) and t.dim() > 0)
    return OptimizerCost(state / param_bytes, timeline.peak_total / param_bytes)


@dataclasses.dataclass(frozen=True)
class Params:
    """The model's parameters as the plan needs them: numel (all / split by the TP plan), the
    master (stored) bytes per element, and per communication group (each repeated block; the
    rest is the root group) the numel and the TP-split numel."""

    numel: int
    tp_numel: int
    master_itemsize: int
    groups: dict  # group name -> (numel, tp_numel)
    root: str = "<root>"

    def largest_block(self) -> tuple[int, int]:
        blocks = [v for k, v in self.groups.items() if k != self.root]
        return max(blocks, default=(0, 0))


def measure_params(job, tp_plan=()) -> Params:
    """The model's parameters on fake tensors: groups as ``blocks_of``; a parameter is TP-split when
    its module's style splits it (``tp_plan.SPLIT_DIMS``)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        torch.manual_seed(0)
        model = job.model()
    from ..parallel.tp_plan import SPLIT_DIMS, resolve_tp_plan, style_name

    blocks = blocks_of(model)
    plan = resolve_tp_plan(tp_plan, model) if tp_plan else ()
    split: set[int] = set()
    for name, m in model.named_modules():
        style = _style_of(name, plan)
        if style is None:
            continue
        dims = SPLIT_DIMS[style_name(name, style)]
        split.update(id(p) for pname, p in m.named_parameters(recurse=False) if dims.get(pname) is not None)
    groups: dict[str, list[int]] = {}
    numel = tp_numel = 0
    itemsize = 4
    seen: set[int] = set()
    for name, p in model.named_parameters():
        if id(p) in seen or not p.requires_grad:
            continue
        seen.add(id(p))
        group = next((b for b in blocks if name.startswith(b + ".")), Params.root)
        entry = groups.setdefault(group, [0, 0])
        n, t = p.numel(), p.numel() if id(p) in split else 0
        entry[0] += n
        entry[1] += t
        numel, tp_numel, itemsize = numel + n, tp_numel + t, p.element_size()
    return Params(numel, tp_numel, itemsize, {k: tuple(v) for k, v in groups.items()})

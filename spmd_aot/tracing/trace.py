"""Trace a whole train step (forward, backward, optimizer step) into one FX graph.

A step without an optimizer is *forward-only* (evaluation, inference): ``step(model, batch)``
traced under ``torch.no_grad()``, so it has no gradients, no gradient collectives and no
parameter update.

Parameters, buffers, optimizer state and batch leaves become graph inputs in ``TrainState``
order. The optimizer's in-place updates stay in-place ops on those inputs, so running the
graph on the user's real tensors updates ``model`` and ``optim`` exactly as eager would.
Tracing always uses fake tensors: it needs no parameter memory and never communicates.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections import defaultdict
from typing import Any
from collections.abc import Callable
from unittest import mock

import torch
import torch.utils._pytree as pytree
from torch.fx.experimental.proxy_tensor import make_fx
from torch.nn.utils import stateless

from . import data_dependent
from ..format import fused_meta
from . import grouped_mm
from . import rnn
from .accumulation import Accumulation
from .gradients_left import Clearing, GradientsLeft
from .casts import forward_casts
from . import repeated
from ..errors import UnsupportedError
from .expand import Expander
from ..parallel.groups import GroupGather, ParamGroup, assign_groups, resharding
from ..parallel import axes
from ..passes.ops import GRADIENT_PATH_VIEWS, is_wait
from ..parallel.plan import Plan
from .optimizers import TracedNumber, members, schedulers_refused, tensor_updates, traced_hyperparameters, user_object
from ..state import TrainState

__all__ = ["TracedStep", "trace_step"]


@dataclasses.dataclass
class TracedStep:
    gm: torch.fx.GraphModule
    out_spec: pytree.TreeSpec
    out_constants: dict[int, Any]  # output leaf index -> non-tensor value returned by the step
    group_names: dict[str, int | str]  # traced process-group name -> mesh dimension or "world"
    gradient_collectives: dict[str, str] = dataclasses.field(default_factory=dict)  # node -> param FQN
    groups: list[ParamGroup] = dataclasses.field(default_factory=list)  # shard communication groups
    axis_budget: dict[str, int] = dataclasses.field(default_factory=dict)  # collectives the axes' calls may add
    micro_batches: int = 1  # backward() calls accumulated before one optimizer step
    # ids of parameters no gradient reaches, whose optimizer state the graph does not take
    untaken: set[int] = dataclasses.field(default_factory=set)
    # how a stack of identical blocks was traced: stamped from three (repeated.py), or why not
    blocks: dict = dataclasses.field(default_factory=dict)
    # the gradients the step leaves on its parameters: the graph's last outputs (gradients_left.py)
    gradients_left: GradientsLeft = dataclasses.field(default_factory=GradientsLeft)


def trace_step(step: Callable, state: TrainState, plan: Plan, mesh, inputs: list[torch.Tensor],
               transform_model: Callable | None = None, by_blocks: bool = True) -> TracedStep:
    """Trace ``step(model, optim, batch)``, or ``step(model, batch)`` for a forward-only state
    (``state.optim is None``); ``inputs`` (real or fake) follow ``state.slots()``.

    ``transform_model`` is a context manager factory applied around the step while tracing
    (module overrides swap submodules there). A step that accumulates gradients (several
    ``backward()`` before a step) is traced a second time with its reductions deferred to the
    last backward before each step (``accumulation.py``). A model with a deep stack of
    identical blocks is traced with three and four blocks and its graph stamped from them
    (``stamp.py``) unless ``by_blocks`` is false; the same graph as the full trace's, or the
    full trace where that cannot be shown (``TracedStep.blocks`` says which, and why).
    """
    state.untaken = set()  # ``inputs`` hold every state tensor; the trace finds which the step takes
    stamped = _stamped_trace(step, state, plan, mesh, inputs) if by_blocks and transform_model is None else None
    if isinstance(stamped, TracedStep):
        return stamped
    recorded = Accumulation()
    traced = _StepTracer(step, state, plan, mesh, transform_model, recorded).trace(inputs)
    traced.blocks = {"full_trace": stamped} if stamped else {}
    points = recorded.sync_points() if plan.world_size > 1 and mesh is not None else None
    if points is None:
        state.untaken = traced.untaken
        return traced
    deferred = Accumulation(points)
    blocks = traced.blocks
    traced = _StepTracer(step, state, plan, mesh, transform_model, deferred).trace(inputs)
    traced.blocks = blocks
    state.untaken = traced.untaken
    traced.micro_batches = recorded.micro_batches
    # a resharded group is gathered in each micro-batch's forward and backward (as FSDP2)
    extra = 2 * (traced.micro_batches - 1) * sum(1 for g in traced.groups if g.reshard)
    if extra:
        traced.axis_budget = dict(traced.axis_budget)
        kind = "all_gather_into_tensor"
        traced.axis_budget[kind] = traced.axis_budget.get(kind, 0) + extra
    return traced


def _stamped_trace(step, state: TrainState, plan: Plan, mesh, inputs) -> TracedStep | str | None:
    """The step of a model with a deep stack of identical blocks, stamped from traces of three
    and four blocks (``repeated.py``, ``stamp.py``); why not (a str), or None (no such stack)."""
    def trace_cut(cut_state, cut_inputs, recorder):
        accumulation = Accumulation()
        traced = _StepTracer(step, cut_state, plan, mesh, None, accumulation, recorder).trace(cut_inputs)
        if plan.world_size > 1 and mesh is not None and accumulation.sync_points() is not None:
            raise repeated.NotRepeatable("the step accumulates gradients over several backward() calls")
        if traced.gradients_left.params:
            raise repeated.NotRepeatable("the step leaves its gradients on the parameters")
        return traced

    done = repeated.stamped(state, plan, inputs, trace_cut)
    if not isinstance(done, tuple):
        return done
    gm, gradient_collectives, template, blocks = done
    groups = _StepTracer(step, state, plan, mesh, None, Accumulation()).groups
    return TracedStep(gm, template.out_spec, template.out_constants, _group_names(gm, mesh, plan),
                      gradient_collectives, groups, template.axis_budget, blocks=blocks)


class _StepTracer:
    """One make_fx trace of the step over flat inputs in ``state.slots()`` order: the parameter
    leaves the expander makes, the module attributes bound to them, the optimizer's state swapped
    for traced tensors, and the axes' and accumulation's contexts around the user's call."""

    def __init__(self, step, state: TrainState, plan: Plan, mesh, transform_model, accumulation: Accumulation,
                 recorder=None):
        self.step, self.state, self.plan, self.mesh = step, state, plan, mesh
        self.transform_model, self.accumulation = transform_model, accumulation
        self.recorder = recorder  # a repeated.BlockRecorder while a cut model is traced
        self.forward_only = state.forward_only
        self.slots = state.slots()
        self.expander = Expander(plan, mesh)
        self.expander.deferred = accumulation.deferred
        self.by_kind: dict[str, list[int]] = {}
        for i, s in enumerate(self.slots):
            self.by_kind.setdefault(s.kind, []).append(i)
        self.param_slots = [self.slots[i] for i in self.by_kind.get("param", [])]
        sharded = [i for i, s in enumerate(self.param_slots) if self.expander.dtensor_leaves and s.layout.sharded]
        self.groups = assign_groups(state.model, plan, [(self.param_slots[i].fqn, self.param_slots[i].dtype)
                                                        for i in sharded])
        self.slot_of = {self.param_slots[i].fqn: i for i in sharded}
        # the axes' tracing contexts (TP: planned modules run their style's forward), checked here
        self.axis_contexts = axes.Tracing(plan, state.model, mesh)
        self.where = _ModuleStack()
        self.without_gradient: set[int] = set()  # traced leaves the optimizer stepped without a gradient
        self.gradient_collectives: dict[str, str] = {}
        self.out_spec = self.out_constants = None
        self.gradients_left = GradientsLeft()

    def trace(self, inputs: list[torch.Tensor]) -> TracedStep:
        """make_fx over ``inputs``; a failure becomes an ``UnsupportedError`` naming the module."""
        try:
            with _without_grad() if self.forward_only else contextlib.nullcontext(), fused_meta.registered(), \
                    rnn.native_rnn_cells():
                # MoE grouped products (and their histc) traced as static-shape ops: grouped_mm.py;
                # recurrent layers as native cells of allowlisted ops: rnn.py
                gm = make_fx(self._flat_step, tracing_mode="fake",
                             decomposition_table={**grouped_mm.DECOMPOSITIONS, **rnn.DECOMPOSITIONS})(*inputs)
        except UnsupportedError:
            raise
        except Exception as exc:
            refusal = data_dependent.describe(exc, self.where.describe())
            if refusal is not None:
                raise UnsupportedError(refusal) from exc
            hint = ("; a step without an optimizer is forward-only: it is called step(model, batch) and "
                    "runs under torch.no_grad(), so it cannot call backward()") if self.forward_only else ""
            if "mixed torch.Tensor and DTensor" in str(exc):
                hint += ("; under a sharded placement model.parameters() yields DTensors of each rank's shard, "
                         "so a term computed from them (an L2 penalty added to the loss) mixes with the "
                         "forward's plain tensors: compute it in a module's forward from its weights read as "
                         "attributes (`self.fc.weight.pow(2).sum()`), use the optimizer's weight_decay, or use "
                         "placement='replicate'")
            raise UnsupportedError(
                f"tracing the step failed for {self.plan.describe()}{self.where.describe()}: "
                f"{type(exc).__name__}: {_first_lines(str(exc))}{hint}"
            ) from exc
        untaken = self._drop_untaken_state(gm)
        return TracedStep(gm, self.out_spec, self.out_constants, _group_names(gm, self.mesh, self.plan),
                          self.gradient_collectives, self.groups, self.axis_contexts.budget(), untaken=untaken,
                          gradients_left=self.gradients_left)

    def _drop_untaken_state(self, gm) -> set[int]:
        """Parameters the optimizer stepped without a gradient (requires_grad, but the loss does
        not reach them) whose state inputs the graph never reads: those inputs are removed, so
        the stored step does not take that state and eager's state (none for them) is kept.
        Returns their ids."""
        if not self.without_gradient:
            return set()
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        by_param: dict[int, list] = {}
        state_nodes = [placeholders[i] for i in self.by_kind.get("optim_state", [])]
        for (real, _), node in zip(self.state.optimizer_slots(), state_nodes):
            by_param.setdefault(id(real), []).append(node)
        untaken, dead = set(), {}
        for pid, nodes in by_param.items():
            readers = [_dead_readers(n) for n in nodes] if pid in self.without_gradient else [None]
            if all(r is not None for r in readers):
                untaken.add(pid)
                dead[pid] = [x for r in readers for x in r] + nodes
        for pid in untaken:
            for node in dead[pid]:  # users first
                gm.graph.erase_node(node)
        return untaken

    def _flat_step(self, *flat):
        state, forward_only = self.state, self.forward_only
        take = lambda kind: [flat[i] for i in self.by_kind.get(kind, [])]  # noqa: E731
        leaves = self._leaves(take("param"))
        batch_leaves = self.axis_contexts.batch(take("batch"))  # first: buffers may follow its split
        buffers = take("buffer")
        if self.plan.world_size > 1 and self.mesh is not None:
            buffers = axes.traced_buffers(self.plan, buffers, self.mesh)
        buffers = self.axis_contexts.buffers([names for names, _ in state.buffers], buffers)
        bindings = {}
        for (names, _), leaf in zip(state.params, leaves):
            bindings.update(dict.fromkeys(names, leaf))
        for (names, _), buf in zip(state.buffers, buffers):
            bindings.update(dict.fromkeys(names, buf))
        by_real = {id(real): leaf for (_, real), leaf in zip(state.params, leaves)}
        traced_state = self._optimizer_state(by_real, take("optim_state"))
        hypers = {} if forward_only else traced_hyperparameters(state.optim, state.hyper_inputs(), take("hyper"))
        batch = pytree.tree_unflatten(batch_leaves, state.batch_spec)
        gathers = self._gathers(leaves)
        computes = _ComputeOnAccess(leaves, [s.layout for s in self.param_slots], self.expander, gathers)
        on_step = self.recorder.step if self.recorder is not None else None
        optimizer = contextlib.nullcontext() if forward_only else \
            _each_optimizer_swapped(state.optim, by_real, traced_state, hypers, self.accumulation,
                                    self.without_gradient, on_step)
        recording = self.recorder.recording() if self.recorder is not None else contextlib.nullcontext()
        clearing = Clearing(leaves)
        with recording, (self.transform_model() if self.transform_model else contextlib.nullcontext()), \
                stateless._reparametrize_module(state.model, bindings), computes, resharding(gathers), \
                optimizer, self.where.tracking(state.model), self.axis_contexts, self.accumulation.recording(), \
                forward_casts(state.model, self.plan), schedulers_refused(), clearing.recording():
            result = self.step(state.model, batch) if forward_only else \
                self.step(state.model, user_object(state.optim), batch)
        self.gradients_left, grads = clearing.left(leaves, [names[0] for names, _ in state.params], self.step)
        return self._outputs(result) + grads

    def _leaves(self, params: list) -> list:
        """The parameters as the expander's leaves, each with a hook naming its gradient's collectives."""
        leaves = [self.expander.leaf(x, s.layout, s.requires_grad and not self.forward_only)
                  for x, s in zip(params, self.param_slots)]
        for (names, _), leaf, s in zip(self.state.params, leaves, self.param_slots):
            if leaf.requires_grad:
                note = functools.partial(_note_gradient_collectives, names[0], self.gradient_collectives)
                leaf.register_hook(note)
                if self.accumulation.deferred and not s.layout.sharded:
                    self.accumulation.reduce_at_sync(leaf, self.expander.world_mesh.get_group().group_name, note)
                if self.recorder is not None:
                    self.recorder.leaf(names[0], leaf)
        return leaves

    def _optimizer_state(self, by_real: dict, values: list) -> dict:
        """The optimizer's state keyed by traced leaf: what it holds now, then the state inputs."""
        traced_state = defaultdict(dict)
        for real, entries in (self.state.optim.state.items() if not self.forward_only else ()):
            traced_state[by_real[id(real)]] = dict(entries)
        state_slots = [self.slots[i] for i in self.by_kind.get("optim_state", [])]
        for (real, key), x, s in zip(self.state.optimizer_slots(), values, state_slots):
            traced_state[by_real[id(real)]][key] = self.expander.wrap(x, s.layout) if s.layout else x
        return traced_state

    def _gathers(self, leaves: list) -> list:
        """One ``GroupGather`` per shard communication group, over the group's leaves."""
        gathers = []
        for g in self.groups:
            slots = [self.slot_of[f] for f in g.fqns]
            gather = GroupGather(g, [leaves[i] for i in slots], [self.param_slots[i].layout for i in slots], self.mesh,
                                 self.plan.mixed_precision)
            gather.accumulation = self.accumulation
            gathers.append(gather)
        return gathers

    def _outputs(self, result) -> list:
        """The step's returned tensors (local parts), its tree spec and its non-tensor leaves."""
        out_leaves, self.out_spec = pytree.tree_flatten(result)
        self.out_constants = {i: v for i, v in enumerate(out_leaves) if not isinstance(v, torch.Tensor)}
        for i, v in self.out_constants.items():
            if not isinstance(v, (int, float, bool, str, type(None))):
                raise UnsupportedError(
                    f"the step returns a {type(v).__name__} at output leaf {i}; return tensors, "
                    "numbers, strings or None"
                )
        tensors = [v for v in out_leaves if isinstance(v, torch.Tensor)]
        return [_unpartial(v).to_local() if hasattr(v, "to_local") else v for v in tensors]


def _unpartial(v):
    """A DTensor output reduced over its Partial dimensions: a value the step computed across
    shards (clip_grad_norm_'s total norm under shard is Partial(max) for norm_type=inf) is
    returned whole, as eager's DTensor reads; Shard and Replicate dimensions stay as they are."""
    from torch.distributed.tensor import Replicate

    if not any(p.is_partial() for p in v.placements):
        return v
    return v.redistribute(v.device_mesh, [Replicate() if p.is_partial() else p for p in v.placements])


def _dead_readers(node: torch.fx.Node) -> list[torch.fx.Node] | None:
    """The nodes reading ``node`` when nothing uses what they compute (the views the expander
    makes of a state input the optimizer then skips), users before what they use; None when
    anything reads it for real (a mutating op, or a result that is used)."""
    out: list[torch.fx.Node] = []
    for user in node.users:
        schema = getattr(user.target, "_schema", None)
        if user.op != "call_function" or schema is None or schema.is_mutable:
            return None
        below = _dead_readers(user)
        if below is None:
            return None
        out += below + [user]
    return out


def _note_gradient_collectives(fqn: str, found: dict[str, str], grad) -> None:
    """Leaf gradient hook while tracing: name the collectives that produced ``fqn``'s gradient
    (walking back through views and waits), so buckets and groups can list their parameters."""
    from torch.fx.experimental.proxy_tensor import get_proxy_mode, get_proxy_slot

    mode = get_proxy_mode()
    local = getattr(grad, "_local_tensor", grad)
    if not isinstance(local, torch.Tensor):  # no local gradient (an accumulating micro-batch)
        return
    slot = get_proxy_slot(local, mode.tracer, None) if mode is not None else None
    node = getattr(getattr(slot, "proxy", None), "node", None)
    while isinstance(node, torch.fx.Node) and node.op == "call_function" and node.args:
        namespace = getattr(node.target, "namespace", None)
        if namespace == "_c10d_functional" and not is_wait(node):
            found.setdefault(node.name, fqn)
        elif namespace != "_c10d_functional" and node.target not in GRADIENT_PATH_VIEWS:
            break
        node = node.args[0]


def _group_names(gm, mesh, plan: Plan) -> dict[str, int | str]:
    """Traced process-group name -> mesh dimension, or ``"world"`` for a group of every rank.

    Groups are matched by their ranks, not only by name: DTensor caches sharding decisions
    across equal meshes, so a trace can name another (equal) mesh's group for a dimension.
    """
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group

    names: dict[str, int | str] = {}
    if mesh is None:
        return names
    by_ranks: dict[tuple, int | str] = {tuple(range(plan.world_size)): "world"}
    for dim in range(mesh.ndim):
        group = mesh.get_group(dim)
        names[group.group_name] = dim
        by_ranks[tuple(sorted(dist.get_process_group_ranks(group)))] = dim
    for node in gm.graph.nodes:
        if getattr(node.target, "namespace", None) != "_c10d_functional":
            continue
        for arg in list(node.args) + list(node.kwargs.values()):
            if isinstance(arg, str) and arg not in names and arg not in ("sum", "avg", "max", "min", "product"):
                try:
                    ranks = tuple(sorted(dist.get_process_group_ranks(_resolve_process_group(arg))))
                except Exception:
                    continue
                if ranks in by_ranks:
                    names[arg] = by_ranks[ranks]
    return names


class _ModuleStack:
    """Which module's forward was running when tracing failed, for the error message."""

    def __init__(self):
        self.stack: list[str] = []

    @contextlib.contextmanager
    def tracking(self, model: torch.nn.Module):
        from torch.nn.modules.module import (register_module_forward_hook,
                                             register_module_forward_pre_hook)

        names = {id(m): (name or "<root>", type(m).__qualname__) for name, m in model.named_modules()}

        def enter(module, args):
            if id(module) in names:
                self.stack.append("{} ({})".format(*names[id(module)]))

        def leave(module, args, output):
            if id(module) in names and self.stack:
                self.stack.pop()

        handles = [register_module_forward_pre_hook(enter), register_module_forward_hook(leave)]
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    def describe(self) -> str:
        return f", in module {self.stack[-1]}" if self.stack else ""


def _first_lines(text: str, n: int = 6) -> str:
    lines = text.strip().splitlines()
    return "\n".join(lines[:n]) + (" [...]" if len(lines) > n else "")


class _ComputeOnAccess:
    """While active, reading a parameter attribute of any module yields its compute tensor.

    ``model.parameters()`` keeps yielding the leaves (for the optimizer and gradient
    clipping); ``module.weight`` goes through ``nn.Module.__getattr__`` and gets the tensor
    to compute with, made on first access, so an all-gather sits right before the first use.
    A parameter in a communication group gets it from its group (the first access gathers
    the whole group).

    The patch is process-wide for the trace's duration only (restored on exit, also on error):
    tracing runs on one thread, and the patched lookup changes only attributes whose value is
    one of this trace's leaves; every other module attribute reads as before.
    """

    def __init__(self, leaves, layouts, expander, gathers=()):
        self.layouts = {id(leaf): (leaf, layout) for leaf, layout in zip(leaves, layouts)}
        self.expander = expander
        self.computed: dict[int, torch.Tensor] = {}
        self.gathers = {id(leaf): g for g in gathers for leaf in g.leaves}

    def __enter__(self):
        self.original = original = torch.nn.Module.__getattr__
        layouts, computed, expander, gathers = self.layouts, self.computed, self.expander, self.gathers

        def getattr_compute(module, name):
            value = original(module, name)
            entry = layouts.get(id(value))
            if entry is None:
                return value
            if id(value) in gathers:
                return gathers[id(value)].compute(value)
            if id(value) not in computed:
                computed[id(value)] = expander.compute(*entry)
            return computed[id(value)]

        torch.nn.Module.__getattr__ = getattr_compute
        return self

    def __exit__(self, *exc):
        torch.nn.Module.__getattr__ = self.original


@contextlib.contextmanager
def _without_grad():
    """How a forward-only step is traced, whatever the caller's mode: no autograd recording,
    outside inference mode (so the key need not read either mode for it)."""
    with torch.inference_mode(False), torch.no_grad():
        yield


#: Optimizers whose ``fused=True`` kernel updates every parameter of a group in one pass; the
#: second set also for DTensor parameters (the fused ops DTensor has a sharding rule for).
_FUSED_OPTIMIZERS = {"SGD", "Adam", "AdamW"}
_FUSED_FOR_DTENSORS = {"Adam", "AdamW"}


def _default_implementation(optim, group: dict) -> str | None:
    """``"fused"``, ``"foreach"`` or None (the user chose): which flag to set for a group whose
    implementation the user left to torch (``foreach=None`` and ``fused=None``).

    Fused kernels update a parameter, its gradient and its state in one pass per tensor, where
    the multi-tensor path makes a dozen passes (and on CPU a dozen dispatches per tensor): on a
    2-layer transformer that is most of what separates the step from eager's. torch itself
    defaults to neither only for backward compatibility. The result differs from eager's
    per-tensor loop by rounding only (parity tests hold it to the tolerances of docs/models.md).
    """
    if group.get("foreach", False) is not None or group.get("fused") or group.get("differentiable"):
        return None
    if any(_is_traced(v) for k, v in group.items() if k not in ("params", "lr")):
        return "foreach"  # fused kernels take every number but the learning rate as a Python scalar
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    from torch.distributed.tensor import DTensor

    name = type(optim).__name__

    def fusable(p) -> bool:  # the kernel wants its state (step counters too) on the parameter's device
        state = [t for t in optim.state.get(p, {}).values() if isinstance(t, torch.Tensor)]
        return p.is_floating_point() and p.device.type in _get_fused_kernels_supported_devices() and \
            all(t.device == p.device for t in state) and (name in _FUSED_FOR_DTENSORS or not isinstance(p, DTensor))

    if name in _FUSED_OPTIMIZERS and "fused" in group and all(map(fusable, group["params"])):
        return "fused"
    return "foreach"


def _is_traced(value) -> bool:
    """A hyperparameter input while tracing (``optimizers.traced_hyperparameters``)."""
    if isinstance(value, tuple):
        return any(map(_is_traced, value))
    return isinstance(value, (torch.Tensor, TracedNumber))


@contextlib.contextmanager
def _optimizer_swapped(optim, by_real: dict, traced_state, hypers: dict, accumulation=None, without_gradient=None,
                       on_step=None):
    """Point the optimizer at the traced leaves and take its compile-friendly path.

    With ``torch.compiler.is_compiling()`` true and ``capturable=True`` the built-in optimizers
    keep step counters as tensors instead of calling ``.item()`` (impossible on fake tensors).
    ``without_gradient`` collects the ids of the real parameters the step met with no gradient.
    """
    real_of = {id(leaf): real_id for real_id, leaf in by_real.items()}
    saved_params = [g["params"] for g in optim.param_groups]
    saved_hypers = {i: {name: optim.param_groups[i][name] for name in values} for i, values in hypers.items()}
    saved_capturable = [g.get("capturable") for g in optim.param_groups]
    saved_state = optim.state
    original_step = optim.step
    own_step = optim.__dict__.get("step")  # an instance attribute: an lr scheduler's wrapper

    def compile_path_step(*args, **kwargs):
        if on_step is not None:
            on_step()
        if accumulation is not None:
            accumulation.note_step()
        if without_gradient is not None:
            without_gradient.update(real_of[id(p)] for g in optim.param_groups for p in g["params"]
                                    if p.requires_grad and p.grad is None)
        # Where the user left the implementation to torch (foreach=None, fused=None), take the
        # fastest one torch has for the group, judged on the traced leaves and their state.
        default_impl = [_default_implementation(optim, g) for g in optim.param_groups]
        for g, impl in zip(optim.param_groups, default_impl):
            if "capturable" in g:
                g["capturable"] = True
            if impl:
                g[impl] = True
        try:
            with mock.patch("torch.compiler.is_compiling", lambda: True), tensor_updates():
                return original_step(*args, **kwargs)
        finally:
            for g, c, impl in zip(optim.param_groups, saved_capturable, default_impl):
                if c is not None:
                    g["capturable"] = c
                if impl:
                    g[impl] = None

    try:
        for g in optim.param_groups:
            g["params"] = [by_real[id(p)] for p in g["params"]]
        for i, values in hypers.items():
            optim.param_groups[i].update(values)
        optim.state = traced_state
        optim.step = compile_path_step
        yield
    finally:
        if own_step is None:
            del optim.step
        else:
            optim.step = own_step
        optim.state = saved_state
        for g, params in zip(optim.param_groups, saved_params):
            g["params"] = params
        for i, values in saved_hypers.items():
            optim.param_groups[i].update(values)


@contextlib.contextmanager
def _each_optimizer_swapped(optim, by_real: dict, traced_state, hypers: dict, accumulation=None,
                            without_gradient=None, on_step=None):
    """``_optimizer_swapped`` for each optimizer of a set (``optimizers.OptimizerSet``), each with
    its own groups' hyperparameter inputs (``hypers`` is indexed over the set's concatenated groups)."""
    with contextlib.ExitStack() as stack:
        first = 0
        for member in members(optim):
            n = len(member.param_groups)
            own = {i - first: values for i, values in hypers.items() if first <= i < first + n}
            stack.enter_context(_optimizer_swapped(member, by_real, traced_state, own, accumulation,
                                                   without_gradient, on_step))
            first += n
        yield

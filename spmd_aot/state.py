"""The live training state a compiled step reads and writes: parameters, buffers, optimizer
state and the batch, flattened into the graph's input order.

The same ``TrainState`` is built from fake objects at build time and from the user's real
objects at job start; both must produce the same layout, which is why every ordering here is
deterministic (module registration order, then sorted state keys).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections import defaultdict
from typing import Any
from unittest import mock

import torch
import torch.utils._pytree as pytree

from .errors import UnsupportedError
from .parallel.layout import TensorLayout
from .parallel.plan import Plan

__all__ = ["TrainState", "Slot", "HyperInput", "hyperparameter_inputs", "initialize_optimizer_state",
           "dtype_name"]

# Optimizers whose lazily created state is known: zeros (step counters included) but for the
# entries of ``_NONZERO_INITIAL_STATE``, so making it before the first step gives exactly eager's
# first step. Others must arrive with state.
_ZERO_INIT_OPTIMIZERS = {"SGD", "Adam", "AdamW", "Adamax", "RAdam", "RMSprop", "Adadelta", "Adagrad", "Adafactor",
                         "NAdam", "ASGD", "Rprop"}
# The entries those optimizers create with another value than zero, read from the parameter's
# group as their ``_init_group`` does: NAdam's running momentum product starts at 1, ASGD's
# step size at lr and its averaging weight at 1, Rprop's per-element step sizes at lr.
_NONZERO_INITIAL_STATE = {
    "NAdam": {"mu_product": lambda group: 1.0},
    "ASGD": {"eta": lambda group: float(group["lr"]), "mu": lambda group: 1.0},
    "Rprop": {"step_size": lambda group: float(group["lr"])},
}
# Optimizers that make all their state before the update (in ``_init_group``): their dry step
# skips the update, which for these reads tensors on the host (meta tensors have no values).
_STATE_BEFORE_UPDATE = {"Adafactor": ("torch.optim._adafactor", "adafactor"), "NAdam": ("torch.optim.nadam", "nadam"),
                        "ASGD": ("torch.optim.asgd", "asgd"), "Rprop": ("torch.optim.rprop", "rprop")}

# Optimizers whose step cannot be one fixed graph (it reads tensors on the host, ``.item()``,
# to decide what to run): refused by name, before a dry step on meta tensors fails less clearly.
_HOST_READING_OPTIMIZERS = {
    "LBFGS": "its step re-evaluates a closure and reads the loss and directional derivatives on the host",
}

# ----------------------------------------------------------------- which hyperparameters are inputs
# The one rule. A hyperparameter that is a graph input can change between steps (a scheduler
# moves it: LambdaLR the learning rate, OneCycleLR and CyclicLR Adam's betas or SGD's momentum)
# and the stored step runs with the new value, no rebuild. Every other entry of the optimizer's
# defaults (flags such as foreach, fused, amsgrad, nesterov, maximize, and the numbers below
# that torch's update reads as Python numbers) is a constant of the graph and a key ingredient.
#
# A number can be an input only where the traced update takes it as a tensor. torch 2.13's
# updates read most numbers as Python scalars (``alpha=``, ``_foreach_lerp_`` weights, powers:
# a host read, ``_local_scalar_dense``, which a stored graph refuses) and branch on
# ``weight_decay != 0``; only the learning rate reaches them as a tensor. So tracing runs SGD's,
# Adam's, AdamW's, RMSprop's, NAdam's, RAdam's, Adamax's and Adafactor's updates on tensors (``tracing/optimizers.py``) and their
# numbers are inputs; momentum and weight decay only when nonzero, because zero takes another
# path (no momentum buffer, no decay term) and so is part of the key. A group that chose torch's
# own implementation (``fused=True``, ``foreach=False``, ``differentiable=True``) runs it: only
# its learning rate is an input (fused kernels take the others as Python numbers).
_ALWAYS = "always"
_NONZERO = "nonzero"  # an input when nonzero; zero is a constant (another graph)
_TENSOR_UPDATE_INPUTS: dict[type, dict[str, str]] = {  # by exact class: a subclass may update otherwise
    torch.optim.SGD: {"momentum": _NONZERO, "dampening": _NONZERO, "weight_decay": _NONZERO},
    torch.optim.Adam: {"betas": _ALWAYS, "eps": _ALWAYS, "weight_decay": _NONZERO},
    torch.optim.AdamW: {"betas": _ALWAYS, "eps": _ALWAYS, "weight_decay": _NONZERO},
    torch.optim.RMSprop: {"alpha": _ALWAYS, "eps": _ALWAYS, "momentum": _NONZERO, "weight_decay": _NONZERO},
    torch.optim.NAdam: {"betas": _ALWAYS, "eps": _ALWAYS, "weight_decay": _NONZERO},
    torch.optim.RAdam: {"betas": _ALWAYS, "eps": _ALWAYS, "weight_decay": _NONZERO},
    torch.optim.Adamax: {"betas": _ALWAYS, "eps": _ALWAYS, "weight_decay": _NONZERO},
    # eps is (eps1 or None, eps2): a constant (None picks the dtype's epsilon)
    torch.optim.Adafactor: {"beta2_decay": _ALWAYS, "d": _ALWAYS, "weight_decay": _NONZERO},
}
_NO_TRACEABLE_TORCH_UPDATE = {torch.optim.Adafactor}  # every implementation reads on the host


@dataclasses.dataclass(frozen=True)
class HyperInput:
    """One hyperparameter value fed to the step: ``param_groups[group][name]``, or item
    ``position`` of it (each of Adam's two betas is its own input)."""

    group: int
    name: str
    position: int | None = None

    @property
    def fqn(self) -> str:
        return f"param_groups[{self.group}].{self.name}" + ("" if self.position is None else f"[{self.position}]")

    def value(self, groups: list[dict]):
        v = groups[self.group][self.name]
        if isinstance(v, torch.Tensor):  # a tensor learning rate (``_is_tensor_lr``), moved in place
            return float(v)
        return v if self.position is None else v[self.position]


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _is_tensor_lr(name: str, v) -> bool:
    """A learning rate given as a 0-dim CPU tensor (``lr=torch.tensor(1e-3)``, as torch.compile
    recipes write it; schedulers then ``fill_`` it in place): fed like a float, read by value."""
    return name == "lr" and isinstance(v, torch.Tensor) and v.dim() == 0 and v.device.type == "cpu" \
        and v.is_floating_point() and not v.requires_grad


def _input_names(optimizer_class: type, group: dict) -> dict[str, str]:
    """name -> ``_ALWAYS`` or ``_NONZERO``: which of ``group``'s numbers can be inputs."""
    chose_torch = group.get("fused") or group.get("differentiable") or group.get("foreach") is False
    if chose_torch and optimizer_class not in _NO_TRACEABLE_TORCH_UPDATE:
        return {"lr": _ALWAYS}  # the user chose torch's own implementation
    return {"lr": _ALWAYS, **_TENSOR_UPDATE_INPUTS.get(optimizer_class, {})}


def hyperparameter_inputs(optim) -> list[HyperInput]:
    """The hyperparameters ``optim`` (an optimizer or an ``optimizers.OptimizerSet``) feeds to the
    step as 0-dim float64 tensors, in layout order: by group, then name, then position."""
    return [HyperInput(i, name, pos) for i, names in enumerate(_fed_names(optim)) for name, positions in names
            for pos in positions]


def _fed_names(optim) -> list[list[tuple[str, tuple]]]:
    """Per param group: (name, positions) of its inputs, names sorted; positions ``(None,)`` for
    a number, ``(0, 1, ...)`` for a tuple of numbers."""
    if optim is None:
        return []
    out = []
    for member in getattr(optim, "members", [optim]):
        cls = type(member)
        for group in member.param_groups:
            fed = []
            for name, when in sorted(_input_names(cls, group).items()):
                value = group.get(name)
                if _is_tensor_lr(name, value):
                    value = float(value)
                items = value if isinstance(value, tuple) else (value,)
                if not items or not all(map(_is_number, items)) or (when == _NONZERO and 0 in items):
                    continue
                fed.append((name, tuple(range(len(items))) if isinstance(value, tuple) else (None,)))
            out.append(fed)
    return out


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclasses.dataclass(frozen=True)
class Slot:
    """One graph input: what it is, where it lives, and how it is laid out over the mesh."""

    kind: str  # "param" | "buffer" | "optim_state" | "hyper" | "batch"
    fqn: str
    shape: tuple[int, ...]  # global (per-rank for the batch)
    dtype: str
    device_type: str
    requires_grad: bool = False
    aliases: tuple[str, ...] = ()  # other FQNs of the same tensor (tied weights)
    layout: TensorLayout | None = None  # params and state shaped like them; None: plain tensor

    @property
    def local_shape(self) -> tuple[int, ...]:
        return self.layout.local_shape if self.layout else self.shape


class TrainState:
    """Model, optimizer and batch of one step, with a fixed flat order of their tensors.

    ``optim=None`` is a *forward-only* step (evaluation, inference): ``step(model, batch)``,
    run under ``torch.no_grad()``, with no optimizer state, learning rates or gradients.
    """

    def __init__(self, model: torch.nn.Module, optim: torch.optim.Optimizer | None, batch: Any, plan: Plan):
        self.model = model
        self.optim = optim
        self.plan = plan
        self.params = _named_unique(model.named_parameters(remove_duplicate=False))
        self.buffers = _named_unique(model.named_buffers(remove_duplicate=False))
        self.param_fqn = {id(p): names[0] for names, p in self.params}
        # Parameters whose optimizer state the step does not take: no gradient reaches them in
        # the step, so the optimizer skips them (``untaken_state``). Set by the trace, and at
        # load from the stored layout; their state is no graph input.
        self.untaken: set[int] = set()
        self._hyper_made: dict[HyperInput, tuple] = {}  # input -> (value, its tensor): ``hyper_tensors``
        if optim is not None:
            self._check_optimizer_params()
        self.batch_leaves, self.batch_spec = pytree.tree_flatten(batch)
        for i, leaf in enumerate(self.batch_leaves):
            if not isinstance(leaf, torch.Tensor):
                raise UnsupportedError(
                    f"batch leaf {i} is a {type(leaf).__name__}; a batch must be a pytree "
                    "(tuple, list, dict) of tensors"
                )

    @property
    def forward_only(self) -> bool:
        return self.optim is None

    # ----------------------------------------------------------------- optimizer state
    def _check_optimizer_params(self) -> None:
        seen = set()
        for gi, group in enumerate(self.optim.param_groups):
            for p in group["params"]:
                if id(p) not in self.param_fqn:
                    raise UnsupportedError(
                        f"optimizer param_groups[{gi}] holds a tensor of shape {tuple(p.shape)} "
                        "that is not a parameter of the model; build the optimizer from "
                        "model.parameters()"
                    )
                if id(p) in seen:
                    raise UnsupportedError(f"parameter {self.param_fqn[id(p)]} is in two param groups")
                seen.add(id(p))
            for name, value in group.items():
                # a scheduler's own entries (``initial_lr``, a tensor when lr is one) are no optimizer's input
                if name != "params" and name in self.optim.defaults and isinstance(value, torch.Tensor) \
                        and not _is_tensor_lr(name, value):
                    raise UnsupportedError(
                        f"optimizer param_groups[{gi}][{name!r}] is a tensor; pass a float"
                        + (" (a learning rate may be a 0-dim CPU tensor)" if name == "lr" else "")
                    )

    def optimizer_slots(self) -> list[tuple[torch.Tensor, str]]:
        """(parameter, state key) for every tensor of optimizer state, in layout order."""
        slots = []
        if self.optim is None:
            return slots
        for _names, p in self.params:
            if id(p) in self.untaken:
                continue
            for key in sorted(self.optim.state.get(p, {})):
                if isinstance(self.optim.state[p][key], torch.Tensor):
                    slots.append((p, key))
        return slots

    def untaken_state(self, stored: list[dict], created: set[int]) -> None:
        """Agree with a stored step's inputs (``stored``: its layout) on which parameters'
        optimizer state it takes. A parameter that has state here but none in the stored layout
        gets no gradient in the step (the trace found so), so eager's optimizer never touches
        it: state that ``initialize_optimizer_state`` made for it (``created``: their ids) is removed, as
        eager never makes it; state the user brought (a checkpoint) stays, untouched."""
        if self.optim is None:
            return
        taken = {s["fqn"] for s in stored if s["kind"] == "optim_state"}
        untaken = set()
        for names, p in self.params:
            keys = [k for k, v in self.optim.state.get(p, {}).items() if isinstance(v, torch.Tensor)]
            if keys and not any(f"{names[0]}.{k}" in taken for k in keys):
                untaken.add(id(p))
                if id(p) in created:
                    del self.optim.state[p]
        self.untaken = untaken

    def optimizer_state_structure(self) -> list:
        """Everything about optimizer state that shapes the graph (not tensor values)."""
        out = []
        if self.optim is None:
            return out
        for names, p in self.params:
            entry = {}
            for key, value in sorted(self.optim.state.get(p, {}).items()):
                if isinstance(value, torch.Tensor):
                    entry[key] = ["tensor", list(value.shape), dtype_name(value.dtype), value.device.type]
                else:
                    entry[key] = ["value", repr(value)]
            if entry:
                out.append([names[0], entry])
        return out

    # ----------------------------------------------------------------- hyperparameters
    def hyper_inputs(self) -> list[HyperInput]:
        """The hyperparameters fed to the step (``hyperparameter_inputs``): a scheduler that
        moves them needs no rebuild."""
        return hyperparameter_inputs(self.optim)

    def baked_hyperparameters(self) -> list[dict]:
        """Per group, the optimizer's own hyperparameters that are constants in the graph, and
        which are inputs (a value moving between input and constant, zero momentum for one,
        changes the graph). Compared on every step: kept cheap."""
        if self.optim is None:
            return []
        names = [k for k in self.optim.defaults if k != "params"]
        out = []
        for g, fed in zip(self.optim.param_groups, _fed_names(self.optim)):
            entry = {k: g.get(k) for k in names}
            entry.update((name, "<input>") for name, _ in fed)
            out.append(entry)
        return out

    # ----------------------------------------------------------------- flat layout
    def slots(self) -> list[Slot]:
        plan = self.plan
        out = []
        layouts = {}
        for names, p in self.params:
            layouts[id(p)] = plan.layout_for(names[0], p.shape)
            out.append(_slot("param", names, p, p.requires_grad, layouts[id(p)]))
        for names, b in self.buffers:
            out.append(_slot("buffer", names, b))
        for p, key in self.optimizer_slots():
            t = self.optim.state[p][key]
            layout = layouts[id(p)] if tuple(t.shape) == tuple(p.shape) else None
            out.append(_slot("optim_state", (f"{self.param_fqn[id(p)]}.{key}",), t, layout=layout))
        for h in self.hyper_inputs():
            out.append(Slot("hyper", h.fqn, (), "float64", "cpu"))
        spec_paths = [pytree.keystr(path) for path, _ in pytree.tree_flatten_with_path(
            pytree.tree_unflatten(self.batch_leaves, self.batch_spec))[0]]
        for path, leaf in zip(spec_paths, self.batch_leaves):
            out.append(_slot("batch", (f"batch{path}",), leaf))
        return out

    def state_tensors(self) -> list[torch.Tensor]:
        """Parameters, buffers and optimizer state, in layout order (the graph mutates them)."""
        tensors = [p for _, p in self.params] + [b for _, b in self.buffers]
        tensors += [self.optim.state[p][key] for p, key in self.optimizer_slots()]
        return tensors

    def hyper_tensors(self) -> list[torch.Tensor]:
        """The hyperparameter inputs' values as 0-dim float64 tensors; one made for a value is
        reused while the value stays (the graph only reads them), so a step pays for what moved."""
        groups = self.optim.param_groups if self.optim is not None else []
        made = self._hyper_made
        out = []
        for h in self.hyper_inputs():
            value = h.value(groups)
            held = made.get(h)
            if held is None or held[0] != value:
                held = made[h] = (value, torch.tensor(value, dtype=torch.float64))
            out.append(held[1])
        return out

    def graph_inputs(self, slots: list[Slot] | None = None, batch_leaves=None) -> list[torch.Tensor]:
        """What the graph is called with: local storage of every state tensor, the learning
        rates, the batch. Sharded tensors contribute their padded local shard."""
        slots = slots or self.slots()
        out = []
        for t, slot in zip(self.state_tensors(), slots):
            storage = getattr(t, "_spmd_aot_storage", None)
            if storage is not None:
                out.append(storage)
            elif slot.layout is not None and slot.layout.local_shape != tuple(t.shape):
                if not isinstance(t, torch._subclasses.FakeTensor):
                    raise UnsupportedError(f"{slot.kind} {slot.fqn} has no sharded storage")
                # build time: the fake full tensor stands for a shard of this shape
                out.append(torch.empty(slot.layout.local_shape, dtype=t.dtype, device=t.device))
            else:
                out.append(t)
        leaves = self.batch_leaves if batch_leaves is None else batch_leaves
        return out + self.hyper_tensors() + list(leaves)


def _named_unique(named) -> list[tuple[tuple[str, ...], torch.Tensor]]:
    by_id: dict[int, list] = {}
    order = []
    for name, t in named:
        if id(t) not in by_id:
            by_id[id(t)] = [name]
            order.append(t)
        else:
            by_id[id(t)].append(name)
    return [(tuple(by_id[id(t)]), t) for t in order]


def _slot(kind, names, t: torch.Tensor, requires_grad: bool = False, layout=None) -> Slot:
    return Slot(kind, names[0], tuple(t.shape), dtype_name(t.dtype), t.device.type,
                requires_grad, tuple(names[1:]), layout)


def initialize_optimizer_state(optim: torch.optim.Optimizer, make_zeros=None) -> list[torch.Tensor]:
    """Create the optimizer's lazily built state now, so the traced step is the steady one.

    Only parameters that can have a gradient get state, as in eager. A dry run of
    ``optim.step()`` on meta-device stand-ins (one per param group and dtype:
    ``_probed_state``) reveals which tensors the optimizer creates; they are then made for real
    as zeros, which is exactly what eager creates for the optimizers in
    ``_ZERO_INIT_OPTIMIZERS``. Parameters that already have state keep it.
    ``make_zeros(param, shape, dtype, device)`` lets sharded parameters get sharded state.
    Returns the parameters it made state for.
    """
    if hasattr(optim, "members"):  # several optimizers (optimizers.OptimizerSet): each its own
        return [p for member in optim.members for p in initialize_optimizer_state(member, make_zeros)]
    name = type(optim).__name__
    if name in _HOST_READING_OPTIMIZERS and getattr(torch.optim, name, None) is type(optim):
        raise UnsupportedError(
            f"optimizer torch.optim.{name} cannot be compiled: "
            f"{_HOST_READING_OPTIMIZERS[name]}, and a stored step cannot read tensors on the host; "
            "use torch.optim.AdamW (or Adam, SGD) in the compiled step")
    make_zeros = make_zeros or (lambda p, shape, dtype, device: torch.zeros(shape, dtype=dtype, device=device))
    # A frozen parameter (requires_grad=False: a frozen embedding or tower, all but the LoRA
    # adapters) never has a gradient, so eager's optimizer never makes state for it.
    missing = [p for g in optim.param_groups for p in g["params"] if p.requires_grad and not optim.state.get(p)]
    if not missing:
        return []
    name = type(optim).__name__
    if name not in _ZERO_INIT_OPTIMIZERS:
        raise UnsupportedError(
            f"optimizer {type(optim).__qualname__} has no state yet and its initial state is not "
            "all zeros; run one eager step (or load a checkpoint) before the first compiled step"
        )
    if name == "SGD" and any(g.get("momentum", 0) and g.get("dampening", 0) for g in optim.param_groups):
        raise UnsupportedError(
            "SGD with momentum and dampening != 0 treats its first step specially; run one "
            "eager step before the first compiled step, or use dampening=0"
        )
    on_param_device = {id(p) for g in optim.param_groups if g.get("fused") or g.get("capturable")
                       for p in g["params"]}  # where eager keeps their step counters
    created = _probed_state(optim, missing)
    fills = _NONZERO_INITIAL_STATE.get(name, {})
    group_of = {id(p): g for g in optim.param_groups for p in g["params"]}
    made = []
    for p, entries in created.items():
        state = {}
        for key, value in entries.items():
            if isinstance(value, torch.Tensor):
                device = p.device if value.device.type == "meta" or id(p) in on_param_device else value.device
                state[key] = make_zeros(p, value.shape, value.dtype, device)
                if key in fills:
                    with torch.no_grad():
                        state[key].fill_(fills[key](group_of[id(p)]))
            else:
                state[key] = value
        if state:  # SGD without momentum keeps none: no empty entry, as in eager's state_dict()
            optim.state[p] = state
            made.append(p)
    return made


_PROBE_SHAPE = (2, 3)  # a stand-in parameter's shape; state of this shape is shaped like its parameter


def _probed_state(optim: torch.optim.Optimizer, missing: list) -> dict:
    """param -> the state entries a first ``optim.step()`` creates for it (tensors on meta).

    The optimizers here create, per parameter, state shaped like the parameter or scalars,
    decided by the parameter's group and dtype alone. So one dry step runs on a single meta
    stand-in per (group, dtype) instead of on every parameter (the dry step of a 12-layer
    model's AdamW cost more than the rest of a cache hit), and the stand-in's entries are
    reshaped to each parameter. Any other shape falls back to a dry step on every parameter.
    """
    missing_ids = {id(p) for p in missing}
    probes: dict = {}  # param -> its stand-in
    per_group = []
    for g in optim.param_groups:
        by_dtype: dict = {}
        for p in g["params"]:
            if id(p) in missing_ids:
                probes[p] = by_dtype.setdefault(p.dtype, torch.empty(_PROBE_SHAPE, dtype=p.dtype, device="meta"))
        per_group.append(list(by_dtype.values()))
    seen = _dry_step(optim, per_group)
    created = {}
    for p, probe in probes.items():
        entries = {}
        for key, value in seen[probe].items():
            if isinstance(value, torch.Tensor) and tuple(value.shape) not in (_PROBE_SHAPE, ()):
                return _dry_step_every_param(optim, missing)
            if isinstance(value, torch.Tensor) and tuple(value.shape) == _PROBE_SHAPE:
                value = torch.empty(p.shape, dtype=value.dtype, device="meta")
            entries[key] = value
        created[p] = entries
    return created


def _dry_step_every_param(optim: torch.optim.Optimizer, missing: list) -> dict:
    meta = {p: torch.empty(p.shape, dtype=p.dtype, device="meta") for p in missing}  # global shape
    missing_ids = {id(p) for p in missing}
    seen = _dry_step(optim, [[meta[p] for p in g["params"] if id(p) in missing_ids] for g in optim.param_groups])
    return {p: seen[m] for p, m in meta.items()}


def _dry_step(optim: torch.optim.Optimizer, stand_ins: list[list[torch.Tensor]]) -> dict:
    """Run ``optim.step()`` once with each group's parameters replaced by ``stand_ins`` (meta
    tensors, zero gradients); returns stand-in -> the state entries the step created. The
    optimizer's own parameters, state and flags are restored."""
    for group in stand_ins:
        for m in group:
            m.grad = torch.zeros_like(m)
    saved_groups = [g["params"] for g in optim.param_groups]
    # fused kernels do not run on meta tensors; the state they create is the same
    saved_flags = [{k: g[k] for k in ("fused", "capturable") if k in g} for g in optim.param_groups]
    saved_state = optim.state
    try:
        optim.state = defaultdict(dict)
        for g, params in zip(optim.param_groups, stand_ins):
            g["params"] = params
            g.update({k: False for k in ("fused", "capturable") if k in g})
        skipped = _STATE_BEFORE_UPDATE.get(type(optim).__name__)
        with torch.no_grad(), (mock.patch(f"{skipped[0]}.{skipped[1]}", lambda *a, **k: None) if skipped
                               else contextlib.nullcontext()):
            _unhooked_step(optim)
        return {m: dict(optim.state[m]) for group in stand_ins for m in group}
    finally:
        optim.state = saved_state
        for g, params, flags in zip(optim.param_groups, saved_groups, saved_flags):
            g["params"] = params
            g.update(flags)


def _unhooked_step(optim: torch.optim.Optimizer) -> None:
    """``optim.step()`` without the wrapper ``torch.optim`` puts around every step: a dry step
    on meta stand-ins must not run the user's step hooks (they would see meta tensors), and the
    wrapper's profiler region costs a first-call import (~5 ms) that a cache hit need not pay."""
    step = getattr(type(optim).step, "__wrapped__", None)
    if step is None or not getattr(type(optim).step, "hooked", False):
        optim.step()
    else:
        step(optim)

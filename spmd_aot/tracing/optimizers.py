"""Several optimizers in one step: a list, tuple or dict of optimizers (matrices with one,
vectors with another, as Muon + AdamW recipes do), called ``step(model, optims, batch)``.

``OptimizerSet`` presents the container as the one optimizer the rest of spmd-aot reads: its
``param_groups`` are the members' group dicts, concatenated in member order (the very dicts,
so a learning-rate scheduler's writes are seen and each group's learning rate stays a graph
input), and its ``state`` is a mapping over the members' state dicts. Tracing swaps each
member (``trace._each_optimizer_swapped``) and calls the user's step with the user's container,
so ``for o in optims: o.step()`` runs every member's own update with its own hyperparameters.

It also holds how a hyperparameter that is a step input (``state.hyperparameter_inputs``) is
seen by the optimizer while tracing (``traced_hyperparameters``): a tensor where torch's update
takes one (Adam's betas), and for SGD a ``TracedNumber``, which SGD's own code compares as a
number (``momentum != 0``) while the update (``tensor_updates``) computes with the input.
"""

from __future__ import annotations

import collections
import contextlib
import importlib
from typing import Any
from unittest import mock

import torch

from ..errors import UnsupportedError

__all__ = ["OptimizerSet", "TracedNumber", "as_optimizer", "members", "schedulers_refused", "tensor_updates",
           "traced_hyperparameters", "user_object"]


def members(optim) -> list:
    """The optimizers behind ``optim`` (itself alone when it is one optimizer)."""
    return list(optim.members) if isinstance(optim, OptimizerSet) else [optim]


def user_object(optim):
    """What the user's step is called with: the container for a set."""
    return optim.container if isinstance(optim, OptimizerSet) else optim


def as_optimizer(optim):
    """``optim`` itself, or an ``OptimizerSet`` for a list, tuple or dict of optimizers."""
    if optim is None or not isinstance(optim, (list, tuple, dict)):
        return optim
    return OptimizerSet(optim)


class _MergedState(collections.abc.MutableMapping):
    """Parameter -> state entries, read from (and written to) the member that optimizes it."""

    def __init__(self, owner: OptimizerSet):
        self.owner = owner

    def _member(self, p):
        for m in self.owner.members:
            if p in m.state or any(q is p for g in m.param_groups for q in g["params"]):
                return m
        raise KeyError(p)

    def __getitem__(self, p):
        return self._member(p).state[p]

    def __setitem__(self, p, value):
        self._member(p).state[p] = value

    def __delitem__(self, p):
        del self._member(p).state[p]

    def __contains__(self, p):
        return any(p in m.state for m in self.owner.members)

    def get(self, p, default=None):
        for m in self.owner.members:
            if p in m.state:
                return m.state[p]
        return default

    def __iter__(self):
        for m in self.owner.members:
            yield from m.state

    def __len__(self):
        return sum(len(m.state) for m in self.owner.members)


class OptimizerSet:
    """A container of optimizers seen as one (see the module docstring)."""

    def __init__(self, container):
        items = list(container.values()) if isinstance(container, dict) else list(container)
        bad = [type(o).__qualname__ for o in items if not isinstance(o, torch.optim.Optimizer)]
        if bad or not items:
            raise UnsupportedError(
                f"the optimizer is a {type(container).__name__} holding {bad or 'nothing'}; a list, tuple or "
                "dict must hold torch.optim.Optimizer objects (one per parameter set), each "
                "parameter in one of them"
            )
        self.container = container
        self.members = items
        self.structure: Any = sorted(container) if isinstance(container, dict) else [type(container).__name__,
                                                                                   len(items)]
        self._state = None

    def holds(self, container) -> bool:
        """The same container with the same optimizers in it (else the step is re-resolved)."""
        if container is not self.container:
            return False
        now = list(container.values()) if isinstance(container, dict) else list(container)
        return len(now) == len(self.members) and all(a is b for a, b in zip(now, self.members))

    @property
    def param_groups(self) -> list[dict]:
        return [g for m in self.members for g in m.param_groups]

    @property
    def defaults(self) -> dict:
        merged: dict = {}
        for m in self.members:
            merged.update(m.defaults)
        return merged

    @property
    def state(self) -> _MergedState:
        """One object while no member's state dict is replaced (``load_state_dict``), so the
        runtime's identity check on it keeps working."""
        dicts = [m.state for m in self.members]
        if self._state is None or not all(a is b for a, b in zip(self._state[0], dicts)):
            self._state = (dicts, _MergedState(self))
        return self._state[1]


# ---------------------------------------------------------------------------- schedulers
@contextlib.contextmanager
def schedulers_refused():
    """While tracing the user's step: a learning-rate scheduler stepped inside it is refused.

    A scheduler's ``step()`` is Python that writes new numbers into ``param_groups``; a stored
    step replays tensor ops only, so inside it the scheduler would run once, while tracing, and
    never again: the learning rate would silently stay where the trace left it. Stepped after
    the compiled step returns, it moves the numbers the step reads as inputs."""
    from torch.optim import lr_scheduler

    def refuse(self, *args, **kwargs):
        raise UnsupportedError(
            f"the step calls {type(self).__name__}.step(){_caller()}: a compiled step replays its tensor "
            "ops only, so a learning-rate scheduler stepped inside it would move the learning rate once, "
            "while tracing, and never again; call scheduler.step() after the compiled step returns (the "
            "learning rate and the numbers schedulers move are inputs of the stored step: no rebuild)")

    classes = [lr_scheduler.LRScheduler] + [c for c in vars(lr_scheduler).values()
                                            if isinstance(c, type) and "step" in vars(c)
                                            and c is not lr_scheduler.LRScheduler]
    with contextlib.ExitStack() as stack:
        for cls in classes:
            stack.enter_context(mock.patch.object(cls, "step", refuse))
        yield


def _caller() -> str:
    """`` at file:line `code` `` of the innermost frame outside torch and spmd-aot, or ``""``."""
    import os
    import traceback

    ours = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
    skip = (os.path.dirname(os.path.dirname(torch.optim.__file__)) + os.sep, ours)
    examples = ours + "examples" + os.sep  # user code, shipped with spmd-aot
    for frame in reversed(traceback.extract_stack()[:-2]):
        name = frame.filename
        if (name.startswith(examples) or not name.startswith(skip)) and not name.startswith("<"):
            return f" at {frame.filename}:{frame.lineno} `{(frame.line or '').strip()}`"
    return ""


# ---------------------------------------------------------------------------- hyperparameter inputs
class TracedNumber(float):
    """A hyperparameter input while tracing SGD: a ``float`` with the value the key was made
    from, so SGD's own branches (``if group["momentum"] != 0``) take the path the key names,
    carrying the traced input ``tensor`` that ``tensor_updates`` computes with. Only that update
    unwraps it; torch never sees one as a Python scalar (it would bake the value)."""

    tensor: torch.Tensor

    def __new__(cls, value: float, tensor: torch.Tensor):
        self = super().__new__(cls, value)
        self.tensor = tensor
        return self


def traced_hyperparameters(optim, inputs: list, tensors: list) -> dict[int, dict[str, Any]]:
    """Global group index -> {name: what the group holds while tracing} for the step's
    hyperparameter ``inputs`` (``state.HyperInput``) and their traced ``tensors``.

    A group whose only input is the learning rate gets a tensor that requires grad (torch's
    single-tensor SGD path then multiplies by it with ``addcmul_`` instead of reading it on the
    host; the optimizer runs under no_grad, so nothing is recorded). A group with other inputs
    (SGD, Adam, AdamW: ``state._TENSOR_UPDATE_INPUTS``) gets a ``TracedNumber`` for each, a tuple
    of them for Adam's betas, and its update runs on tensors (``tensor_updates``)."""
    groups = optim.param_groups
    out: dict[int, dict[str, Any]] = {}
    for h, x in zip(inputs, tensors):
        entries = out.setdefault(h.group, {})
        if h.position is None:
            entries[h.name] = x.detach()
        else:
            held = list(entries.get(h.name, groups[h.group][h.name]))
            held[h.position] = x.detach()
            entries[h.name] = tuple(held)
    for i, entries in out.items():
        if set(entries) == {"lr"}:
            entries["lr"] = entries["lr"].requires_grad_(True)
            continue
        for name, x in entries.items():
            now = groups[i][name]
            entries[name] = tuple(map(TracedNumber, now, x)) if isinstance(x, tuple) else TracedNumber(now, x)
    return out


@contextlib.contextmanager
def tensor_updates():
    """While tracing: SGD's, Adam's (AdamW's), RMSprop's, NAdam's, RAdam's, Adamax's and Adafactor's
    updates run on tensors when their
    group holds ``TracedNumber`` inputs; torch's read those numbers as Python scalars (and
    Adafactor's reads its step counter and two norms per parameter on the host)."""
    with contextlib.ExitStack() as stack:
        for module_name, name, on_tensors in (("torch.optim.sgd", "sgd", _sgd_on_tensors),
                                              ("torch.optim.adam", "adam", _adam_on_tensors),
                                              ("torch.optim._adafactor", "adafactor", _adafactor_on_tensors),
                                              ("torch.optim.rmsprop", "rmsprop", _rmsprop_on_tensors),
                                              ("torch.optim.nadam", "nadam", _nadam_on_tensors),
                                              ("torch.optim.radam", "radam", _radam_on_tensors),
                                              ("torch.optim.adamax", "adamax", _adamax_on_tensors)):
            module = importlib.import_module(module_name)  # where the optimizer's step finds the function
            stack.enter_context(mock.patch.object(module, name, _unless_traced(getattr(module, name), on_tensors)))
        for module_name, name in _PER_TENSOR_UPDATES:
            module = importlib.import_module(module_name)
            stack.enter_context(mock.patch.object(module, name, _per_tensor(getattr(module, name))))
        yield


# Optimizers whose multi-tensor update (what tracing picks where the user left the choice to
# torch) makes a graph no load accepts, traced on their per-tensor update instead (what eager
# runs on CPU; equal to rounding): NAdam's capturable foreach path multiplies a list of 0-d step
# sizes by the gradients (``_foreach_mul`` broadcasting its first list, which the op's contract
# refuses), ASGD's clamps with ``_foreach_maximum_.Scalar``.
_PER_TENSOR_UPDATES = (("torch.optim.nadam", "nadam"), ("torch.optim.asgd", "asgd"))


def _per_tensor(original):
    def update(*args, **kwargs):
        return original(*args, **{**kwargs, "foreach": False})

    return update


def _unless_traced(original, on_tensors):
    def update(*args, **kwargs):
        if not any(isinstance(v, TracedNumber) for v in kwargs.values()):
            return original(*args, **kwargs)
        return on_tensors(*args, **kwargs)

    return update


def _number(h):
    return h.tensor if isinstance(h, TracedNumber) else h


def _sgd_on_tensors(params, grads, momentum_buffer_list, *, weight_decay, momentum, lr, dampening, nesterov,
                    maximize, grad_scale=None, found_inf=None, **_flags):
    """torch.optim.SGD's update (``_multi_tensor_sgd``) with its numbers as tensors; the
    implementation flags (foreach, fused) do not change the result beyond rounding."""
    if grad_scale is not None or found_inf is not None:
        raise UnsupportedError("SGD with a grad scaler's grad_scale/found_inf cannot be traced with a momentum or "
                               "weight decay input; unscale outside the compiled step")
    if not params:
        return
    grads = torch._foreach_mul(grads, -1.0) if maximize else list(grads)
    if weight_decay != 0:
        grads = torch._foreach_add(grads, torch._foreach_mul(params, _number(weight_decay)))
    if momentum != 0:
        if any(b is None for b in momentum_buffer_list):
            raise UnsupportedError("SGD's momentum buffers must exist before its step is traced "
                                   "(spmd_aot creates them as zeros; pass momentum > 0 at construction)")
        bufs = list(momentum_buffer_list)
        torch._foreach_mul_(bufs, _number(momentum))
        torch._foreach_add_(bufs, grads if dampening == 0 else torch._foreach_mul(grads, 1 - _number(dampening)))
        grads = torch._foreach_add(grads, torch._foreach_mul(bufs, _number(momentum))) if nesterov else bufs
    torch._foreach_add_(params, torch._foreach_mul(grads, -_number(lr)))


def _adam_on_tensors(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, *_flags, amsgrad, beta1,
                     beta2, lr, weight_decay, eps, maximize, decoupled_weight_decay=False, has_complex=False,
                     grad_scale=None, found_inf=None, **_more_flags):
    """torch.optim.Adam's and AdamW's update with its numbers as tensors, in the arithmetic of
    eager's per-tensor loop (``_single_tensor_adam``, what eager runs on CPU by default): the
    numbers are float64 as eager's Python floats are, each kernel eager calls with a scalar is
    called here with the same value as a tensor (``lerp_`` as the fused multiply-add it computes;
    ``addcmul_`` and ``addcdiv_`` with ``value=1`` on the scaled first operand, which is what their
    kernels compute first: the foreach forms of the very same kernels), so on CPU the result is
    eager's bit for bit (rounding differences would be magnified by bf16 forwards into lr-sized
    steps). DTensor parameters (``shard``, tensor parallel) are updated through their local
    shards, as eager's DTensor ops compute them; where a parameter's state is placed otherwise,
    or in a reduced precision (whose ``lerp_`` weight eager keeps in fp32), the update takes the
    multi-tensor form, equal to rounding."""
    if grad_scale is not None or found_inf is not None:
        raise UnsupportedError("Adam with a grad scaler's grad_scale/found_inf cannot be traced; unscale outside "
                               "the compiled step")
    if not params:
        return
    if has_complex:
        params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs = (
            [torch.view_as_real(t) if t.is_complex() else t for t in ts]
            for ts in (params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs))
    beta1, beta2, lr_t, eps = map(_number, (beta1, beta2, lr, eps))
    local = _local_shards(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs)
    exact = local is not None and exp_avgs[0].dtype in (torch.float32, torch.float64)
    if exact:
        _mark_updated(params)
        params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs = local
        state_steps = _local_shards(state_steps)[0]  # replicated counters (a 0-d parameter's, under shard)
    grads = torch._foreach_mul(grads, -1.0) if maximize else list(grads)
    torch._foreach_add_(state_steps, 1)
    if weight_decay != 0:
        if decoupled_weight_decay:
            torch._foreach_mul_(params, 1 - lr_t * _number(weight_decay))
        else:  # eager's grad.add(param, alpha=wd) is one fused multiply-add: equal to rounding
            grads = torch._foreach_add(grads, torch._foreach_mul(params, _number(weight_decay)))
    if exact:
        # eager's lerp_(grad, w) for w < 0.5 (beta1 > 0.5): exp_avg + w * (grad - exp_avg) in one fused
        # multiply-add, which addcmul_ computes alike (and Inductor lowers without calling back to Python)
        weight = (1 - beta1).to(exp_avgs[0].dtype)
        torch._foreach_addcmul_(exp_avgs, torch._foreach_sub(grads, exp_avgs), [weight] * len(exp_avgs), value=1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        # eager's addcmul_(grad, grad, value=v) is self + (v * grad) * grad in one kernel: the same kernel on (v * grad)
        torch._foreach_addcmul_(exp_avg_sqs, torch._foreach_mul(grads, 1 - beta2), grads, value=1)
    else:
        torch._foreach_mul_(exp_avgs, beta1)
        torch._foreach_add_(exp_avgs, torch._foreach_mul(grads, 1 - beta1))
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_add_(exp_avg_sqs, torch._foreach_mul(torch._foreach_mul(grads, grads), 1 - beta2))
    if amsgrad:
        torch._foreach_maximum_(max_exp_avg_sqs, exp_avg_sqs)
    second = max_exp_avg_sqs if amsgrad else exp_avg_sqs
    # eager: step = step_t.item(); lr / (1 - beta1 ** step); (1 - beta2 ** step) ** 0.5, in float64
    step_sizes = [lr_t / (1 - torch.pow(beta1, s)) for s in state_steps]
    correction2 = [torch.pow(1 - torch.pow(beta2, s), 0.5) for s in state_steps]
    denoms = torch._foreach_div(torch._foreach_sqrt(second), correction2)
    torch.ops.aten._foreach_add_.Tensor(denoms, eps)  # torch._foreach_add_ would pick .Scalar: a host read
    if exact:
        torch._foreach_addcdiv_(params, torch._foreach_mul(exp_avgs, [-s for s in step_sizes]), denoms, value=1)
    else:
        updates = torch._foreach_div(exp_avgs, denoms)
        torch._foreach_mul_(updates, step_sizes)
        torch._foreach_sub_(params, updates)


def _rmsprop_on_tensors(params, grads, square_avgs, grad_avgs, momentum_buffer_list, state_steps, *_flags, lr, alpha,
                        eps, weight_decay, momentum, centered, maximize=False, has_complex=False, **_more_flags):
    """torch.optim.RMSprop's update (``_single_tensor_rmsprop``, what eager runs on CPU) with its
    numbers as tensors, so a scheduler may move momentum (OneCycleLR's and CyclicLR's
    ``cycle_momentum``), alpha, eps and weight decay with no rebuild. Each of eager's scalar
    arguments is the same value as a 0-dim float64 tensor in the same kernel; DTensor parameters
    are updated through their local shards."""
    if not params:
        return
    if has_complex:
        raise UnsupportedError("RMSprop on complex parameters cannot be traced with its numbers as step inputs; "
                               "set foreach=False on the group (torch's own update, the numbers then part of the key)")
    local = _local_shards(params, grads, square_avgs, grad_avgs, momentum_buffer_list)
    if local is not None:
        _mark_updated(params)
        params, grads, square_avgs, grad_avgs, momentum_buffer_list = local
        state_steps = _local_shards(state_steps)[0]
    lr_t, alpha_t, eps_t = map(_number, (lr, alpha, eps))
    for i, param in enumerate(params):
        grad = -grads[i] if maximize else grads[i]
        state_steps[i].add_(1)
        if weight_decay != 0:
            grad = grad + param * _number(weight_decay)  # eager's grad.add(param, alpha=wd): equal to rounding
        square_avg = square_avgs[i]
        square_avg.mul_(alpha_t).addcmul_(grad * (1 - alpha_t), grad)
        if centered:
            grad_avg = grad_avgs[i]
            grad_avg.addcmul_(grad - grad_avg, (1 - alpha_t).to(grad_avg.dtype))  # eager's lerp_(grad, 1 - alpha)
            avg = square_avg.addcmul(grad_avg, grad_avg, value=-1).sqrt_()
        else:
            avg = square_avg.sqrt()
        avg = avg.add_(eps_t)
        if momentum != 0:
            buf = momentum_buffer_list[i]
            buf.mul_(_number(momentum)).addcdiv_(grad, avg)
            param.add_(buf * -lr_t)
        else:
            param.addcdiv_(grad * -lr_t, avg)


def _on_shards(params, *lists):
    """``params`` and the per-parameter ``lists`` as local shards where each parameter's tensors
    are DTensors of one placement (see ``_local_shards``), the parameters marked as updated;
    else as given. The last list is the step counters (replicated: a 0-d parameter's, under shard)."""
    local = _local_shards(params, *lists[:-1])
    if local is None:
        return (params, *lists)
    _mark_updated(params)
    return (*local, _local_shards(lists[-1])[0])


def _no_complex(has_complex: bool, name: str) -> None:
    if has_complex:
        raise UnsupportedError(f"{name} on complex parameters cannot be traced with its numbers as step inputs; set "
                               "foreach=False on the group (torch's own update, its numbers then part of the key)")


def _first_moment_(exp_avg, grad, beta1) -> None:
    """eager's ``exp_avg.lerp_(grad, 1 - beta1)``: one fused multiply-add, as ``addcmul_`` computes it."""
    exp_avg.addcmul_(grad - exp_avg, (1 - beta1).to(exp_avg.dtype))


def _second_moment_(exp_avg_sq, grad, beta2) -> None:
    """eager's ``exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)``."""
    exp_avg_sq.mul_(beta2).addcmul_(grad * (1 - beta2), grad)


def _decayed(param, grad, lr, weight_decay, decoupled: bool):
    """Weight decay as eager applies it: the parameter scaled (decoupled) or the gradient grown."""
    if weight_decay == 0:
        return grad
    if decoupled:
        param.mul_(1 - lr * _number(weight_decay))
        return grad
    return grad + param * _number(weight_decay)  # eager's grad.add(param, alpha=wd): equal to rounding


def _nadam_on_tensors(params, grads, exp_avgs, exp_avg_sqs, mu_products, state_steps, *_flags, beta1, beta2, lr,
                      weight_decay, momentum_decay, eps, decoupled_weight_decay=False, maximize=False,
                      has_complex=False, **_more_flags):
    """torch.optim.NAdam's update (``_single_tensor_nadam``, what eager runs on CPU) with betas,
    eps and weight decay as tensors: eager's Python floats (float64) are 0-dim float64 tensors,
    its step counter and momentum product read as values are the tensors themselves."""
    if not params:
        return
    _no_complex(has_complex, "NAdam")
    params, grads, exp_avgs, exp_avg_sqs, mu_products, state_steps = _on_shards(
        params, grads, exp_avgs, exp_avg_sqs, mu_products, state_steps)
    beta1, beta2, lr_t, eps_t = map(_number, (beta1, beta2, lr, eps))
    f64 = torch.float64
    for i, param in enumerate(params):
        grad = -grads[i] if maximize else grads[i]
        state_steps[i].add_(1)
        step = state_steps[i].to(f64)
        bias_correction2 = 1 - torch.pow(beta2, step)
        grad = _decayed(param, grad, lr_t, weight_decay, decoupled_weight_decay)
        mu = beta1 * (1.0 - 0.5 * torch.pow(0.96, step * momentum_decay))
        mu_next = beta1 * (1.0 - 0.5 * torch.pow(0.96, (step + 1) * momentum_decay))
        mu_products[i].mul_(mu)
        _first_moment_(exp_avgs[i], grad, beta1)
        _second_moment_(exp_avg_sqs[i], grad, beta2)
        denom = exp_avg_sqs[i].div(bias_correction2).sqrt().add_(eps_t)
        mu_product = mu_products[i].to(f64)
        param.addcdiv_(grad * (-lr_t * (1.0 - mu) / (1.0 - mu_product)), denom)
        param.addcdiv_(exp_avgs[i] * (-lr_t * mu_next / (1.0 - mu_product * mu_next)), denom)


def _radam_on_tensors(params, grads, exp_avgs, exp_avg_sqs, state_steps, *_flags, beta1, beta2, lr, weight_decay,
                      eps, decoupled_weight_decay=False, maximize=False, has_complex=False, **_more_flags):
    """torch.optim.RAdam's update (``_single_tensor_radam``) with its numbers as tensors; the
    rectification branch (``rho_t > 5``) is a ``torch.where`` on the update, as torch's own
    capturable path writes it."""
    if not params:
        return
    _no_complex(has_complex, "RAdam")
    params, grads, exp_avgs, exp_avg_sqs, state_steps = _on_shards(params, grads, exp_avgs, exp_avg_sqs, state_steps)
    beta1, beta2, lr_t, eps_t = map(_number, (beta1, beta2, lr, eps))
    for i, param in enumerate(params):
        grad = -grads[i] if maximize else grads[i]
        state_steps[i].add_(1)
        step = state_steps[i].to(torch.float64)
        grad = _decayed(param, grad, lr_t, weight_decay, decoupled_weight_decay)
        _first_moment_(exp_avgs[i], grad, beta1)
        _second_moment_(exp_avg_sqs[i], grad, beta2)
        bias_correction1 = 1 - torch.pow(beta1, step)
        bias_correction2 = 1 - torch.pow(beta2, step)
        update = exp_avgs[i] / bias_correction1 * lr_t
        rho_inf = 2 / (1 - beta2) - 1
        rho_t = rho_inf - 2 * step * torch.pow(beta2, step) / bias_correction2
        rect = torch.sqrt((rho_t - 4) * (rho_t - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho_t))
        adaptive = torch.sqrt(bias_correction2) / exp_avg_sqs[i].sqrt().add_(eps_t)
        param.sub_(torch.where(rho_t > 5.0, update * adaptive * rect, update))


def _adamax_on_tensors(params, grads, exp_avgs, exp_infs, state_steps, *_flags, eps, beta1, beta2, lr, weight_decay,
                       maximize=False, has_complex=False, **_more_flags):
    """torch.optim.Adamax's update (``_single_tensor_adamax``) with its numbers as tensors."""
    if not params:
        return
    _no_complex(has_complex, "Adamax")
    params, grads, exp_avgs, exp_infs, state_steps = _on_shards(params, grads, exp_avgs, exp_infs, state_steps)
    beta1, beta2, lr_t, eps_t = map(_number, (beta1, beta2, lr, eps))
    for i, param in enumerate(params):
        grad = -grads[i] if maximize else grads[i]
        state_steps[i].add_(1)
        grad = _decayed(param, grad, lr_t, weight_decay, False)
        _first_moment_(exp_avgs[i], grad, beta1)
        exp_inf = exp_infs[i]
        exp_inf.copy_(torch.maximum(exp_inf.mul_(beta2), grad.abs().add_(eps_t)))
        step_size = lr_t / (1 - torch.pow(beta1, state_steps[i].to(torch.float64)))
        param.addcdiv_(exp_avgs[i] * -step_size, exp_inf)


def _mark_updated(params) -> None:
    """Bump the version of each DTensor parameter about to be updated through its local shard:
    an in-place op on the shard leaves the DTensor's own version alone, and a shard group's
    gather (``parallel/groups.py``) reads versions to refuse a forward that would read the
    values it gathered before this update (the model's eval forward after ``optim.step()``)."""
    from torch.distributed.tensor import DTensor

    for p in params:
        if isinstance(p, DTensor):
            torch.autograd.graph.increment_version(p)


def _local_shards(*lists):
    """``lists`` with every DTensor replaced by its local tensor (a view: in-place updates reach
    the DTensor), if each parameter's tensors across the lists are all plain or all DTensors of one
    placement (elementwise math on them is then the same on the shards); else None."""
    from torch.distributed.tensor import DTensor

    for tensors in zip(*(ts for ts in lists if ts)):
        kinds = {(t.placements, t.device_mesh) if isinstance(t, DTensor) else None for t in tensors}
        if len(kinds) != 1:
            return None
    return tuple([t.to_local() if isinstance(t, DTensor) else t for t in ts] for ts in lists)


def _adafactor_on_tensors(params, grads, row_vars, col_vars, variances, state_steps, *_flags, d, lr, beta2_decay,
                          weight_decay, eps1, eps2, maximize, grad_scale=None, found_inf=None, **_more_flags):
    """torch.optim.Adafactor's update (``_single_tensor_adafactor``, what eager runs by default)
    with every number a tensor: the step counter, the relative step size and the update's RMS
    clipping, which eager reads on the host (``.item()``), are float64 tensor ops here, as
    eager's Python floats are doubles."""
    if grad_scale is not None or found_inf is not None:
        raise UnsupportedError("Adafactor with a grad scaler's grad_scale/found_inf cannot be traced; unscale "
                               "outside the compiled step")
    from torch.distributed.tensor import DTensor

    if any(isinstance(p, DTensor) for p in params):
        raise UnsupportedError(
            "torch.optim.Adafactor cannot update parameters sharded over the mesh (placement='shard' or a "
            "tensor-parallel plan): its factored second moments (row and column means of each gradient) are "
            "not laid out like the parameter, and torch's own Adafactor fails under fully_shard too; use "
            "placement='replicate' with Adafactor, or AdamW with placement='shard'")
    f64 = torch.float64
    lr, beta2_decay, d = map(_number, (lr, beta2_decay, d))
    for param, grad, row_var, col_var, variance, step in zip(params, grads, row_vars, col_vars, variances,
                                                             state_steps):
        grad = -grad if maximize else grad
        floor = eps1 if eps1 is not None else torch.finfo(param.dtype).eps
        step.add_(1)
        t = step.to(f64)
        weight = torch.pow(t, beta2_decay)  # 1 - beta2_t
        rho = torch.clamp(1 / torch.sqrt(t), max=lr)
        alpha = torch.clamp(param.norm(2).to(f64) / (param.numel() ** 0.5), min=_number(eps2)) * rho
        if weight_decay != 0:
            param.mul_(1 - lr * _number(weight_decay))
        if grad.dim() > 1:
            row_mean = torch.linalg.vector_norm(grad, dim=-1, keepdim=True).square() / grad.size(-1)
            row_var.copy_(row_var + (row_mean - row_var) * weight.to(row_var.dtype))
            col_mean = torch.linalg.vector_norm(grad, dim=-2, keepdim=True).square() / grad.size(-2)
            col_var.copy_(col_var + (col_mean - col_var) * weight.to(col_var.dtype))
            estimate = (row_var @ col_var) / torch.clamp(row_var.mean(dim=-2, keepdim=True), min=floor)
        else:
            variance.copy_(variance + (grad * grad - variance) * weight.to(variance.dtype))
            estimate = variance
        update = torch.rsqrt(torch.clamp(estimate, min=floor * floor)) * grad
        denom = torch.clamp(update.norm(2).to(f64) / ((update.numel() ** 0.5) * d), min=1.0)
        param.add_(update * (-alpha / denom).to(param.dtype))

"""The two rows of ``bench_start.py`` that are torch's own ahead-of-time paths, built and loaded.

aot_compile whole step
    ``torch.compile(whole_step, fullgraph=True).aot_compile(...)``: forward, backward and AdamW
    traced by Dynamo as ONE graph and compiled by Inductor as one artifact, saved with
    ``save_compiled_function`` and loaded with ``torch.compiler.load_compiled_function``. The
    user's ``train_step`` does not go through as written, which is why ``whole_step`` differs:
    ``loss.backward()`` traces only with ``torch._dynamo.config.trace_autograd_ops``;
    ``optimizer.step()`` always breaks the graph (torch.optim's ``_use_grad`` calls
    ``graph_break()``; calling the undecorated step instead fails on the gradients backward just
    set, "pending mutation on parameter"); ``optimizer.zero_grad()`` is skipped by Dynamo. So the
    step calls torch's functional AdamW (``torch.optim.adamw.adamw``, what ``AdamW.step`` runs) on
    the optimizer's own state and hyperparameters and sets the gradients to None itself. The
    graph takes the AdamW state as inputs, so the state exists before the first call
    (``init_adamw_state``: what AdamW's first step creates). The saved file holds Inductor's
    generated code, not its built C++ libraries: a load finds them in the Inductor cache the
    save filled (the tool's children share it) or compiles them again (a compiler, seconds).
export + AOTInductor
    ``torch.export`` cannot trace ``torch.autograd.grad`` (export runs on tensors without
    storage), so the loss and gradients (``torch.func.grad_and_value`` over
    ``functional_call``) are first traced to an ATen graph with ``make_fx``, that graph is
    exported and compiled by ``aoti_compile_and_package`` into a ``.pt2``; the parameters are
    inputs, not constants baked into the package, so one package serves every step. A loaded
    package returns loss and gradients; AdamW runs eager on them (``.grad``, ``optim.step()``).

The parent builds both (untimed, ``build``); every child loads its row's file as part of its
first call (``step_for``).
"""

from __future__ import annotations

import os
import time

import torch
from torch.nn import functional as F
from torch.optim.adamw import adamw as functional_adamw

AOT_COMPILE = "aot_compile whole step"
AOTI = "export + AOTInductor"
ROWS = (AOT_COMPILE, AOTI)
FILES = {AOT_COMPILE: "whole_step.aot", AOTI: "loss_and_grads.pt2"}


def _loss(model, batch):
    """The loss of ``spmd_aot.examples.models.train_step``."""
    x, y = batch
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def init_adamw_state(optim) -> None:
    """AdamW's state as its first step creates it (lazily, in eager): the compiled whole step
    takes it as graph inputs, so it must exist before the first call."""
    for group in optim.param_groups:
        for p in group["params"]:
            if not optim.state[p]:
                optim.state[p] = {"step": torch.tensor(0.0, dtype=torch.get_default_dtype()),
                                  "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                                  "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}


def whole_step(model, optim, batch):
    """Forward, backward, AdamW, gradients to None: ``train_step`` as Dynamo takes it in one graph
    (see the module docstring for why each line differs)."""
    loss = _loss(model, batch)
    loss.backward()
    for group in optim.param_groups:
        params = group["params"]
        states = [optim.state[p] for p in params]
        with torch.no_grad():
            functional_adamw(params, [p.grad for p in params], [s["exp_avg"] for s in states],
                             [s["exp_avg_sq"] for s in states], [], [s["step"] for s in states],
                             foreach=group["foreach"], capturable=False, differentiable=False, fused=None,
                             amsgrad=group["amsgrad"], beta1=group["betas"][0], beta2=group["betas"][1],
                             lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"],
                             maximize=group["maximize"])
        for p in params:
            p.grad = None
    return loss.detach()


def save_aot_compile(model, optim, batch, path: str, backend="inductor") -> None:
    """Compile ``whole_step`` ahead of time for these objects' shapes and save it to ``path``."""
    init_adamw_state(optim)
    with torch._dynamo.config.patch(trace_autograd_ops=True):
        compiled = torch.compile(whole_step, fullgraph=True, backend=backend).aot_compile(
            ((model, optim, batch), {}))
    compiled.save_compiled_function(path)


def load_aot_compile(path: str):
    """``step(model, optim, batch)`` running the saved whole step."""
    with open(path, "rb") as f:
        compiled = torch.compiler.load_compiled_function(f, f_globals=globals())

    def step(model, optim, batch):
        init_adamw_state(optim)
        return compiled(model, optim, batch)

    return step


class LossAndGrads(torch.nn.Module):
    """``(x, y, *parameters) -> (loss, *gradients)`` of the model, parameters as inputs."""

    def __init__(self, model):
        super().__init__()
        self.model = model
        self.names = [name for name, _ in model.named_parameters()]

    def forward(self, x, y, *params):
        def loss_of(values):
            return _loss(lambda idx: torch.func.functional_call(self.model, dict(zip(self.names, values)), (idx,)),
                         (x, y))

        grads, loss = torch.func.grad_and_value(loss_of)(tuple(params))
        return (loss, *grads)


def export_loss_and_grads(model, batch):
    """The exported program of ``LossAndGrads``: its ATen joint graph (``make_fx``), exported."""
    from torch.fx.experimental.proxy_tensor import make_fx

    params = tuple(p.detach() for p in model.parameters())
    joint = make_fx(LossAndGrads(model), tracing_mode="fake")(*batch, *params)
    return torch.export.export(joint, (*batch, *params))


def save_aoti(model, batch, path: str) -> None:
    """Compile the exported loss and gradients with AOTInductor into the package ``path``."""
    torch._inductor.aoti_compile_and_package(export_loss_and_grads(model, batch), package_path=path)


def adamw_on(loss_and_grads):
    """``step(model, optim, batch)``: loss and gradients from ``loss_and_grads``, AdamW eager."""

    def step(model, optim, batch):
        loss, *grads = loss_and_grads(*batch, *(p.detach() for p in model.parameters()))
        for p, grad in zip(model.parameters(), grads):
            p.grad = grad
        optim.step()
        optim.zero_grad()
        return loss

    return step


def load_aoti(path: str):
    """``step(model, optim, batch)`` running the loaded package, then AdamW eager."""
    return adamw_on(torch._inductor.aoti_load_package(path))


def build(objects, folder: str) -> float:
    """Both artifacts into ``folder`` from ``objects()`` (fresh model, optimizer, batch); seconds."""
    start = time.perf_counter()
    model, optim, batch = objects()
    save_aot_compile(model, optim, batch, os.path.join(folder, FILES[AOT_COMPILE]))
    model, _, batch = objects()
    save_aoti(model, batch, os.path.join(folder, FILES[AOTI]))
    return time.perf_counter() - start


def step_for(row: str, folder: str):
    """``step(model, optim, batch)`` of one row, loading its file at the first call: the other
    rows' first call holds their load (or compile) too."""
    path, load = os.path.join(folder, FILES[row]), (load_aot_compile if row == AOT_COMPILE else load_aoti)
    loaded = []

    def step(model, optim, batch):
        if not loaded:
            loaded.append(load(path))
        return loaded[0](model, optim, batch)

    return step


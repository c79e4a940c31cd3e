"""Train steps as users write them, run eagerly (DDP / FSDP2) and compiled on real
gloo ranks: gradient accumulation, several optimizers, module copies, loss scaling."""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree

import spmd_aot
from spmd_aot.examples.models import MLP

MICRO = 2  # micro-batches per optimizer step


def gradient_sync(model, enabled: bool):
    """What an eager user writes around a micro-batch's backward: DDP's ``no_sync``, FSDP2's
    ``set_requires_gradient_sync``; nothing on a plain module (the compiled step)."""
    if hasattr(model, "no_sync"):
        return contextlib.nullcontext() if enabled else model.no_sync()
    if hasattr(model, "set_requires_gradient_sync"):
        model.set_requires_gradient_sync(enabled)
    return contextlib.nullcontext()


def accumulation_step(model, optim, batch):
    """HF Trainer's gradient_accumulation_steps: loss / n, backward per micro-batch, one step."""
    x, y = batch
    total = 0.0
    for i, (xs, ys) in enumerate(zip(x.chunk(MICRO), y.chunk(MICRO))):
        with gradient_sync(model, i == MICRO - 1):
            loss = F.cross_entropy(model(xs), ys) / MICRO
            loss.backward()
        total = total + loss.detach()
    optim.step()
    optim.zero_grad()
    return total


def plain_step(model, optim, batch):
    x, y = batch
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def class_batch(rank, step, n=8, d=12, classes=5):
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(n, d, generator=g), torch.randint(0, classes, (n,), generator=g)


def mlp():
    return MLP(12, 24, 5)


def sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2)


# ---------------------------------------------------------------------------- several optimizers
def matrices_and_vectors(model):
    """As Muon + AdamW recipes split them: matrices with one optimizer, vectors with another,
    each with its own hyperparameters and learning rate."""
    matrices = [p for p in model.parameters() if p.ndim >= 2]
    vectors = [p for p in model.parameters() if p.ndim < 2]
    return [torch.optim.SGD(matrices, lr=0.05, momentum=0.9, nesterov=True),
            torch.optim.AdamW(vectors, lr=1e-2, betas=(0.8, 0.95), weight_decay=0.1)]


def optimizer_dict(model):
    """A dict of optimizers; the AdamW has two param groups with different learning rates."""
    named = dict(model.named_parameters())
    first = [p for n, p in named.items() if n.startswith("fc1")]
    rest = [p for n, p in named.items() if not n.startswith("fc1")]
    return {"adamw": torch.optim.AdamW([{"params": first[:1]}, {"params": first[1:], "lr": 3e-3}], lr=1e-2),
            "sgd": torch.optim.SGD(rest, lr=0.1)}


def several_optimizers_step(model, optims, batch):
    x, y = batch
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    for o in (optims.values() if isinstance(optims, dict) else optims):
        o.step()
        o.zero_grad()
    return loss


# name -> (model factory, optimizer factory, step)
JOBS = {
    "accumulation_sgd": (mlp, sgd, accumulation_step),
    "accumulation_adamw": (mlp, adamw, accumulation_step),
    "optimizer_list": (mlp, matrices_and_vectors, several_optimizers_step),
    "optimizer_dict": (mlp, optimizer_dict, several_optimizers_step),
}
PLACEMENTS = {"replicate": "ddp", "shard": "fsdp2"}


def _eager_model(model, placement, world):
    if PLACEMENTS[placement] == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    if hasattr(model, "ema"):  # FSDP2 users shard the EMA copy as its own unit, like the model
        fully_shard(model.ema, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _leaves(x):
    if isinstance(x, torch.optim.Optimizer):
        return [x]
    if isinstance(x, dict):
        return [o for v in x.values() for o in _leaves(v)]
    if isinstance(x, (list, tuple)):
        return [o for v in x for o in _leaves(v)]
    return []


def run(name, placement, rank, world, steps, cache_dir):
    """Eager and compiled, same seeds and batches: the largest differences and the step."""
    make_model, make_optim, step = JOBS[name]
    torch.manual_seed(0)
    ref_model = make_model()
    wrapped = _eager_model(ref_model, placement, world)
    ref_optim = make_optim(ref_model)
    ref_losses = [step(wrapped, ref_optim, class_batch(rank, s)) for s in range(steps)]
    torch.manual_seed(0)
    model = make_model()
    optim = make_optim(model)
    fn = spmd_aot.compile(step, placement=placement, cache_dir=cache_dir)
    losses = [fn(model, optim, class_batch(rank, s)) for s in range(steps)]
    diffs = {"param": max((full(a).float() - full(b).float()).abs().max().item()
                          for a, b in zip(ref_model.state_dict().values(), model.state_dict().values())),
             "loss": max(float((full(a) - full(b)).abs().max()) for a, b in
                         zip(pytree.tree_leaves(ref_losses), pytree.tree_leaves(losses)))}
    state = []
    for o1, o2 in zip(_leaves(ref_optim), _leaves(optim)):
        s1, s2 = o1.state_dict()["state"], o2.state_dict()["state"]
        state += [(full(s1[i][k]).float() - full(s2[i][k]).float()).abs().max().item()
                  for i in s1 for k in s1[i] if isinstance(s1[i][k], torch.Tensor)]
    diffs["state"] = max(state or [0.0])
    return diffs, fn


class Blocks(torch.nn.Module):
    """Two blocks (two resharded shard groups) and a root head."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.Sequential(torch.nn.Linear(12, 24), torch.nn.Tanh(), torch.nn.Linear(24, 24))
        self.head = torch.nn.Linear(24, 5)

    def forward(self, x):
        return self.head(self.blocks(x))


def job(name, model=None):
    make_model, make_optim, step = JOBS[name]
    return spmd_aot.Job(step=step, model=model or make_model, optimizer=make_optim,
                        batch=lambda: class_batch(0, 0))


def compiled_again(name, placement, rank, cache_dir):
    """A fresh process's view: new objects, the same cache; returns whether it hit."""
    make_model, make_optim, step = JOBS[name]
    torch.manual_seed(0)
    model = make_model()
    fn = spmd_aot.compile(step, placement=placement, cache_dir=cache_dir)
    fn(model, make_optim(model), class_batch(rank, 0))
    return fn.cache_info.hit


# ---------------------------------------------------------------------------- data-dependent code
def scaler_step(model, optim, batch):
    """torch.amp.GradScaler: its skip decision reads found_inf on the host (``.item()``)."""
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    x, y = batch
    loss = F.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    scaler.step(optim)
    scaler.update()
    optim.zero_grad()
    return loss


def item_step(model, optim, batch):
    x, y = batch
    loss = F.cross_entropy(model(x), y)
    if loss.item() > 100.0:  # a host-side check
        loss = loss * 0
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


class Routed(torch.nn.Module):
    """Data-dependent code inside a module's forward (``nonzero``)."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(12, 5)

    def forward(self, x):
        keep = (x[:, 0] > 0).nonzero().squeeze(-1)
        return self.fc(x.index_select(0, keep))


def bool_step(model, optim, batch):
    x, y = batch
    loss = F.cross_entropy(model(x), y)
    if torch.isfinite(loss):  # bool(tensor)
        loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


# ---------------------------------------------------------------------------- module copies
class WithEMA(torch.nn.Module):
    """A model and its EMA copy, made with ``copy.deepcopy`` in the factory (frozen)."""

    def __init__(self):
        super().__init__()
        import copy

        self.net = mlp()
        self.ema = copy.deepcopy(self.net).requires_grad_(False)

    def forward(self, x):
        return self.net(x)


def ema_step(model, optim, batch):
    """The EMA's loss as a metric (before its update), then its update under no_grad after
    the optimizer step."""
    inner = getattr(model, "module", model)  # eager DDP wraps the module
    x, y = batch
    loss = F.cross_entropy(model(x), y)
    with torch.no_grad():
        ema_loss = F.cross_entropy(inner.ema(x), y)
    loss.backward()
    optim.step()
    optim.zero_grad()
    with torch.no_grad():
        for e, p in zip(inner.ema.parameters(), inner.net.parameters()):
            e.mul_(0.99).add_(p, alpha=0.01)
    return {"loss": loss, "ema_loss": ema_loss}


def ema_read_after_update_step(model, optim, batch):
    """The EMA's forward after its update in the same step."""
    x, y = batch
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optim.step()
    optim.zero_grad()
    with torch.no_grad():
        for e, p in zip(model.ema.parameters(), model.net.parameters()):
            e.mul_(0.99).add_(p, alpha=0.01)
        return {"loss": loss, "ema_loss": F.cross_entropy(model.ema(x), y)}




def ema_adamw(model):
    return torch.optim.AdamW(getattr(model, "net", model).parameters(), lr=1e-2)


JOBS["ema_copy"] = (WithEMA, ema_adamw, ema_step)


# ---------------------------------------------------------------------------- activation checkpointing
CKPT_ROWS, CKPT_D, CKPT_HIDDEN, CKPT_BLOCKS = 512, 32, 128, 4  # activations >> parameters + AdamW state


class CheckpointedMLP(torch.nn.Module):
    """Residual MLP blocks, each optionally run under non-reentrant ``torch.utils.checkpoint``
    (what HF ``gradient_checkpointing_enable`` does): a model whose activations dominate
    (512 rows x hidden 128 per block against ~34K parameters)."""

    def __init__(self, checkpoint: bool):
        super().__init__()
        self.checkpoint = checkpoint
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(CKPT_D, CKPT_HIDDEN), torch.nn.GELU(),
                                torch.nn.Linear(CKPT_HIDDEN, CKPT_D))
            for _ in range(CKPT_BLOCKS))
        self.head = torch.nn.Linear(CKPT_D, 5)

    def forward(self, x):
        for block in self.blocks:
            if self.checkpoint:
                x = x + torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
            else:
                x = x + block(x)
        return self.head(x)


def ckpt_batch(rank=0, step=0):
    return class_batch(rank, step, n=CKPT_ROWS, d=CKPT_D)


def ckpt_job(checkpoint: bool):
    return spmd_aot.Job(step=plain_step, model=lambda: CheckpointedMLP(checkpoint), optimizer=adamw,
                        batch=ckpt_batch)

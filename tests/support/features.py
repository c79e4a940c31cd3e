"""Feature jobs for parity tests: each is (model factory, optimizer factory, step, batch, seed
policy), run eagerly (DDP / FSDP2 / HSDP) and compiled, on real gloo ranks."""

from __future__ import annotations


import torch
import torch.nn.functional as F
from torch import nn

import spmd_aot
from spmd_aot.examples.models import MLP, train_step


# ---------------------------------------------------------------------------- models
class KitchenSink(nn.Module):
    """Constants, factory ops, shape arithmetic, cat/stack/slicing, log_softmax + nll_loss."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(12, 16)
        self.out = nn.Linear(24, 5)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        n = h.numel() // h.shape[0]  # shape arithmetic
        pos = torch.arange(h.shape[1], device=x.device, dtype=h.dtype) / n
        scale = torch.full((1, h.size(1)), 0.5, device=x.device) + torch.scalar_tensor(0.25, device=x.device)
        h = h * scale + pos
        h = h * (h.stride(0) / h.stride(0))  # stride arithmetic
        halves = torch.stack([h[:, : n // 2], h[:, n // 2:]], dim=0)  # slicing + stack
        h2 = torch.cat([halves[0], halves[1], h], dim=1)[:, 8:40]  # cat + slicing
        return F.log_softmax(self.out(h2), dim=-1)


def nll_step(model, optim, batch):
    x, y = batch
    loss = F.nll_loss(model(x), y)
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


class BNNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(12, 16)
        self.bn = nn.BatchNorm1d(16)
        self.head = nn.Linear(16, 5)

    def forward(self, x):
        return self.head(torch.relu(self.bn(self.fc(x))))


class DropNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(12, 32)
        self.drop = nn.Dropout(0.3)
        self.head = nn.Linear(32, 5)

    def forward(self, x):
        return self.head(self.drop(torch.relu(self.fc(x))))


class TiedLM(nn.Module):
    """An embedding shared with the output head (tied parameters)."""

    def __init__(self, vocab=40, d=16):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.mix = nn.Linear(d, d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx):
        return self.head(torch.tanh(self.mix(self.emb(idx))))


def clip_step(model, optim, batch):
    x, y = batch
    loss = F.cross_entropy(model(x).reshape(-1, 5), y.reshape(-1)) * 50.0  # big grads: clipping bites
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5)
    optim.step()
    optim.zero_grad()
    return loss


def autocast_step(model, optim, batch):
    x, y = batch
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(x)
    loss = F.cross_entropy(logits.float(), y)
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def _class_batch(rank, step, n=4, d=12, classes=5):
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(n, d, generator=g), torch.randint(0, classes, (n,), generator=g)


def _token_batch(rank, step, n=4, t=6, vocab=40):
    g = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randint(0, vocab, (n, t), generator=g)
    return x, torch.randint(0, vocab, (n, t), generator=g)


def _groups(model, **kw):
    decay = [p for n, p in model.named_parameters() if p.ndim > 1]
    no_decay = [p for n, p in model.named_parameters() if p.ndim <= 1]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                              {"params": no_decay, "weight_decay": 0.0, "lr": 5e-3}], lr=1e-2, **kw)


# name -> (model factory, optimizer factory, step, batch(rank, step), tolerance)
FEATURES = {
    "sgd_nesterov_wd": (lambda: MLP(12, 24, 5), lambda m: torch.optim.SGD(
        m.parameters(), lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01), train_step, _class_batch, 1e-5),
    "sgd_foreach": (lambda: MLP(12, 24, 5), lambda m: torch.optim.SGD(
        m.parameters(), lr=0.05, momentum=0.9, foreach=True), train_step, _class_batch, 1e-5),
    "adam": (lambda: MLP(12, 24, 5), lambda m: torch.optim.Adam(m.parameters(), lr=1e-2), train_step,
             _class_batch, 1e-5),
    "adamw_foreach": (lambda: MLP(12, 24, 5), lambda m: torch.optim.AdamW(
        m.parameters(), lr=1e-2, foreach=True), train_step, _class_batch, 1e-5),
    "adamw_fused": (lambda: MLP(12, 24, 5), lambda m: torch.optim.AdamW(
        m.parameters(), lr=1e-2, fused=True), train_step, _class_batch, 1e-5),
    "param_groups": (lambda: MLP(12, 24, 5), _groups, train_step, _class_batch, 1e-5),
    "grad_clipping": (lambda: MLP(12, 24, 5), lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
                      clip_step, _class_batch, 1e-5),
    "batchnorm_buffers": (BNNet, lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
                          train_step, _class_batch, 1e-5),
    "tied_parameters": (TiedLM, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2), train_step,
                        _token_batch, 1e-5),
    "dropout": (DropNet, lambda m: torch.optim.SGD(m.parameters(), lr=0.1), train_step, _class_batch, 1e-5),
    "constants_shapes_cat_nll": (KitchenSink, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2),
                                 nll_step, _class_batch, 1e-5),
    # bf16 autocast: matmuls round to 8 mantissa bits; the same ops in the same order agree to
    # about 1e-2 relative after 5 steps, and usually exactly (see README).
    "bf16_autocast": (lambda: MLP(12, 24, 5), lambda m: torch.optim.SGD(m.parameters(), lr=0.05),
                      autocast_step, _class_batch, 2e-2),
}


# ---------------------------------------------------------------------------- variants
# variant -> (compile options, reference: "ddp" | "fsdp2"); HSDP needs 4 ranks.
VARIANTS = {
    "replicate": ({"placement": "replicate"}, "ddp"),
    "shard": ({"placement": "shard"}, "fsdp2"),
    # keeping some parameters whole changes the layout, not the math or the buffer semantics
    "shard_keep_1d_whole": ({"placement": "shard", "param_placements": {"*bias": "replicate",
                                                                         "*bn*": "replicate"}}, "fsdp2"),
    "hsdp": ({"placement": "shard", "mesh_shape": (2, 2)}, "fsdp2"),
    "hsdp_keep_1d_whole": ({"placement": "shard", "mesh_shape": (2, 2),
                            "param_placements": {"*bias": "replicate", "*bn*": "replicate"}}, "fsdp2"),
}


def reference(feature, variant, rank, world, steps, seed=0):
    """Eager DDP, or FSDP2 ``fully_shard`` (HSDP on a 2-D mesh), on the same batches and RNG."""
    make_model, make_optim, step, batch, _ = FEATURES[feature]
    options, kind = VARIANTS[variant]
    torch.manual_seed(seed)
    model = make_model()
    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        wrapped = DistributedDataParallel(model) if world > 1 else model
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        shape = tuple(options.get("mesh_shape") or (world,))
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard")[-len(shape):])
        fully_shard(model, mesh=mesh)
        wrapped = model
    optim = make_optim(model)
    torch.manual_seed(100 + rank)  # per-rank RNG stream (dropout), as a DDP job seeds it
    losses = [step(wrapped, optim, batch(rank, s)).detach().float() for s in range(steps)]
    return model, optim, losses


def compiled(feature, variant, rank, world, steps, cache_dir, seed=0, **kw):
    make_model, make_optim, step, batch, _ = FEATURES[feature]
    options, _ = VARIANTS[variant]
    torch.manual_seed(seed)
    model = make_model()
    optim = make_optim(model)
    fn = spmd_aot.compile(step, cache_dir=cache_dir, **options, **kw)
    torch.manual_seed(100 + rank)
    losses = [fn(model, optim, batch(rank, s)).detach().float() for s in range(steps)]
    return model, optim, losses, fn


def full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def max_diffs(ref_model, ref_optim, model, optim, ref_losses, losses) -> dict:
    params = max((full(a).float() - full(b).float()).abs().max().item()
                 for a, b in zip(ref_model.state_dict().values(), model.state_dict().values()))
    s1, s2 = ref_optim.state_dict()["state"], optim.state_dict()["state"]
    state = max([(full(s1[i][k]).float() - full(s2[i][k]).float()).abs().max().item()
                 for i in s1 for k in s1[i] if isinstance(s1[i][k], torch.Tensor)] or [0.0])
    loss = max((a - b).abs().item() for a, b in zip(ref_losses, losses))
    return {"param": params, "state": state, "loss": loss}

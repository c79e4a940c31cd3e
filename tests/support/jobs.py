"""Jobs, batches and an eager DDP reference shared by the tests (importable by spawned ranks)."""

from __future__ import annotations

import copy

import torch

import spmd_aot
from spmd_aot.examples.models import MLP, Transformer, train_step

VOCAB, SEQ = 64, 8

MODELS = {
    "mlp": lambda: MLP(32, 64, 10),
    "transformer": lambda: Transformer(vocab=VOCAB, d_model=32, n_heads=4, n_layers=2, max_len=SEQ),
}
OPTIMIZERS = {
    "sgd": lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9),
    "adamw": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1),
}


def make_batch(model_name: str, rank: int = 0, step: int = 0, batch_size: int = 4):
    g = torch.Generator().manual_seed(1000 * rank + step)
    if model_name == "mlp":
        return torch.randn(batch_size, 32, generator=g), torch.randint(0, 10, (batch_size,), generator=g)
    x = torch.randint(0, VOCAB, (batch_size, SEQ), generator=g)
    return x, torch.randint(0, VOCAB, (batch_size, SEQ), generator=g)


def make_job(model_name: str, optim_name: str, batch_size: int = 4) -> spmd_aot.Job:
    return spmd_aot.Job(step=train_step, model=MODELS[model_name], optimizer=OPTIMIZERS[optim_name],
                        batch=lambda: make_batch(model_name, batch_size=batch_size))


def fresh_objects(model_name: str, optim_name: str, seed: int = 0):
    torch.manual_seed(seed)
    model = MODELS[model_name]()
    return model, OPTIMIZERS[optim_name](model)


def eager_ddp(model_name, optim_name, rank, world, steps, seed=0, batch_size=4):
    """Reference: torch's DistributedDataParallel (or plain eager at world size 1)."""
    model, _ = fresh_objects(model_name, optim_name, seed)
    if world > 1:
        from torch.nn.parallel import DistributedDataParallel

        wrapped = DistributedDataParallel(model)
    else:
        wrapped = model
    optim = OPTIMIZERS[optim_name](wrapped)
    losses = []
    for s in range(steps):
        losses.append(train_step(wrapped, optim, make_batch(model_name, rank, s, batch_size)).detach())
    return model, optim, losses


def compiled_run(model_name, optim_name, rank, world, steps, cache_dir, seed=0, batch_size=4, **kw):
    model, optim = fresh_objects(model_name, optim_name, seed)
    step = spmd_aot.compile(train_step, cache_dir=cache_dir, **kw)
    losses = [step(model, optim, make_batch(model_name, rank, s, batch_size)).detach() for s in range(steps)]
    return model, optim, losses, step.cache_info


def build_unsigned(cache_dir, model_name: str = "mlp", optim_name: str = "sgd", world_size: int = 2):
    """``spmd_aot.build`` of a test job with no signing key set, whatever the caller's environment
    (the trust-boundary tests tamper with unsigned artifacts)."""
    import os

    from spmd_aot.format import signing

    saved = os.environ.pop(signing.ENV_SIGNING_KEY, None)
    try:
        return spmd_aot.build(make_job(model_name, optim_name), world_size=world_size, cache_dir=cache_dir)
    finally:
        if saved is not None:
            os.environ[signing.ENV_SIGNING_KEY] = saved


def ddp_bucket_count(model, cap_mb: float = 25.0, first_cap_mb: float = 1.0) -> int:
    """How many gradient buckets torch's DDP makes for ``model`` with these caps."""
    import torch.distributed as dist

    params = list(reversed([p for p in model.parameters() if p.requires_grad]))
    caps = [int(first_cap_mb * (1 << 20)), int(cap_mb * (1 << 20))]
    buckets, _ = dist._compute_bucket_assignment_by_size(params, caps, [False] * len(params))
    return len(buckets)


def max_diffs(ref_model, ref_optim, ref_losses, model, optim, losses) -> dict:
    """Largest absolute differences of parameters, optimizer state and losses (the parity check)."""
    ref_state, state = ref_optim.state_dict()["state"], optim.state_dict()["state"]
    return {
        "param": max((a - b).abs().max().item()
                     for a, b in zip(ref_model.state_dict().values(), model.state_dict().values())),
        "state": max((ref_state[i][k] - state[i][k]).abs().max().item() for i in ref_state for k in ref_state[i]),
        "loss": max((a - b).abs().item() for a, b in zip(ref_losses, losses)),
    }


def state_of(model, optim):
    return ({k: v.detach().clone() for k, v in model.state_dict().items()},
            copy.deepcopy(optim.state_dict()["state"]))


def ddp_and_loaded_counting_decodes(rank, world, cache_dir):
    """One rank (for ``run_ranks``): eager DDP and the loaded transformer + AdamW step on the same
    batches, their differences, whether the load hit, and how often this rank decoded the graph."""
    import spmd_aot.entries.artifact as artifact

    calls, real = [], artifact.decode_graph
    artifact.decode_graph = lambda *a, **k: (calls.append(1), real(*a, **k))[1]
    ref_model, ref_optim, ref_losses = eager_ddp("transformer", "adamw", rank, world, 3)
    model, optim, losses, info = compiled_run("transformer", "adamw", rank, world, 3, cache_dir, require_hit=True)
    return {**max_diffs(ref_model, ref_optim, ref_losses, model, optim, losses), "hit": info.hit,
            "decodes": len(calls)}


# ---------------------------------------------------------------------------- one world-1 job, its hits
# What the tests of per-user records and signed program parts load: a 2-layer transformer with
# AdamW, seeded, so a build, a hit and eager start from the same weights and batch in any process.
LOAD_SEQ = 16


def load_objects():
    """The model, its AdamW and the batch, the same on every call."""
    torch.manual_seed(0)
    model = Transformer(vocab=VOCAB, d_model=32, n_heads=4, n_layers=2, max_len=LOAD_SEQ)
    g = torch.Generator().manual_seed(7)
    batch = (torch.randint(0, VOCAB, (2, LOAD_SEQ), generator=g), torch.randint(0, VOCAB, (2, LOAD_SEQ), generator=g))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2), batch


def load_job() -> spmd_aot.Job:
    return spmd_aot.Job(step=train_step, model=lambda: load_objects()[0],
                        optimizer=lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2),
                        batch=lambda: load_objects()[2])


def hit_and_eager(cache_dir, steps: int = 3):
    """Parameters and losses after ``steps`` steps of a hit (``require_hit``) of ``load_job``'s
    step, and of eager on the same inputs."""
    model, optim, batch = load_objects()
    eager_model = copy.deepcopy(model)
    eager_optim = torch.optim.AdamW(eager_model.parameters(), lr=1e-2)
    step = spmd_aot.compile(train_step, cache_dir=cache_dir, require_hit=True)
    losses = [float(step(model, optim, batch)) for _ in range(steps)]
    eager = [train_step(eager_model, eager_optim, batch).item() for _ in range(steps)]
    return [p.detach().clone() for p in model.parameters()], losses, list(eager_model.parameters()), eager


# A job file as a user writes one, for the CLI tests that build `path/to/file.py:job` targets.
MLP_JOB_FILE = '''\
import torch

import spmd_aot
from spmd_aot.examples.models import MLP, train_step

job = spmd_aot.Job(
    step=train_step,
    model=lambda: MLP(32, 64, 10),
    optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9),
    batch=lambda: (torch.randn(4, 32), torch.randint(0, 10, (4,))),
)

not_a_job = 42


def make_job():
    return job
'''

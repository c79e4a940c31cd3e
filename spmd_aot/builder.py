"""``spmd_aot.build``: trace a Job offline for one world size and placement, into the cache.

Everything is fake: the model, optimizer and batch are created under ``FakeTensorMode`` and
collectives go to a fake process group, so a CPU box without GPUs or ranks can build for any
world size and for a CUDA target.
"""

from __future__ import annotations

import dataclasses
import time

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from .errors import SpmdAotError
from .job import Job
from .key import compute_key
from .pipeline import trace_and_store
from .plan import Plan
from .state import TrainState, initialize_optimizer_state
from .store import LocalStore, resolve_cache_dir
from .trace import fake_world

__all__ = ["build", "BuildResult"]


@dataclasses.dataclass
class BuildResult:
    plan: Plan
    key: str
    digest: str
    traced: bool  # False: the cache already had this key
    stats: dict
    seconds: float


def build(job: Job, *, world_size: int, placement: str = "replicate", cache_dir=None,
          device: str = "cpu", mesh_shape=None, store=None) -> BuildResult:
    """Build ``job`` for one configuration; a no-op (``traced=False``) when already cached."""
    if not isinstance(job, Job):
        raise SpmdAotError(f"build() takes a spmd_aot.Job, got {type(job).__name__}")
    start = time.perf_counter()
    plan = Plan(world_size, placement, device, mesh_shape)
    store = store or LocalStore(resolve_cache_dir(cache_dir))
    fake_mode = FakeTensorMode()
    with fake_mode, torch.device(device):
        model = job.model()
        optim = job.optimizer(model)
        batch = job.batch()
        initialize_optimizer_state(optim)
    state = TrainState(model, optim, batch)
    with fake_world(world_size):
        key = compute_key(job.step, state, plan)
        digest, traced = trace_and_store(store, job.step, state, plan, key)
    from .artifact import read_manifest

    stats = read_manifest(store, digest)["stats"]
    return BuildResult(plan, key.key, digest, traced, stats, time.perf_counter() - start)

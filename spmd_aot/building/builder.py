"""``spmd_aot.build``: trace a Job offline for one world size and placement, into the cache.

Everything is fake: the model, optimizer and batch are created under ``FakeTensorMode`` and
collectives go to a fake process group, so a CPU box without GPUs or ranks can build for any
world size and for a CUDA target.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time

import torch
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensorMode

from ..format.allowlist import opt_in_names, opted_in
from ..entries import gc_pause, read_manifest
from ..errors import SpmdAotError
from ..tracing.fake_factories import fake_factories
from ..tracing.model_caches import clear_model_caches
from ..job import Job
from ..keying.key import CacheKey, compute_key
from .pipeline import trace_and_store
from ..tracing.override import Transforms
from ..parallel.plan import Plan
from ..options import ParallelOptions, RunOptions, split_options
from ..tracing.optimizers import as_optimizer
from ..state import TrainState, initialize_optimizer_state
from ..store import open_store
from ..parallel.mesh import device_mesh, fake_world
from ..store.leases import ArtifactGoneError, reading

__all__ = ["build", "job_key", "BuildResult", "local_batch"]

log = logging.getLogger(__name__)


@dataclasses.dataclass
class BuildResult:
    plan: Plan
    key: str
    digest: str
    traced: bool  # False: the cache already had this key
    stats: dict
    seconds: float


def build(job: Job, *, parallel: ParallelOptions | None = None, run: RunOptions | None = None,
          world_size: int | None = None, device: str = "cpu", plan: Plan | None = None,
          schema: ParallelOptions | None = None, **options) -> BuildResult:
    """Build ``job`` for one configuration; a no-op (``traced=False``) when already cached.

    ``parallel`` (``spmd_aot.ParallelOptions``) says how the step is spread and ``run``
    (``spmd_aot.RunOptions``) where its entry goes and what the trace runs beside the step
    (``docs/options.md``); a job passes the same two to ``spmd_aot.compile``. Their fields may
    be passed as keywords instead (``placement="shard"``, ``cache_dir=...``), which make them.
    ``world_size`` and ``device`` (the device type) complete the configuration, which a job's
    compile reads from its process group and model; ``plan`` replaces options, world size and
    device at once. ``schema`` is the earlier name of ``parallel``.
    """
    start = time.perf_counter()
    if schema is not None:
        if parallel is not None:
            raise TypeError("build() takes parallel= or its earlier name schema=, not both")
        parallel = schema
    if plan is None:
        parallel, run = split_options(parallel, run, options, "build")
        if world_size is None:
            raise TypeError("build() needs world_size (or a plan)")
        if parallel.pipeline_stages > 1:  # a pipeline entry: the job's step is its loss function
            from .pipeline_build import build_with_options

            return build_with_options(job, parallel, run, world_size, device)
        plan = parallel.plan(world_size, device)
    else:
        spread = sorted(set(options) - {f.name for f in dataclasses.fields(RunOptions)})
        if parallel is not None or spread:
            raise TypeError(f"build() takes a plan or parallel options ({', '.join(spread) or 'parallel='}), "
                            "not both")
        _, run = split_options(None, run, options, "build")
    opt_in_names(run.allow_ops)  # a bad name fails before any work
    allow_ops, kernels, world_size = run.allow_ops, run.kernels, plan.world_size
    transforms = Transforms(run.module_override, run.gm_transformation)
    store = run.store if run.store is not None else open_store(run.cache_dir, trust_cache=run.trust_cache)
    # what the build keeps (the fake model, the traced graph) is left out of the collector's
    # passes while it runs (entries/gc_pause.py)
    with gc_pause.set_aside():
        fake_mode = FakeTensorMode()
        state = _fake_state(job, plan, fake_mode)
        plan = state.plan  # bound to the model (a tp_plan="hf" resolved)
        clear_model_caches(state.model)  # no tensor of an earlier build's trace comes back from a cache
        with fake_world(world_size):
            mesh = device_mesh(plan)
            key = compute_key(job.step, state, plan, transforms.identities(), run.extra_sources, kernels=kernels)
            with fake_mode:
                inputs = state.graph_inputs()
            for attempt in range(3):  # gc may evict the entry between storing (or finding) and reading it
                with opted_in(allow_ops), _backward_for(plan, state):
                    digest, traced = trace_and_store(store, job.step, state, plan, key, mesh, inputs, transforms)
                try:
                    with reading(store, digest):
                        stats = read_manifest(store, digest)["stats"]
                    break
                except ArtifactGoneError:
                    if attempt == 2:
                        raise
    seconds = time.perf_counter() - start
    log.info("build %s: key %s, digest %s, %s, %.2f s", plan.describe(), key.key[:12], digest[:12],
             "traced and stored" if traced else "already cached", seconds)
    return BuildResult(plan, key.key, digest, traced, stats, seconds)


def _backward_for(plan: Plan, state: TrainState):
    """The C++ autograd engine cannot run over fake CUDA tensors where torch sees no GPU: there the
    backward runs in Python (``python_autograd.py``), which runs no autograd-node hooks."""
    from ..tracing import python_autograd

    if not python_autograd.needed(plan.device_type) or state.forward_only:
        return contextlib.nullcontext()
    hooked = [name or "model" for name, m in state.model.named_modules()
              if m._backward_hooks or m._backward_pre_hooks]
    if hooked or torch.nn.modules.module._global_backward_hooks or \
            torch.nn.modules.module._global_backward_pre_hooks:
        raise SpmdAotError(
            f"building for cuda on a machine where torch sees no GPU runs the backward in Python, which "
            f"cannot run module backward hooks ({', '.join(hooked[:3]) or 'global hooks'}): build on a "
            "machine with a GPU, or remove the hooks")
    return python_autograd.gpu_less_cuda_tracing()


def job_key(job: Job, plan: Plan, transforms: Transforms = Transforms(), extra_sources=(),
            kernels: bool = False) -> CacheKey:
    """The key ``build`` would store ``job`` under for ``plan``, without tracing (for explain)."""
    state = _fake_state(job, plan, FakeTensorMode())
    return compute_key(job.step, state, state.plan, transforms.identities(), extra_sources, kernels=kernels)


def _fake_state(job: Job, plan: Plan, fake_mode: FakeTensorMode) -> TrainState:
    """The job's model, optimizer (with its state; none for a forward-only step) and one
    rank's batch, all fake."""
    if not isinstance(job, Job):
        raise SpmdAotError(f"build() takes a spmd_aot.Job, got {type(job).__name__}")
    device = plan.device_type
    if device == "cuda" and not torch.backends.cuda.is_built():
        raise SpmdAotError(
            "building for device 'cuda' needs a CUDA-enabled torch build (no GPU is needed: "
            f"everything is traced on fake tensors); this torch {torch.__version__} is CPU-only, and "
            "its autograd cannot run on fake CUDA tensors. Install the CUDA wheel on the build box."
        )
    with fake_factories(fake_mode):
        # Factories run on CPU (their init kernels need no accelerator), then the fake tensors
        # move to the target device: with a CUDA-enabled torch, a GPU-less box builds for CUDA.
        model, batch = job.model(), job.batch()
        plan = plan.for_model(model)
        if device != "cpu":
            model = model.to(device)
            batch = pytree.tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, batch)
        optim = as_optimizer(job.optimizer(model)) if job.optimizer is not None else None
        if job.global_batch or job.batch_placements is not None:
            batch = local_batch(batch, plan.dp_size, job.batch_placements)  # TP ranks of one share see the same batch
        if optim is not None:
            initialize_optimizer_state(optim)
    return TrainState(model, optim, batch, plan)


def local_batch(global_batch, world_size: int, placements=None):
    """One rank's share of a global batch split over ``world_size`` data-parallel ranks:
    every leaf split on dim 0, or with ``placements``
    (one ``Replicate()``/``Shard(d)`` per element of a tuple batch) element by element.
    Every split must divide evenly."""
    from torch.distributed.tensor import Shard

    if placements is not None and (not isinstance(global_batch, (tuple, list))
                                   or len(global_batch) != len(placements)):
        got = f" of {len(global_batch)}" if isinstance(global_batch, (tuple, list)) else ""
        raise SpmdAotError(f"batch_placements has {len(placements)} placement(s); the batch must be a tuple "
                           f"of as many elements, got a {type(global_batch).__name__}{got}")

    def split_dim(path) -> int | None:
        """The dim a leaf is split on; None: every rank gets it whole (Replicate)."""
        if placements is None:
            return 0
        placement = placements[path[0].idx]
        return placement.dim if isinstance(placement, Shard) else None

    with_paths, spec = pytree.tree_flatten_with_path(global_batch)
    local = []
    for path, leaf in with_paths:
        name, dim = f"batch{pytree.keystr(path)}", split_dim(path)
        if dim is None:
            local.append(leaf)
            continue
        if not isinstance(leaf, torch.Tensor) or not -leaf.dim() <= dim < leaf.dim():
            raise SpmdAotError(f"global batch leaf {name} has no dimension {dim} to split over ranks")
        if leaf.shape[dim] % world_size:
            raise SpmdAotError(
                f"global batch leaf {name} has {leaf.shape[dim]} {'samples' if dim == 0 else 'entries'} "
                f"on dim {dim}, not divisible by world size {world_size}; expected a multiple of {world_size}")
        local.append(leaf.narrow(dim, 0, leaf.shape[dim] // world_size))
    return pytree.tree_unflatten(local, spec)

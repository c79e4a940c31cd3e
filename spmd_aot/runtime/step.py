"""``spmd_aot.compile``: at job start, find the stored step, bind it, and run it every step.

The first call is collective: every rank computes the key from its live objects, the ranks
check they agree, rank 0 decides hit or miss and the others follow (mixed hit/miss would
hang a job), on a miss rank 0 traces and stores while the others wait, then every rank loads
and verifies the same manifest digest and binds it to the live process group and device.
Later calls only check the batch's shapes (and the modules' train/eval modes) and run the graph.

A step compiled from ``fn(model, batch)`` is called ``step(model, batch)``: it is forward-only
(evaluation, inference): no optimizer, no autograd, so no parameter update.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from typing import Any, NamedTuple
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

from ..keying import guards
from . import prepared, ranks
from ..entries import gc_pause
from .cache_info import CacheInfo
from ..format.allowlist import opt_in_names, opted_in
from ..entries import artifact_bytes, artifact_in_memory, read_artifact
from ..format.artifact import layout_mismatch
from ..errors import (ArtifactMismatchError, CacheIOError, CacheMissError, CorruptArtifactError, LockTimeoutError,
                     OpNotAllowedError, SpmdAotError)
from .device_check import check_device
from .zero_fill import ZeroFill
from ..keying.explain import explain_miss
from ..hints import TARGET_PLACEHOLDER, build_command
from ..keying.key import compute_key
from .kernel_load import interpreting, load_kernels, untrusted_reason
from ..keying.lookup import find_entry
from ..parallel import axes
from ..options import ParallelOptions, RunOptions, split_options
from ..tracing.optimizers import as_optimizer, members
from ..tracing.override import Transforms
from ..state import TrainState, initialize_optimizer_state
from ..store import open_store
from ..store.nofollow import LinkError
from ..store.leases import ArtifactGoneError, reading, touch_used
from ..store.memory_store import MemoryStore
from ..parallel.mesh import device_mesh

__all__ = ["compile", "CompiledStep", "CacheInfo"]

log = logging.getLogger(__name__)


class Resolution(NamedTuple):
    """Rank 0's answer for a step's key: which entry, and how it came to be."""

    digest: str  # the manifest digest of the entry every rank loads
    hit: bool  # found in the cache
    traced: bool  # traced by this job
    artifact: Any  # the entry, read and verified by rank 0


def compile(fn: Callable | None = None, *, parallel: ParallelOptions | None = None,
            run: RunOptions | None = None, schema: ParallelOptions | None = None, **options):
    """Wrap a train step ``fn(model, optim, batch)``; also usable as ``@spmd_aot.compile(...)``.

    The returned step returns what ``fn`` returns, computed on this rank: for the usual
    ``return loss`` that is the rank-local loss, exactly what eager DDP returns.
    A forward-only step (evaluation, inference) ``fn(model, batch)`` is called the same way,
    ``step(model, batch)``, with no optimizer; it runs under ``torch.no_grad()``.
    ``parallel`` (``spmd_aot.ParallelOptions``: placement, mesh, tensor-parallel plan,
    communication, mixed precision) says how the step is spread, ``run``
    (``spmd_aot.RunOptions``: cache, trust, op opt-ins, kernels, ``require_hit``, build-time
    hooks) where its entry is found and what a load may trust; pass the same ones as the build
    (``docs/options.md``). Their fields may be passed as keywords instead (``placement="shard"``,
    ``cache_dir="cache"``), which make them, checked now. ``schema`` is the earlier name of
    ``parallel``. World size and device type come from the process group and the model.
    """
    parallel, run = _options(parallel, run, schema, options, "compile")
    if fn is None:
        return functools.partial(compile, parallel=parallel, run=run)
    if parallel.pipeline_stages > 1:  # ``fn`` is the loss function of a pipeline (``pipeline_schedule.py``)
        from .pipeline_schedule import compile_with_options

        return compile_with_options(fn, parallel, run)
    return CompiledStep(fn, parallel=parallel, run=run)


def _options(parallel, run, schema, keywords, where: str) -> tuple[ParallelOptions, RunOptions]:
    """``split_options`` with ``schema=`` taken as ``parallel=`` (its earlier name)."""
    if schema is not None:
        if parallel is not None:
            raise TypeError(f"{where}() takes parallel= or its earlier name schema=, not both")
        parallel = schema
    return split_options(parallel, run, keywords, where)


class CompiledStep:
    """A step compiled by ``spmd_aot.compile`` (which documents ``parallel``, ``run`` and the
    keywords that make them): resolved at its first call, run from the bound program after."""

    def __init__(self, fn, *, parallel: ParallelOptions | None = None, run: RunOptions | None = None,
                 schema: ParallelOptions | None = None, **options):
        self.parallel_options, self.run_options = _options(parallel, run, schema, options, "CompiledStep")
        if self.parallel_options.pipeline_stages > 1:
            raise SpmdAotError(
                f"pipeline_stages={self.parallel_options.pipeline_stages} makes a pipeline step, whose function is the "
                "loss function: use spmd_aot.compile(loss_fn, parallel=...), which returns it (docs/pipeline_parallel.md)")
        run = self.run_options
        self.allow_ops = tuple(opt_in_names(run.allow_ops))  # a bad name fails here, not at the first call
        self.fn = fn
        self.require_hit = run.require_hit
        self.transforms = Transforms(run.module_override, run.gm_transformation)
        self.extra_sources = run.extra_sources
        self._store = run.store
        self._cache_dir = run.cache_dir
        self._trust_cache = run.trust_cache
        self.kernels = run.kernels
        self._bound: _BoundStep | None = None
        self._unstored = None  # a traced artifact the cache could not take (rank 0 serves it)
        self.cache_info: CacheInfo | None = None
        self._traces = 0
        functools.update_wrapper(self, fn)

    @property
    def store(self):
        if self._store is None:
            self._store = open_store(self._cache_dir, trust_cache=self._trust_cache)
        return self._store

    def __call__(self, model, *args):
        """``step(model, optim, batch)``, or ``step(model, batch)`` for a forward-only step."""
        if len(args) == 1:
            optim, batch = None, args[0]
        elif len(args) == 2:
            optim, batch = args
            if optim is None:
                raise TypeError(f"{_name(self.fn)}: a step without an optimizer is forward-only; "
                                "call it as step(model, batch)")
        else:
            raise TypeError(f"{_name(self.fn)}: call a compiled step as step(model, optim, batch), or "
                            f"step(model, batch) when it is forward-only; got {1 + len(args)} arguments")
        bound = self._bound
        if isinstance(optim, (list, tuple, dict)):  # several optimizers: one OptimizerSet per container
            optim = bound.state.optim if bound is not None and getattr(bound.state.optim, "holds", bool)(optim) \
                else as_optimizer(optim)
        leaves, spec = pytree.tree_flatten(batch)
        if bound is None or not bound.fits(model, optim, leaves, spec):
            if bound is not None:
                bound.warn_constant_changed(optim)
            with opted_in(self.allow_ops), gc_pause.paused():
                bound = self._bound = self._prepare(model, optim, batch)
        return bound.run(leaves)

    # ------------------------------------------------------------------ first call
    def _prepare(self, model, optim, batch) -> _BoundStep:
        self._zero_fill = ZeroFill()  # the optimizer's fresh state, filled while the graph loads
        try:
            return self._prepare_with(model, optim, batch)
        finally:
            self._zero_fill.wait()

    def _prepare_with(self, model, optim, batch) -> _BoundStep:
        start = time.perf_counter()
        world = dist.get_world_size() if dist.is_initialized() else 1
        rank = dist.get_rank() if dist.is_initialized() else 0
        plan = self.parallel_options.plan(world, _device_type(model)).for_model(model)
        device = check_device(plan, model)  # the device the program binds to, or why it cannot run here
        mesh = device_mesh(plan)  # collective for 2-D meshes: every rank builds it
        spread = world > 1  # one rank: nothing is spread
        if spread:
            ranks.broadcast_model_once(model)
            axes.prepare_live_state(model, optim, plan, mesh)  # as fully_shard / parallelize_module; idempotent
        created: set[int] = set()  # parameters whose optimizer state this call made
        if optim is not None:
            created = {id(p) for p in initialize_optimizer_state(
                optim, axes.state_zeros if spread else self._zero_fill.make)}
            self._zero_fill.start()
        state = TrainState(model, optim, batch, plan)
        key = compute_key(self.fn, state, plan, self.transforms.identities(), self.extra_sources,
                          kernels=self.kernels)
        ranks.check_ranks_agree(key, world)

        # Reader leases keep gc from deleting the artifact until every rank has loaded it.
        with contextlib.ExitStack() as leases:
            decision, rest = ranks.rank0_decides(
                lambda: self._resolve_on_rank0(state, plan, key, mesh, leases), rank, world)
            digest, hit, traced = decision.payload, decision.hit, decision.traced
            artifact = rest[0] if rest else None
            if rank == 0:
                self._traces += int(traced)
            kernels_refused = self._kernels_refused(world)
            program, failure = None, None
            try:
                artifact = self._read_everywhere(digest, world, artifact, leases)
                state.untaken_state(artifact.slots, created)  # state of parameters no gradient reaches
                slots = state.slots()
                problem = layout_mismatch(artifact.slots, slots, plan)
                if problem:
                    raise ArtifactMismatchError(
                        f"artifact {digest[:12]} (key {key.key[:12]}) does not fit: {problem}")
                problem = guards.check(artifact.manifest["guards"], key)
                if problem:  # rank 0 checked its own files; this rank runs something else
                    raise ArtifactMismatchError(
                        f"rank {rank}: artifact {digest[:12]} (key {key.key[:12]}) serves rank 0 but "
                        f"not this rank: {problem}. Every rank must run the same code and libraries.")
                check_device(artifact.manifest, model)  # the artifact's own plan, not only the job's
                if kernels_refused and artifact.kernels is not None:
                    interpreting(artifact.digest, kernels_refused)
                program = ((None if kernels_refused else
                            load_kernels(artifact, ranks.live_groups(mesh), self._trust_cache, device))
                           or prepared.program_for(artifact, ranks.live_groups(mesh), device))
            except OpNotAllowedError as exc:  # not repaired by a rebuild: the job opts in, or not
                failure = OpNotAllowedError(
                    f"{exc}. The entry for key {key.key[:12]} calls {exc.op}, which only an opt-in allows: if "
                    f"you trust the build that stored it, pass allow_ops=[{exc.op!r}] to spmd_aot.compile (or "
                    "set $SPMD_AOT_ALLOW_OPS); otherwise remove the entry and build it again.", op=exc.op)
            except Exception as exc:
                failure = exc
            ranks.all_ranks_ok(failure, world)
        if rank == 0:  # for gc's least-recently-used order; rank 0 is the one that has the cache
            touch_used(self.store, key.key)
        self._zero_fill.wait()  # part of the first call's cost (usually done long before)
        seconds = time.perf_counter() - start
        log.info("%s: cache %s on rank %d, key %s, digest %s, %s, %.2f s", _name(self.fn),
                 "hit" if hit else ("miss, traced by rank 0" if traced else "miss, built by another process"),
                 rank, key.key[:12], digest[:12], plan.describe(), seconds)
        self.cache_info = CacheInfo(hit, key.key, digest, "trace" if traced else "cache", seconds,
                                    float(artifact.manifest["stats"].get("trace_seconds", 0.0)),
                                    self._traces)
        return _BoundStep(program, state, artifact, spread, slots)

    def _kernels_refused(self, world: int) -> str | None:
        """Why stored kernels may not load here (None: they may): every rank's own policy must
        allow native code (``kernel_load.untrusted_reason``). One rank running kernels and
        another the interpreter could order collectives differently, and no rank's trust
        decides for another."""
        if not self.kernels:
            return "the step was compiled without kernels=True"
        why = untrusted_reason(self._trust_cache)
        if not ranks.all_ranks_allow(why is None, world) and why is None:
            why = ("another rank may not load native code (its entry is not signed or its cache not "
                   "trusted there), so every rank runs the interpreted graph")
        return why

    def _read_everywhere(self, digest: str, world: int, artifact, leases):
        """Every rank reads the artifact (rank 0 already has); ranks that cannot (no shared
        cache, no access, a damaged local copy) get its blobs from rank 0 and verify them."""
        problem = None
        if artifact is None:
            try:
                leases.enter_context(reading(self.store, digest))
                artifact = read_artifact(self.store, digest)
            except (SpmdAotError, OSError) as exc:
                problem = exc
        if world == 1 and problem:
            raise problem
        if not ranks.needs_blobs(artifact is not None, world):
            return artifact
        blobs = artifact_bytes(self._unstored or self.store, digest) if dist.get_rank() == 0 else None
        received = ranks.broadcast_blobs(blobs)
        if artifact is not None:
            return artifact
        log.info("rank %d read artifact %s from rank 0 (%s)", dist.get_rank(), digest[:12], problem)
        return read_artifact(MemoryStore(received, root="<blobs received from rank 0>"), digest)

    def _resolve_on_rank0(self, state, plan, key, mesh, leases) -> Resolution:
        """Rank 0's decision: which entry serves ``key``, found or traced.

        A hit needs an entry for the key whose guards hold here (``lookup``); on a miss rank 0
        traces, unless another process stored a serving entry while it waited for the lock.
        """
        store = self.store
        found = None
        try:
            found, served = self._lookup(store, key, leases)
            if served is not None:
                return served
        except CorruptArtifactError as exc:
            if self.require_hit:
                raise CorruptArtifactError(
                    f"cached artifact for key {key.key[:12]} is corrupt and require_hit=True: {exc}. "
                    "Run `spmd-aot verify` and rebuild with `spmd-aot build`."
                ) from None
            log.warning("cached artifact for key %s is corrupt (%s); rebuilding", key.key[:12], exc)
            with contextlib.suppress(OSError, SpmdAotError):  # a read-only cache: rebuild in memory
                store.delete_ref(key.key)
        # explaining reads a bounded number of manifests (keying/explain.py) beside the trace that follows
        why = explain_miss(store, key) if self.require_hit or log.isEnabledFor(logging.WARNING) else ""
        command = build_command(plan, cache_dir=store.location)  # what --cache-dir must say
        build_it = (f"Build it ahead of time with `{command}`, where {TARGET_PLACEHOLDER} names your "
                    "spmd_aot.Job ('pkg.module:job' or 'path/to/train.py:job').")
        if self.transforms.identities() or self.extra_sources:  # Python hooks: no CLI flags for them
            build_it = (f"Build it ahead of time with spmd_aot.build(job, parallel=..., run=..., "
                        f"world_size={plan.world_size}) passing the same ParallelOptions and RunOptions as "
                        "this compile: its module_override, gm_transformation and extra_sources are Python "
                        "objects the command line cannot pass.")
        if self.require_hit:
            why = (f"The key's entries were traced from other code or values: {found.explain()}."
                   if found is not None and found.misses else explain_miss(store, key))
            raise CacheMissError(
                f"no artifact for key {key.key[:12]} ({plan.describe()}) in {store.root} serves "
                f"this job and require_hit=True. {why} {build_it}")
        log.warning("%s: cache miss for key %s (%s) in %s; tracing the step now, the other ranks "
                    "wait. %s %s", _name(self.fn), key.key[:12], plan.describe(), store.root, why, build_it)
        with gc_pause.resumed():  # a trace builds cyclic garbage (FX graphs, fake tensors)
            return self._trace_on_rank0(store, state, plan, key, mesh, leases)

    def _trace_on_rank0(self, store, state, plan, key, mesh, leases) -> Resolution:
        """Rank 0 traces and stores the step; when the cache cannot take it, the job trains from
        the trace held in memory (the other ranks get it from here)."""
        # imported here: a job that hits never loads the tracer and the build passes
        from ..building.pipeline import UnstoredTrace, trace_and_store, trace_to_blobs

        self._zero_fill.wait()  # the trace sees the state as eager would
        blobs = None
        try:
            digest, traced = trace_and_store(store, self.fn, state, plan, key, mesh, state.graph_inputs(),
                                             self.transforms, _STORE_FAILURES)
            leases.enter_context(reading(store, digest))
            return Resolution(digest, False, traced, read_artifact(store, digest))
        except UnstoredTrace as exc:
            blobs, cause = exc.blobs, exc.cause
        except _STORE_FAILURES as exc:
            cause = exc
        # The cache cannot take the new entry (full, read-only, locked, tampered with): the job
        # still trains from its own trace, held in memory; other ranks get it from here.
        log.warning("cannot store the traced step for key %s in %s (%s); training from the trace "
                    "without caching it", key.key[:12], store.root, cause)
        if blobs is None:  # the store failed before tracing (its lock), or when reading back
            blobs = trace_to_blobs(self.fn, state, plan, key, mesh, state.graph_inputs(), self.transforms)
        digest, self._unstored = artifact_in_memory(blobs)
        return Resolution(digest, False, True, read_artifact(self._unstored, digest))

    def _lookup(self, store, key, leases, attempts: int = 3):
        """(lookup, (digest, True, False, artifact)) for the serving entry of ``key`` under a
        reader lease; (lookup, None) when none serves.

        An entry that vanishes between finding it and taking the lease (gc evicted it, or
        `spmd-aot rm`) is looked up again: its key may have been rebuilt meanwhile.
        """
        found = None
        for _ in range(attempts):
            found = find_entry(store, key)
            digest = found.digest
            if digest is None:
                return found, None
            try:
                lease = leases.enter_context(contextlib.ExitStack())
                lease.enter_context(reading(store, digest))
                artifact = read_artifact(store, digest, found.manifest)  # every blob verified
            except ArtifactGoneError as exc:
                lease.close()
                log.info("artifact %s vanished before it was loaded (%s); looking it up again", digest[:12], exc)
                continue
            if artifact.manifest["key"] != key.key:
                raise CorruptArtifactError(
                    f"ref {key.key[:12]} points to manifest {digest[:12]} of key "
                    f"{artifact.manifest['key'][:12]}")
            return found, Resolution(digest, True, False, artifact)
        return found, None


class _BoundStep:
    """A loaded program bound to one model, optimizer and batch signature."""

    def __init__(self, program, state: TrainState, artifact, spread: bool, slots: list):
        self.program = program
        self.state = state
        self.spread = spread  # False at world size 1
        self.slots = slots  # ``state.slots()``, as the load checked them against the artifact's
        self.batch_spec = state.batch_spec
        self.batch_sig = [(tuple(t.shape), t.dtype) for t in state.batch_leaves]
        self.baked = state.baked_hyperparameters()
        self.out_spec = artifact.out_spec()
        self.out_constants = dict((int(i), v) for i, v in artifact.layout["outputs"]["constants"])
        # the gradients the step leaves on its parameters: the graph's last outputs (tracing/gradients_left.py)
        self.gradients = [(state.params[i][1], keep) for i, keep in artifact.layout["outputs"].get("gradients", [])]
        self.digest = artifact.digest
        self._cached_state = None  # (optimizer state dict, watched entries, state inputs)
        self.modules = list(state.model.modules())
        self.modes = [m.training for m in self.modules]  # train/eval is in the key (dropout, BatchNorm)
        # which parameters train is in the key: a backbone unfrozen (or frozen) between steps resolves again
        self.trainable = [p.requires_grad for _, p in state.params]
        # the step runs each optimizer's update: an lr scheduler asks whether optim.step() ran
        self.stepped = members(state.optim) if state.optim is not None else []

    def fits(self, model, optim, leaves, spec) -> bool:
        """Same objects, batch signature, train/eval modes, trainable parameters and baked
        hyperparameters; else the step is re-resolved."""
        return (model is self.state.model and optim is self.state.optim and spec == self.batch_spec
                and len(leaves) == len(self.batch_sig)
                and all(isinstance(t, torch.Tensor) and (tuple(t.shape), t.dtype) == sig
                        for t, sig in zip(leaves, self.batch_sig))
                and [m.training for m in self.modules] == self.modes
                and [p.requires_grad for _, p in self.state.params] == self.trainable
                and self.state.baked_hyperparameters() == self.baked)

    def warn_constant_changed(self, optim) -> None:
        """Say which hyperparameter the graph holds as a constant changed (the step is looked
        up again: a rebuild, or another stored entry), since a scheduler moving it each step
        would rebuild each step."""
        if optim is not self.state.optim:
            return
        for i, (was, now) in enumerate(zip(self.baked, self.state.baked_hyperparameters())):
            for name in sorted(k for k in now if now[k] != was.get(k)):
                log.warning(
                    "param_groups[%d][%r] changed from %r to %r: the stored step holds it as a constant, so "
                    "the step is looked up again, and a schedule that moves it on every step rebuilds on "
                    "every step. The learning rate is always a step input; the other numbers of SGD, Adam, "
                    "AdamW, NAdam, RAdam, Adamax, RMSprop and Adafactor are when the group leaves fused and "
                    "foreach unset (momentum and weight decay once nonzero)", i, name,
                    was.get(name), now[name])

    def _inputs(self, batch_leaves) -> list[torch.Tensor]:
        """The graph's inputs. The state part is reused while the optimizer holds the very same
        state tensors (checked by identity every step: ``load_state_dict`` or a replaced entry
        rebuilds it), which spares small models a walk over every parameter per step."""
        state, cached = self.state, self._cached_state
        optim_state = state.optim.state if state.optim is not None else {}
        if cached is None or cached[0] is not optim_state or \
                not all(entries.get(k) is t for entries, k, t in cached[1]):
            if self.spread and state.optim is not None:
                axes.rehome_state(state.optim)
            slots = state.optimizer_slots()
            watched = [(optim_state[p], k, optim_state[p][k]) for p, k in slots]
            n_state = len(state.params) + len(state.buffers) + len(slots)
            cached = self._cached_state = (optim_state, watched, state.graph_inputs(self.slots, [])[:n_state])
        return cached[2] + state.hyper_tensors() + list(batch_leaves)

    def run(self, batch_leaves):
        inputs = self._inputs(batch_leaves)
        with torch.no_grad():
            outs = iter(self.program(*inputs))
        for optim in self.stepped:
            optim._opt_called = True  # read by torch's LRScheduler.step (else it warns of a wrong call order)
        n = self.out_spec.num_leaves
        leaves = [self.out_constants[i] if i in self.out_constants else next(outs) for i in range(n)]
        if self.gradients:
            self._leave_gradients(list(outs))
        return pytree.tree_unflatten(leaves, self.out_spec)

    def _leave_gradients(self, grads: list[torch.Tensor]) -> None:
        """Put the step's gradients on ``p.grad`` as eager leaves them: under replicate the whole
        averaged gradient (DDP's), under shard a DTensor of this rank's shard with the
        parameter's mesh, placements and shape (FSDP2's). A step that cleared with
        ``set_to_none=False`` writes into the ``.grad`` tensor already there, as eager does."""
        from torch.distributed.tensor import DTensor

        if len(grads) != len(self.gradients):
            raise CorruptArtifactError(f"artifact {self.digest[:12]}: the graph returns {len(grads)} gradients "
                                       f"for the {len(self.gradients)} its layout names")
        with torch.no_grad():
            for (p, keep), g in zip(self.gradients, grads):
                sharded = isinstance(p, DTensor)
                local = p._local_tensor if sharded else p
                if sharded and g.shape[1:] == local.shape[1:] and 0 <= local.shape[0] <= g.shape[0]:
                    g = g[:local.shape[0]]  # the graph's padded shard: this rank's rows (sharding.py)
                if g.shape != local.shape or g.dtype != p.dtype:
                    raise CorruptArtifactError(
                        f"artifact {self.digest[:12]}: the graph returns a {g.dtype} {list(g.shape)} gradient for "
                        f"a {p.dtype} parameter of local shape {list(local.shape)}")
                held = p.grad
                if keep and held is not None and isinstance(held, DTensor) == sharded and held.shape == p.shape:
                    (held._local_tensor if sharded else held).copy_(g)
                elif sharded:  # the parameter's own spec (mesh, placements, global shape): DTensor.from_local's
                    p.grad = DTensor(g, p._spec, requires_grad=False)  # result, without its autograd wrapper
                else:
                    p.grad = g


_STORE_FAILURES = (CacheIOError, LinkError, LockTimeoutError, OSError)  # the cache cannot take an entry


def _name(fn) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__qualname__


def _device_type(model) -> str:
    """The device type the plan is made for: where the model's parameters lie (cpu without any)."""
    for t in model.parameters():
        return t.device.type
    return "cpu"

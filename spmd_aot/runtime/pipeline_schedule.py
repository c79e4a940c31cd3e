"""``spmd_aot.compile_pipeline``: at job start every rank loads its own stage (its stages, under
``interleaved_1f1b``) of a stored pipeline; every step runs the stored schedule, passing
activations and gradients to the neighbouring stages' ranks with point-to-point sends (tagged by
stage boundary and micro-batch).

The first call is collective, as ``compile``'s: every rank computes the key from the whole
live model (the same on every rank), the ranks check they agree, rank 0 decides hit or miss
(on a miss it traces every stage and stores the entry while the others wait), then each rank
reads the manifest and only its own stages' graphs, checked as every load is checked.

Every step then executes the schedule's actions for this rank, in the stored order:

- ``F m``: receive the micro-batch's activations from the previous stage (shapes and dtypes
  are the manifest's), run the forward graph, keep its saved tensors, send its outputs on (the
  last stage's output is the micro-batch loss);
- ``B m``: receive the gradients of those outputs from the next stage (the last stage starts
  from 1, as ``loss.backward()``), run the backward graph on the saved tensors, add the
  parameter gradients into their accumulators, send the input gradients back, drop the saved
  tensors.

Sends are asynchronous (``isend``, waited at the end of the step); receives wait. After the
last action the gradients are divided by the number of micro-batches (torch's
``scale_grads=True``), set as the parameters' ``.grad``, and the optimizer steps (eagerly, on
this stage's parameters; other stages' parameters get no gradient, so it skips them).
"""

from __future__ import annotations

import logging
import time

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

from . import ranks
from ..errors import CacheMissError, CorruptArtifactError
from ..entries import store_artifact
from ..entries.pipeline_artifact import read_pipeline_manifest, read_stage
from ..keying.pipeline_key import pipeline_key
from ..parallel.pipeline_parallel import Pipeline, rank_actions
from ..store import open_store
from ..store.leases import reading
from ..interpreter.program import Program
from .pipeline_replicas import Replicas
from .cache_info import CacheInfo

__all__ = ["compile_pipeline", "compile_with_options", "PipelineStep"]

log = logging.getLogger(__name__)


def compile_pipeline(loss_fn, *, pipeline: Pipeline, cache_dir=None, store=None, require_hit: bool = False,
                     trust_cache=None) -> PipelineStep:
    """A pipeline-parallel train step: ``step(model, optim, batch)`` with ``batch = (inputs...,
    target)``, the whole step's batch on every rank. Pass the same ``loss_fn`` and pipeline as
    ``build_pipeline``. Returns the mean micro-batch loss on the last stage's ranks, None on the
    others; ``step(..., losses=[])`` also fills the list with each micro-batch's loss there."""
    return PipelineStep(loss_fn, pipeline, cache_dir=cache_dir, store=store, require_hit=require_hit,
                        trust_cache=trust_cache)


def compile_with_options(loss_fn, parallel, run) -> PipelineStep:
    """``spmd_aot.compile`` with ``ParallelOptions(pipeline_stages=N, ...)``: the pipeline its
    options give at this job's world size (read now, from the default process group)."""
    from ..building.pipeline_build import check_run_options

    check_run_options(run)
    world = dist.get_world_size() if dist.is_initialized() else 1
    return PipelineStep(loss_fn, parallel.pipeline(world), cache_dir=run.cache_dir, store=run.store,
                        require_hit=run.require_hit, trust_cache=run.trust_cache)


class PipelineStep:
    def __init__(self, loss_fn, pipeline: Pipeline, *, cache_dir=None, store=None, require_hit=False,
                 trust_cache=None):
        if not isinstance(pipeline, Pipeline):
            raise TypeError(f"pipeline= takes a spmd_aot.Pipeline, got {type(pipeline).__name__}")
        self.loss_fn, self.pipeline, self.require_hit = loss_fn, pipeline, require_hit
        self._store, self._cache_dir, self._trust_cache = store, cache_dir, trust_cache
        self._bound: _BoundStage | None = None
        self.cache_info: CacheInfo | None = None
        self._traces = 0

    @property
    def stage_parameters(self) -> list[str]:
        """The FQNs of the parameters this rank's stage owns (after the first call): build the
        optimizer over them, or free the others, as torch's pipelining keeps only its stage module."""
        if self._bound is None:
            raise RuntimeError("a pipeline step knows its stage after its first call")
        return [p["name"].split(":", 1)[1] for p in self._bound.inputs if p["name"].startswith("param:")]

    @property
    def store(self):
        if self._store is None:
            self._store = open_store(self._cache_dir, trust_cache=self._trust_cache)
        return self._store

    def __call__(self, model, optim, batch, losses: list | None = None):
        leaves, spec = pytree.tree_flatten(tuple(batch))
        bound = self._bound
        if bound is None or bound.model is not model or bound.signature != _signature(leaves, spec):
            bound = self._bound = self._prepare(model, batch)
        return bound.run(optim, leaves, losses)

    def _prepare(self, model, batch) -> _BoundStage:
        from ..building.pipeline_build import pipeline_plan, resolve_split

        start = time.perf_counter()
        world = dist.get_world_size() if dist.is_initialized() else 1
        rank = dist.get_rank() if dist.is_initialized() else 0
        device_type = next((p.device.type for p in model.parameters()), "cpu")
        plan = pipeline_plan(self.pipeline, world, device_type, resolve_split(model, self.pipeline))
        # collective when a stage has several ranks: every rank makes the mesh
        replicas = Replicas(plan, device_type, self.pipeline.tp_plan)
        key = pipeline_key(model, self.loss_fn, batch, self.pipeline, plan)
        ranks.check_ranks_agree(key, world)
        decision, _ = ranks.rank0_decides(lambda: self._resolve_on_rank0(model, batch, plan, key), rank, world)
        hit, traced = decision.hit, decision.traced
        if rank == 0:
            self._traces += int(traced)
        digest, failure, bound = decision.payload, None, None
        try:
            with reading(self.store, digest):
                manifest = read_pipeline_manifest(self.store, digest)
                if manifest["key"] != key.key:
                    raise CorruptArtifactError(
                        f"ref {key.key[:12]} points to pipeline entry {digest[:12]} of another key")
                device = torch.device(device_type, torch.cuda.current_device()) if device_type == "cuda" \
                    else torch.device(device_type)
                own = [s for s in range(self.pipeline.stages) if self.pipeline.rank_of(s) == rank // _replicas(plan)]
                loaded = [read_stage(self.store, manifest, s, device, device_type, replicas.groups or None)
                          for s in own]
            bound = _BoundStage(model, loaded, manifest, rank, replicas, device)
        except Exception as exc:
            failure = exc
        ranks.all_ranks_ok(failure, world)
        seconds = time.perf_counter() - start
        log.info("pipeline step: cache %s on rank %d (pp rank %d), key %s, digest %s, %.2f s",
                 "hit" if hit else "miss, traced by rank 0", rank, rank // _replicas(plan), key.key[:12], digest[:12],
                 seconds)
        self.cache_info = CacheInfo(hit, key.key, digest, "trace" if traced else "cache", seconds,
                                    float(manifest["stats"].get("trace_seconds", 0.0)), self._traces)
        bound.signature = _signature(*pytree.tree_flatten(tuple(batch)))
        return bound

    def _resolve_on_rank0(self, model, batch, plan, key) -> tuple[str, bool, bool]:
        store = self.store
        digest = store.get_ref(key.key)
        if digest is not None:
            try:
                if read_pipeline_manifest(store, digest)["key"] == key.key:
                    return digest, True, False
            except CorruptArtifactError as exc:
                if self.require_hit:
                    raise
                log.warning("pipeline entry for key %s is damaged (%s); rebuilding it", key.key[:12], exc)
        if self.require_hit:
            raise CacheMissError(f"no pipeline entry for key {key.key[:12]} ({self.pipeline.describe()}) in "
                                 f"{store.root} and require_hit=True{_nearest(store, key)}; build it ahead of time "
                                 "with spmd_aot.build_pipeline(job, pipeline, cache_dir=...) with the same pipeline")
        from ..building.pipeline_build import trace_pipeline_blobs

        log.warning("pipeline step: cache miss for key %s (%s); rank 0 traces every stage now, the other ranks "
                    "wait", key.key[:12], self.pipeline.describe())
        with store.lock(key.key):
            blobs = trace_pipeline_blobs(model, self.loss_fn, batch, self.pipeline, plan, key)
            return store_artifact(store, key.key, blobs), False, True


def _nearest(store, key, limit: int = 64) -> str:
    """``: the nearest stored pipeline entry differs in ...`` (the ingredients), reading at most
    ``limit`` manifests; empty when the store holds none."""
    best = None
    for digest in list(store.refs().values())[:limit]:
        try:
            stored = read_pipeline_manifest(store, digest)["ingredients"]
        except Exception:  # not a pipeline entry, or unreadable: not a candidate
            continue
        differ = [n for n in key.ingredients if stored.get(n) != key.ingredients[n]]
        if best is None or len(differ) < len(best):
            best = differ
    return f"; the nearest stored pipeline entry differs in: {', '.join(best)}" if best else ""


def _replicas(plan: dict) -> int:
    """Ranks running each stage: its data-parallel replicas times its TP ranks (1 on a ``(pp,)`` mesh)."""
    return plan["world_size"] // plan["mesh_shape"][0]


def _signature(leaves, spec):
    return spec, [(tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else type(t) for t in leaves]


class _Stage:
    """One stage this rank runs: its programs, its ports, the live tensors behind them."""

    def __init__(self, loaded, pipeline: Pipeline, rank: int, per_stage: int):
        ports = loaded.ports
        self.index = loaded.index
        self.inputs, self.outputs = ports["inputs"], ports["outputs"]
        self.first, self.last = self.index == 0, self.index == pipeline.stages - 1
        # the same replica (and TP rank) of the neighbouring stages' ranks
        offset = rank % per_stage
        self.previous = pipeline.rank_of(self.index - 1) * per_stage + offset
        self.next = pipeline.rank_of(self.index + 1) * per_stage + offset
        self.forward = Program(loaded.forward, loaded.constants, expected=loaded.forward_expected)
        self.backward = Program(loaded.backward, loaded.constants, expected=loaded.backward_expected)
        self.state: list = []
        self.grad_params: list = []
        self.whole: list | None = None

    def own(self) -> list[str]:
        return [p["name"][6:] for p in self.inputs if p["name"].startswith("param:")]


class _BoundStage:
    """One rank's stages (one, or several under ``interleaved_1f1b``): their programs, the live
    tensors behind their ports, the rank's actions."""

    def __init__(self, model, loaded: list, manifest: dict, rank: int, replicas: Replicas, device):
        self.model, self.rank, self.device, self.replicas = model, rank, device, replicas
        self.signature = None
        self.pipeline = Pipeline.from_dict(manifest["pipeline"])
        self.stages = {st.index: _Stage(st, self.pipeline, rank, replicas.per_stage) for st in loaded}
        self.inputs = [p for st in self.stages.values() for p in st.inputs]  # every port, for stage_parameters
        self.last = any(st.last for st in self.stages.values())
        self.actions = rank_actions(self.pipeline)[rank // replicas.per_stage]
        self._bind_live()

    def _bind_live(self) -> None:
        for st in self.stages.values():
            st.state = [self._live(p["name"]) for p in st.inputs]  # None for activations and batch leaves
            st.grad_params = [(i, st.state[i]) for i, p in enumerate(st.inputs)
                              if p["name"].startswith("param:") and p["grad"]]

    def _live(self, name: str):
        kind, _, fqn = name.partition(":")
        if kind == "param":
            return self.model.get_parameter(fqn)
        if kind == "buffer":
            return self.model.get_buffer(fqn)
        return None

    def run(self, optim, leaves, losses):
        n = self.pipeline.microbatches
        if self.replicas.sharded or self.replicas.tp > 1:  # the stages' parameters become DTensors (once, in place)
            self.replicas.shard(self.model, optim, [fqn for st in self.stages.values() for fqn in st.own()])
            self._bind_live()
        mbs = [leaf.chunk(n) for leaf in leaves]
        saved: dict[tuple[int, int], list] = {}
        accumulated: dict[tuple[int, int], torch.Tensor] = {}
        step_losses: list[torch.Tensor] = []
        sends: list = []
        with torch.no_grad():
            for st in self.stages.values():
                st.whole = [self.replicas.whole(live) if live is not None else None for live in st.state]
            for action, s, m in self.actions:
                st = self.stages[s]
                if action == "F":
                    outs = st.forward(*self._forward_inputs(st, mbs, m))
                    saved[s, m] = outs[len(st.outputs):]
                    if st.last:
                        step_losses.append(outs[0])
                    else:
                        sends += [dist.isend(t, st.next, tag=self._tag(s, m)) for t in outs[:len(st.outputs)]]
                    del outs  # the saved tensors live in ``saved`` only: freed by their backward
                else:
                    grads = st.backward(*saved.pop((s, m)), *self._output_grads(st, m))
                    for i, _ in st.grad_params:
                        g = grads[i]
                        if (s, i) in accumulated:
                            accumulated[s, i].add_(g)
                        else:
                            accumulated[s, i] = g
                    if not st.first:
                        sends += [dist.isend(grads[i].contiguous(), st.previous, tag=self._tag(s - 1, m) + 1)
                                  for i, p in enumerate(st.inputs) if p["name"].startswith("act:") and p["grad"]]
                    del grads
            for work in sends:
                work.wait()
            for st in self.stages.values():
                st.whole = None  # gathered parameters are freed
            self.replicas.set_gradients([(param, accumulated[st.index, i].div_(n)) for st in self.stages.values()
                                         for i, param in st.grad_params if (st.index, i) in accumulated])
        if optim is not None:
            optim.step()
            optim.zero_grad()
        if not self.last:
            return None
        if losses is not None:
            losses.extend(step_losses)
        return torch.stack(step_losses).mean()

    def _tag(self, boundary: int, m: int) -> int:
        """The tag of micro-batch ``m``'s activations across ``boundary`` (stage ``boundary`` to the
        next); their gradients take the tag after it."""
        return 2 * (boundary * self.pipeline.microbatches + m)

    def _forward_inputs(self, st: _Stage, mbs, m: int) -> list:
        values, receives = [], []
        for port, live in zip(st.inputs, st.whole):
            name = port["name"]
            if live is not None:
                values.append(live)
            elif name.startswith("batch:"):
                values.append(mbs[int(name.split(":")[1])][m])
            else:
                buf = torch.empty(port["shape"], dtype=getattr(torch, port["dtype"]), device=self.device)
                receives.append(dist.irecv(buf, st.previous, tag=self._tag(st.index - 1, m)))
                values.append(buf)
        for work in receives:
            work.wait()
        return values

    def _output_grads(self, st: _Stage, m: int) -> list:
        if st.last:
            return [torch.ones((), dtype=getattr(torch, st.outputs[0]["dtype"]), device=self.device)]
        bufs = [torch.empty(p["shape"], dtype=getattr(torch, p["dtype"]), device=self.device)
                for p in st.outputs if p["grad"]]
        works = [dist.irecv(b, st.next, tag=self._tag(st.index, m) + 1) for b in bufs]
        for work in works:
            work.wait()
        return bufs

"""``spmd_aot.build_pipeline``: a pipeline-parallel step built offline, every stage at once.

The job's model and batch are made on fake tensors (as ``build`` makes them), the forward and
loss traced once and cut at the split points into stages, each stage traced into a forward and
a backward graph (``tracing/stages.py``), the graphs cleaned by the same passes as a whole step,
checked as a load checks them, and stored as one entry (``entries/pipeline_artifact.py``) under a
key every rank computes from the live job (``keying/pipeline_key.py``).
"""

from __future__ import annotations

import dataclasses
import logging
import time

import torch
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensorMode

from ..errors import CorruptArtifactError, SpmdAotError, UnsupportedError
from ..entries import store_artifact
from ..entries.pipeline_artifact import check_pipeline_blobs, encode_pipeline, read_pipeline_manifest
from ..job import Job
from ..keying.pipeline_key import pipeline_key
from ..parallel.pipeline_parallel import Pipeline, bubble_fraction, even_split_points, in_flight_peak, schedule_actions
from ..passes import ask_conv_weight_grads, fold_views, remove_detach, rewrite_inplace_views, strip_profiler_ops
from ..store import open_store
from ..tracing.fake_factories import fake_factories
from ..tracing.stage_tp import StageTP
from ..tracing.stages import trace_stages
from .peak_memory import _storage, graph_peak_bytes

__all__ = ["build_pipeline", "build_with_options", "check_run_options", "PipelineBuild", "pipeline_plan",
           "micro_batch", "trace_pipeline_blobs", "resolve_split"]

log = logging.getLogger(__name__)


@dataclasses.dataclass
class PipelineBuild:
    key: str
    digest: str
    traced: bool
    stats: dict
    seconds: float
    config: str = ""  # the pipeline and world size, as ``spmd-aot build`` lists them

    def describe(self) -> str:
        return self.config


def pipeline_plan(pipeline: Pipeline, world_size: int, device_type: str, split_points) -> dict:
    """The entry's plan: world size, the mesh ``(pp,)`` or ``(pp, dp_replicate)`` (each stage
    replicated over ``world_size / stages`` ranks that see different batches, their gradients
    averaged after the last micro-batch, as DDP under pipelining) or ``(pp, dp_shard)`` (the
    same with the stage's parameters sharded, as FSDP2), with a last ``tp`` dimension when the
    stages are tensor parallel; device, the split points. The stage graphs are the same for
    every data-parallel replica: they compute on a micro-batch of one replica's batch (and on
    TP-local parameters, the same graph for every TP rank)."""
    per_stage = pipeline.ranks * pipeline.tp
    if world_size % per_stage:
        tp = f" x tp {pipeline.tp}" if pipeline.tp > 1 else ""
        looped = f" ({pipeline.stages_per_rank} per rank)" if pipeline.stages_per_rank > 1 else ""
        raise SpmdAotError(
            f"a pipeline of {pipeline.stages} stages{looped}{tp} runs on a multiple of {per_stage} ranks (each "
            f"stage on world_size / {per_stage} data-parallel replicas), got world size {world_size}")
    dp = world_size // per_stage
    dp_role = "dp_shard" if pipeline.placement == "shard" else "dp_replicate"
    mesh, roles = [pipeline.ranks], ["pp"]
    if dp > 1:
        mesh, roles = mesh + [dp], roles + [dp_role]
    if pipeline.tp > 1:
        mesh, roles = mesh + [pipeline.tp], roles + ["tp"]
    return {"world_size": world_size, "mesh_shape": mesh, "mesh_roles": roles, "device_type": device_type,
            "split_points": list(split_points)}


def resolve_split(model, pipeline: Pipeline) -> tuple[str, ...]:
    return pipeline.split_points or (even_split_points(model, pipeline.stages) if pipeline.stages > 1 else ())


def micro_batch(batch, microbatches: int):
    """The first of ``microbatches`` equal micro-batches of ``batch`` (every leaf split on dim 0)."""
    def first(t):
        if not isinstance(t, torch.Tensor) or t.dim() == 0:
            raise SpmdAotError("a pipeline step's batch leaves are tensors split on dim 0 into micro-batches")
        if t.shape[0] % microbatches:
            raise SpmdAotError(f"a batch leaf of {t.shape[0]} samples does not split into {microbatches} equal "
                               f"micro-batches; use a batch size that is a multiple of {microbatches}")
        return t.narrow(0, 0, t.shape[0] // microbatches)
    return pytree.tree_map(first, tuple(batch))


def check_run_options(run) -> None:
    """Refuse the ``RunOptions`` a pipeline does not read yet (ignoring them would build or load
    something other than asked)."""
    unread = [f for f in ("allow_ops", "kernels", "module_override", "gm_transformation", "extra_sources")
              if getattr(run, f)]
    if unread:
        raise SpmdAotError(f"a pipeline does not take RunOptions.{unread[0]} yet (docs/pipeline_parallel.md); "
                           "drop it")


def build_with_options(job: Job, parallel, run, world_size: int, device: str = "cpu") -> PipelineBuild:
    """``spmd_aot.build`` with ``ParallelOptions(pipeline_stages=N, ...)``: the same entry as
    ``build_pipeline(job, parallel.pipeline(world_size), ...)``. Of the ``RunOptions`` a pipeline
    reads where its entry goes and what a load trusts; the others are refused, not ignored."""
    check_run_options(run)
    return build_pipeline(job, parallel.pipeline(world_size), world_size=world_size, cache_dir=run.cache_dir,
                          store=run.store, device=device, trust_cache=run.trust_cache)


def build_pipeline(job: Job, pipeline: Pipeline, *, world_size: int | None = None, cache_dir=None, store=None,
                   device: str = "cpu", trust_cache=None) -> PipelineBuild:
    """Build ``job`` as a pipeline; ``job.step`` is the loss function ``loss_fn(output, target)``
    and ``job.batch`` returns the step's whole batch ``(inputs..., target)`` (split into
    ``pipeline.microbatches`` on dim 0). A no-op (``traced=False``) when already cached."""
    start = time.perf_counter()
    world_size = pipeline.ranks * pipeline.tp if world_size is None else world_size
    store = store or open_store(cache_dir, trust_cache=trust_cache)
    fake_mode = FakeTensorMode()
    with fake_factories(fake_mode):
        model, batch = job.model(), job.batch()
        if device != "cpu":
            model = model.to(device)
            batch = pytree.tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, batch)
    split = resolve_split(model, pipeline)
    plan = pipeline_plan(pipeline, world_size, device, split)
    key = pipeline_key(model, job.step, batch, pipeline, plan)
    with store.lock(key.key):
        digest = store.get_ref(key.key)
        if digest is not None:
            try:
                manifest = read_pipeline_manifest(store, digest)
                if manifest["key"] == key.key:
                    return PipelineBuild(key.key, digest, False, manifest["stats"], time.perf_counter() - start,
                                         f"world={world_size} {pipeline.describe()}")
            except CorruptArtifactError as exc:
                log.warning("pipeline entry for key %s is damaged (%s); rebuilding it", key.key[:12], exc)
        blobs = trace_pipeline_blobs(model, job.step, batch, pipeline, plan, key)
        digest = store_artifact(store, key.key, blobs)
        stats = read_pipeline_manifest(store, digest)["stats"]
    seconds = time.perf_counter() - start
    log.info("build %s world=%d: key %s, digest %s, %.2f s", pipeline.describe(), world_size, key.key[:12],
             digest[:12], seconds)
    return PipelineBuild(key.key, digest, True, stats, seconds, f"world={world_size} {pipeline.describe()}")


def trace_pipeline_blobs(model, loss_fn, batch, pipeline: Pipeline, plan: dict, key) -> dict[str, bytes]:
    """Trace, clean, check: the entry's blobs (what a job-start miss stores too)."""
    start = time.perf_counter()
    tp = StageTP(pipeline.tp_plan, pipeline.tp, len(plan["mesh_shape"]) - 1) if pipeline.tp > 1 else None
    stages = trace_stages(model, loss_fn, micro_batch(batch, pipeline.microbatches), tuple(plan["split_points"]), tp)
    for st in stages:
        _dense_saved(st.forward, len(st.outputs))
        for gm in (st.forward, st.backward):
            strip_profiler_ops(gm)
            remove_detach(gm)
            rewrite_inplace_views(gm)
            ask_conv_weight_grads(gm)
            fold_views(gm)
            gm.recompile()
        st.stats = _stage_stats(st, schedule_actions(pipeline)[st.index])
    stats = {"stages": pipeline.stages, "microbatches": pipeline.microbatches, "schedule": pipeline.schedule,
             "bubble_fraction": round(bubble_fraction(pipeline), 4),
             "peak_bytes": [st.stats["peak_bytes"] for st in stages],
             "trace_seconds": round(time.perf_counter() - start, 4)}
    # a TP collective's group is stored as the mesh's TP dimension
    blobs = encode_pipeline(stages, key, plan, pipeline.to_dict(), stats, {tp.group_name: tp.mesh_dim} if tp else {})
    try:
        check_pipeline_blobs(blobs)  # what a load would refuse is never stored
    except CorruptArtifactError as exc:
        raise UnsupportedError(f"the built pipeline fails the check every load runs, so nothing was stored under key "
                               f"{key.key[:12]}: {exc}") from exc
    return blobs


def _dense_saved(gm, n_outputs: int) -> None:
    """Copy each saved tensor that is not dense (an expanded view: transformers' ``repeat_kv`` of
    one key/value head per TP rank) into its own memory in the forward graph: the backward graph
    takes its inputs dense, as every load lays them out."""
    from torch._prims_common import is_non_overlapping_and_dense_or_false as dense

    out = next(n for n in gm.graph.nodes if n.op == "output")
    values = list(out.args[0])
    for i in range(n_outputs, len(values)):
        node = values[i]
        val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
        if isinstance(val, torch.Tensor) and not dense(val):
            with gm.graph.inserting_before(out):
                values[i] = gm.graph.call_function(torch.ops.aten.clone.default, (node,))
            values[i].meta["val"] = val.clone()
    out.args = (tuple(values),)


def _stage_stats(st, actions) -> dict:
    """Nodes, and the stage's peak live bytes over the schedule, action by action: its parameters
    and buffers throughout, the gradients accumulated for them once the first backward ran, the
    saved tensors of every other micro-batch in flight (forward done, backward not), and the
    running graph's own peak (its intermediates, outputs and this micro-batch's saved tensors;
    a backward's parameter gradients counted once, as eager autograd adds them into ``.grad``)."""
    fw_in = _placeholder_values(st.forward)
    state = [v for p, v in zip(st.inputs, fw_in) if p.name.startswith(("param:", "buffer:"))]
    state_ids = {_key(v) for v in state}
    state_bytes = sum(_nbytes(v) for v in state)
    grad_bytes = sum(_nbytes(v) for p, v in zip(st.inputs, fw_in) if p.name.startswith("param:") and p.grad)
    saved_vals = _output_values(st.forward)[len(st.outputs):]
    seen, saved_bytes, aliased = set(state_ids), 0, 0
    for v in saved_vals:  # what a micro-batch keeps: storages not the stage's parameters'
        k = _key(v)
        if k in state_ids and k in seen:
            aliased += _nbytes(v)
            seen.discard(k)  # counted once: the backward graph's input of that storage
        if k not in seen and k not in state_ids:
            seen.add(k)
            saved_bytes += _nbytes(v)
    fw_work = graph_peak_bytes(st.forward) - state_bytes  # this micro-batch's inputs, outputs, saved
    bw_work = graph_peak_bytes(st.backward) - aliased  # saved inputs, intermediates, gradients
    peak = held = 0
    accumulated = False
    for action, _ in actions:
        if action == "F":
            peak = max(peak, state_bytes + (grad_bytes if accumulated else 0) + held * saved_bytes + fw_work)
            held += 1
        else:
            held -= 1
            peak = max(peak, state_bytes + held * saved_bytes + bw_work)
            accumulated = True
    return {"forward_nodes": len(st.forward.graph.nodes), "backward_nodes": len(st.backward.graph.nodes),
            "state_bytes": state_bytes, "saved_bytes_per_microbatch": saved_bytes,
            "in_flight": in_flight_peak(actions), "peak_bytes": peak}


def _placeholder_values(gm) -> list:
    return [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]


def _output_values(gm) -> list:
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    return [n.meta.get("val") if isinstance(n, torch.fx.Node) else None for n in out]


def _key(v):
    st = _storage(v) if isinstance(v, torch.Tensor) else None
    return st._cdata if st is not None else id(v)


def _nbytes(v) -> int:
    st = _storage(v) if isinstance(v, torch.Tensor) else None
    return st.nbytes() if st is not None else 0

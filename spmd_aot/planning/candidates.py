"""The configurations a world size allows, each estimated (``memory_model``) from a few fake
measurements of the job (``footprint``): one per compute dtype and checkpointing choice, shared
by every mesh, so listing dozens of meshes costs a handful of fake runs.

Meshes listed for ``world_size`` N (TP degree T among 1, 2, 4, 8 dividing N, with a TP plan):
'replicate' over N/T ranks (DDP), 'shard' over N/T (FSDP), and HSDP R x S with S one of 8 and 64
(a node's GPUs, and a larger shard group) where 1 < S < N/T; each with and without activation
checkpointing per block and in the master dtype and bf16 (unless a mesh, placement or dtype is
given: then only those).
"""

from __future__ import annotations

import dataclasses
import functools
import time

import torch

from .footprint import Extrapolated, measure_activations, measure_optimizer, measure_params
from .memory_model import Candidate, Estimate, estimate

__all__ = ["PlanResult", "candidates", "plan_fit"]

TP_DEGREES = (1, 2, 4, 8)
HSDP_SHARDS = (8, 64)


def candidates(world_size: int, *, tp: bool, placements=("replicate", "shard"), mesh_shape=None,
               dtypes=(None, torch.bfloat16), checkpoints=(False, True)) -> list[Candidate]:
    """Every configuration listed for ``world_size`` (module doc); ``mesh_shape`` (with ``tp``: its
    last dimension is TP) gives the one mesh instead."""
    meshes: list[tuple[str, int, int, int]] = []  # placement, replicas, shards, tp
    if mesh_shape is not None:
        meshes = [m for p in placements if (m := _from_shape(p, tuple(mesh_shape), tp)) is not None]
    for t in (TP_DEGREES if tp and mesh_shape is None else ()) or ((1,) if mesh_shape is None else ()):
        if world_size % t:
            continue
        dp = world_size // t
        if dp == 1:  # every rank a TP rank: no data-parallel placement to choose
            meshes.append(("replicate", 1, 1, t))
            continue
        for placement in placements:
            if placement == "replicate":
                meshes.append(("replicate", dp, 1, t))
            else:
                meshes.append(("shard", 1, dp, t))
                meshes += [("shard", dp // s, s, t) for s in HSDP_SHARDS if 1 < s < dp and dp % s == 0]
    return [Candidate(p, r, s, t, checkpoint=ac, param_dtype=d) for p, r, s, t in meshes
            for d in dtypes for ac in checkpoints]


def _from_shape(placement: str, shape: tuple[int, ...], tp: bool):
    """The mesh ``shape`` under ``placement`` (None where that placement cannot take it)."""
    t = shape[-1] if tp and len(shape) > 1 else 1
    dp = shape[:-1] if t > 1 or (tp and len(shape) > 1) else shape
    if placement == "replicate" and len(dp) == 1:
        return ("replicate", dp[0], 1, t)
    if placement == "shard" and len(dp) in (1, 2):
        return ("shard", dp[0] if len(dp) == 2 else 1, dp[-1], t)
    return None


@dataclasses.dataclass
class PlanResult:
    estimates: list[Estimate]
    seconds: float
    measurements: int  # fake runs of the step
    param_numel: int
    method: str  # how the activations were measured: the whole model, or extrapolated over its blocks


#: Models with more repeated blocks than this are measured at two depths and extrapolated.
EXTRAPOLATE_ABOVE = 4
DEPTHS = (2, 4)


def plan_fit(job, cands: list[Candidate], tp_plan=(), cast_forward_inputs: bool = True) -> PlanResult:
    """Estimate every candidate from a few fake runs: one per (compute dtype, checkpointing), or,
    for a model of more than ``EXTRAPOLATE_ABOVE`` identical blocks, two (at ``DEPTHS`` blocks),
    extrapolated to its depth (``footprint.Extrapolated``: exact while the blocks are identical),
    so planning a 126-block model costs what a 4-block one does."""
    start = time.perf_counter()
    params = measure_params(job, tp_plan)
    opt = measure_optimizer(job)
    depth = len(params.groups) - (params.root in params.groups)
    blocks_identical = len({v for k, v in params.groups.items() if k != params.root}) == 1
    extrapolate = depth > EXTRAPOLATE_ABOVE and blocks_identical
    footprints, runs, out = {}, 0, []
    for c in cands:
        k = (c.param_dtype, c.checkpoint)
        if k not in footprints:
            measure = functools.partial(measure_activations, job, compute_dtype=c.param_dtype,
                                        checkpoint=c.checkpoint, tp_plan=tp_plan,
                                        cast_forward_inputs=cast_forward_inputs)
            fp = None
            if extrapolate:
                try:
                    fp = Extrapolated(*(measure(depth=d) for d in DEPTHS), depth)
                    runs += len(DEPTHS)
                except Exception:  # noqa: BLE001 - the step cannot run a truncated block list (it counts
                    # its layers some other way): measure the whole model, whose errors are the user's
                    extrapolate = False
            if fp is None:
                fp = measure()
                runs += 1
            footprints[k] = fp
        out.append(estimate(c, params, footprints[k], opt, global_batch=job.global_batch))
    method = (f"extrapolated from {' and '.join(map(str, DEPTHS))} of its {depth} blocks" if extrapolate
              else "the whole model")
    return PlanResult(out, time.perf_counter() - start, runs, params.numel, method)

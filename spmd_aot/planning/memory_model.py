"""Per-rank peak memory and bytes communicated per step of one configuration: arithmetic over a
job's measured footprint (``footprint.py``), no trace per configuration.

The peak is the larger of two phases, each a sum of per-rank terms (docs/plan.md shows them):

- forward + backward: master parameters, optimizer state, the gradients alive at the activation
  peak, the parameters a 'shard' placement holds gathered (the root group from forward to backward,
  the largest block twice: the one computing and the one prefetched, and one block's unsharded
  gradient on its way to the reduce_scatter), a 'replicate' placement's compute copy under mixed
  precision and its gradient buckets, and the activations (the TP-split part divided by the TP
  degree);
- optimizer step: master parameters, their gradients, the optimizer state and the step's
  temporaries (foreach AdamW makes some parameter-sized lists).

A rank's share of a parameter is its numel divided by the TP degree (TP-split parameters) and by
the shard dimension ('shard'); gradients live in the master dtype after the reduction, as FSDP2 and
the stored step keep them. Bytes per collective kind are the payload each rank contributes per
step (an all_gather's output, a reduce_scatter's input, an all_reduce's tensor); ring algorithms
move about (n-1)/n of that (twice for all_reduce) over the wire.
"""

from __future__ import annotations

import dataclasses

import torch

from .footprint import Extrapolated, Footprint, OptimizerCost, Params

__all__ = ["Candidate", "Estimate", "estimate"]


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One configuration: placement, mesh (replicas x shards x TP), checkpointing, compute dtype."""

    placement: str  # 'replicate' or 'shard'
    dp_replicate: int
    dp_shard: int
    tp: int = 1
    checkpoint: bool = False
    param_dtype: torch.dtype | None = None  # None: compute in the master dtype
    reshard_after_forward: bool = True
    bucket_cap_mb: float = 25.0

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        dp = (self.dp_replicate, self.dp_shard) if self.placement == "shard" and self.dp_replicate > 1 \
            else (self.dp_replicate * self.dp_shard,)
        if self.tp > 1 and dp == (1,):
            return (self.tp,)
        return dp + ((self.tp,) if self.tp > 1 else ())

    def describe(self) -> str:
        """E.g. 'shard 64 bf16', 'hsdp 8x16 x tp 8 ac', 'tp 8': placement, data-parallel mesh, TP degree,
        compute dtype (none: the master dtype), 'ac' with every block checkpointed."""
        kind = ("hsdp" if self.dp_replicate > 1 else "shard") if self.placement == "shard" else "replicate"
        dtype = {None: "", torch.bfloat16: " bf16", torch.float16: " fp16", torch.float32: " fp32"}[self.param_dtype]
        dp = self.mesh_shape[:-1] if self.tp > 1 else self.mesh_shape
        mesh = f"{kind} {'x'.join(map(str, dp))}" if self.dp_replicate * self.dp_shard > 1 else ""
        tp = f"tp {self.tp}" if self.tp > 1 else ""
        return f"{' x '.join(p for p in (mesh, tp) if p)}{dtype}{' ac' if self.checkpoint else ''}"


@dataclasses.dataclass(frozen=True)
class Estimate:
    candidate: Candidate
    peak_bytes: int
    terms: dict  # name -> bytes (the phase that sets the peak)
    phase: str  # 'forward+backward' or 'optimizer step'
    comm: dict  # collective kind -> payload bytes per rank per step


def estimate(c: Candidate, params: Params, fp: Footprint | Extrapolated, opt: OptimizerCost, *,
             global_batch: bool = False) -> Estimate:
    """The per-rank peak and communication of ``c`` (see module doc). ``fp`` must be measured in
    ``c``'s compute dtype and checkpointing; ``global_batch``: the job's batch is the whole step's,
    so each rank's activations are its 1/(replicas x shards) part."""
    if fp.checkpoint != c.checkpoint:
        raise ValueError(f"{c.describe()}: footprint measured with checkpoint={fp.checkpoint}")
    shard = c.dp_shard if c.placement == "shard" else 1
    dp = c.dp_replicate * c.dp_shard
    master_item = params.master_itemsize
    compute_item = torch.empty((), dtype=fp.compute_dtype).element_size()

    def per_rank(numel: int, tp_numel: int) -> float:
        return (numel - tp_numel) + tp_numel / c.tp

    rank_numel = per_rank(params.numel, params.tp_numel) / shard
    master = rank_numel * master_item
    state = opt.state_per_param_byte * master
    batch_div = dp if global_batch else 1
    grad_fraction = per_rank(params.numel, params.tp_numel) / shard / max(1, params.numel)
    act, grads_at_peak = fp.peak(c.tp, batch_div, grad_fraction / compute_item * master_item)
    fwd = {"parameters (master)": master, "optimizer state": state, "gradients at the peak": grads_at_peak,
           "activations": act}
    if c.placement == "shard":
        root = params.groups.get(params.root, (0, 0))
        block = params.largest_block()
        fwd["gathered parameters"] = (per_rank(*root) + 2 * per_rank(*block)) * compute_item
        fwd["unsharded gradient (reduce_scatter)"] = per_rank(*block) * compute_item
    else:
        if fp.compute_dtype != _master_dtype(master_item):
            fwd["compute copy of the parameters"] = rank_numel * compute_item
        fwd["gradient buckets"] = min(c.bucket_cap_mb * 2**20, rank_numel * compute_item) if dp > 1 else 0
    step = {"parameters (master)": master, "gradients": master, "optimizer state": state,
            "optimizer temporaries": opt.temp_per_param_byte * master}
    a, b = sum(fwd.values()), sum(step.values())
    phase, terms = ("forward+backward", fwd) if a >= b else ("optimizer step", step)
    comm = _comm(c, params, fp, compute_item, batch_div)
    return Estimate(c, int(max(a, b)), {k: int(v) for k, v in terms.items()}, phase, comm)


def _master_dtype(itemsize: int) -> torch.dtype:
    return {4: torch.float32, 2: torch.bfloat16, 8: torch.float64}.get(itemsize, torch.float32)


def _comm(c: Candidate, params: Params, fp: Footprint, compute_item: int, batch_div: int) -> dict:
    tp_numel = (params.numel - params.tp_numel) + params.tp_numel / c.tp  # one TP rank's whole parameters
    comm = {"all_gather": 0.0, "reduce_scatter": 0.0, "all_reduce": 0.0}
    dp = c.dp_replicate * c.dp_shard
    if c.placement == "shard" and c.dp_shard > 1:
        root = params.groups.get(params.root, (0, 0))
        root_numel = (root[0] - root[1]) + root[1] / c.tp
        gathers = 2 if c.reshard_after_forward else 1
        comm["all_gather"] = (root_numel + gathers * (tp_numel - root_numel)) * compute_item
        comm["reduce_scatter"] = tp_numel * compute_item
        if c.dp_replicate > 1:
            comm["all_reduce"] += tp_numel / c.dp_shard * compute_item
    elif dp > 1:
        comm["all_reduce"] += tp_numel * compute_item
    if c.tp > 1:
        for kind, n in fp.tp_comm.items():
            comm[kind] += n / batch_div
    return {k: int(v) for k, v in comm.items() if v}

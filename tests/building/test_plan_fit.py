"""The plan's per-rank peak (spmd_aot/planning) against eager PyTorch's measured peak.

A small Llama-shaped model (RMSNorm, SDPA attention, SwiGLU, AdamW) is estimated from fake
tensors and run eagerly on real gloo ranks as torch's own recipes run it: FSDP2 (``fully_shard``
per block and on the root) at world 2, HSDP x TP (``parallelize_module`` with Colwise/Rowwise
parallel on the 'tp' dimension of a 2x2x2 mesh, then ``fully_shard`` over the 2x2 data-parallel
mesh) at world 8, FSDP2 with every block checkpointed (non-reentrant ``torch.utils.checkpoint``),
FSDP2 computing in bf16 over fp32 master weights (``MixedPrecisionPolicy(param_dtype=bf16)``), and
DDP at world 2.
``PeakMemory`` measures the second step (the first makes AdamW's state); the estimate must be
within 10% of it on every rank.
"""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import spmd_aot
from spmd_aot.examples.models import train_step
from spmd_aot.building.peak_memory import PeakMemory, fsdp2_storages, state_tensors
from spmd_aot.planning.candidates import candidates, plan_fit
from spmd_aot.planning.footprint import checkpoint_blocks, measure_activations, measure_optimizer, measure_params
from spmd_aot.planning.memory_model import Candidate, estimate
from support.multiproc import run_ranks

VOCAB, D, HEADS, LAYERS, SEQ, BATCH = 256, 128, 4, 4, 64, 8
TOLERANCE = 0.10


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.hd = D // HEADS
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(D, D, bias=False) for _ in range(4))

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (w(x).view(b, t, -1, self.hd).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(o.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.n1, self.n2, self.attn = nn.RMSNorm(D), nn.RMSNorm(D), Attention()
        self.w1, self.w3 = nn.Linear(D, 4 * D, bias=False), nn.Linear(D, 4 * D, bias=False)
        self.w2 = nn.Linear(4 * D, D, bias=False)

    def forward(self, x):
        x = x + self.attn(self.n1(x))
        h = self.n2(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class Llama(nn.Module):
    def __init__(self, layers: int = LAYERS):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, D)
        self.layers = nn.ModuleList(Block() for _ in range(layers))
        self.norm, self.out = nn.RMSNorm(D), nn.Linear(D, VOCAB, bias=False)

    def forward(self, idx):
        x = self.tok(idx)
        for layer in self.layers:
            x = layer(x)
        return self.out(self.norm(x))


step = train_step  # the canonical step: forward, cross-entropy, backward, AdamW, zero grads


def adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-3)


def batch(rank=0, i=0):
    g = torch.Generator().manual_seed(1000 * rank + i)
    return (torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), torch.randint(0, VOCAB, (BATCH, SEQ), generator=g))


TP_PLAN = (("layers.*.attn.wq", "colwise"), ("layers.*.attn.wk", "colwise"), ("layers.*.attn.wv", "colwise"),
           ("layers.*.attn.wo", "rowwise"), ("layers.*.w1", "colwise"), ("layers.*.w3", "colwise"),
           ("layers.*.w2", "rowwise"))
JOB = spmd_aot.Job(step=step, model=Llama, optimizer=adamw, batch=batch)

CONFIGS = {  # name: (world, the plan's candidate)
    "shard": (2, Candidate("shard", 1, 2)),
    "hsdp_tp": (8, Candidate("shard", 2, 2, 2)),
    "shard_ac": (2, Candidate("shard", 1, 2, checkpoint=True)),
    "shard_bf16": (2, Candidate("shard", 1, 2, param_dtype=torch.bfloat16)),
    "replicate": (2, Candidate("replicate", 2, 1)),
}


def _eager_worker(rank, world, config):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    model = Llama()
    if config == "shard_ac":
        checkpoint_blocks(model)
    if config == "hsdp_tp":
        mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
        styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
        for layer in model.layers:
            parallelize_module(layer, mesh["tp"], {pattern.split("layers.*.")[1]: styles[style]()
                                                   for pattern, style in TP_PLAN})
        dp_mesh, dp_rank = mesh["dp_replicate", "dp_shard"], rank // 2
    else:
        dp_mesh, dp_rank = init_device_mesh("cpu", (world,)), rank
    if config == "replicate":
        model = torch.nn.parallel.DistributedDataParallel(model)
        optim = adamw(model)
        step(model, optim, batch(rank, 0))
        b = batch(rank, 1)
        with PeakMemory(state_tensors(model, optim, b)) as measured:
            step(model, optim, b)
        return measured.peak
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if config == "shard_bf16" else MixedPrecisionPolicy()
    for layer in model.layers:
        fully_shard(layer, mesh=dp_mesh, mp_policy=policy)
    fully_shard(model, mesh=dp_mesh, mp_policy=policy)
    optim = adamw(model)
    step(model, optim, batch(dp_rank, 0))
    b = batch(dp_rank, 1)
    with PeakMemory(state_tensors(model, optim, b) + fsdp2_storages(model)) as measured:
        step(model, optim, b)
    return measured.peak


@pytest.fixture(scope="module")
def estimates():
    result = plan_fit(JOB, [c for _, c in CONFIGS.values()], TP_PLAN)
    return {name: e for name, e in zip(CONFIGS, result.estimates)}


@pytest.mark.parametrize("config", list(CONFIGS))
def test_estimated_peak_is_within_ten_percent_of_eager(config, estimates):
    world, _ = CONFIGS[config]
    peaks = run_ranks(_eager_worker, world, config, timeout=900)
    estimate = estimates[config].peak_bytes
    print(f"{config} world {world}: estimate {estimate} B, eager {peaks} B, ratios "
          f"{[round(estimate / p, 3) for p in peaks]}")
    for rank, peak in enumerate(peaks):
        assert abs(estimate - peak) <= TOLERANCE * peak, (config, rank, estimate, peak, estimates[config].terms)


def test_checkpointing_tp_and_sharding_each_lower_the_estimate(estimates):
    shard, ac, hsdp_tp = (estimates[n].peak_bytes for n in ("shard", "shard_ac", "hsdp_tp"))
    assert ac < 0.8 * shard and hsdp_tp < 0.8 * shard
    assert estimates["shard_ac"].terms["activations"] < 0.5 * estimates["shard"].terms["activations"]


def test_communication_by_kind():
    """Payload bytes per rank per step: FSDP gathers every block twice (forward, backward) and the
    root once, reduce-scatters every gradient once; HSDP adds an all_reduce of the shards; TP adds
    all_reduces of activations; DDP all_reduces every gradient."""
    params = sum(p.numel() for p in Llama().parameters())
    root = VOCAB * D * 2 + D
    result = plan_fit(JOB, [Candidate("replicate", 4, 1), Candidate("shard", 1, 4), Candidate("shard", 2, 2, 2)],
                      TP_PLAN)
    ddp, fsdp, hsdp_tp = (e.comm for e in result.estimates)
    assert ddp == {"all_reduce": params * 4}
    assert fsdp == {"all_gather": (2 * params - root) * 4, "reduce_scatter": params * 4}
    norms = LAYERS * 2 * D  # whole on every TP rank
    tp_params = root + norms + (params - root - norms) // 2
    assert hsdp_tp["reduce_scatter"] == tp_params * 4
    assert hsdp_tp["all_reduce"] > tp_params * 4 // 2  # shards over replicas + TP activations
    assert result.measurements == 1  # one fake run served all three meshes


def test_candidates_cover_the_meshes_a_world_allows():
    listed = {(c.placement, c.mesh_shape) for c in candidates(128, tp=True, dtypes=(None,), checkpoints=(False,))}
    assert ("replicate", (128,)) in listed and ("shard", (128,)) in listed
    assert ("shard", (16, 8)) in listed and ("shard", (2, 64)) in listed  # HSDP, 8 and 64 shards
    assert ("shard", (2, 8, 8)) in listed and ("shard", (16, 8)) in listed  # HSDP x TP 8
    assert all(math.prod(shape) == 128 for _, shape in listed)
    assert not any(shape == (1, 128) for _, shape in listed)
    fixed = candidates(8, tp=True, mesh_shape=(2, 2, 2), dtypes=(None,), checkpoints=(False,))
    assert [c.describe() for c in fixed] == ["hsdp 2x2 x tp 2"]


class CountedLlama(Llama):
    """Runs its layers by a count fixed when made: a truncated block list makes it fail."""

    def __init__(self):
        super().__init__(layers=8)

    def forward(self, idx):
        x = self.tok(idx)
        for i in range(8):
            x = self.layers[i](x)
        return self.out(self.norm(x))


@pytest.mark.parametrize("model", [lambda: Llama(layers=8), CountedLlama])
def test_a_deep_model_measured_at_two_depths_gives_the_whole_models_figures(model):
    deep = spmd_aot.Job(step=step, model=model, optimizer=adamw, batch=batch)
    cands = [Candidate("shard", 1, 2), Candidate("shard", 2, 2, 2, checkpoint=True, param_dtype=torch.bfloat16)]
    result = plan_fit(deep, cands, TP_PLAN)
    expect = "extrapolated from 2 and 4 of its 8 blocks" if model is not CountedLlama else "the whole model"
    assert result.method == expect
    params, opt = measure_params(deep, TP_PLAN), measure_optimizer(deep)
    for c, e in zip(cands, result.estimates):
        fp = measure_activations(deep, compute_dtype=c.param_dtype, checkpoint=c.checkpoint, tp_plan=TP_PLAN)
        whole = estimate(c, params, fp, opt)
        assert abs(e.peak_bytes - whole.peak_bytes) <= 8 and e.comm == whole.comm, (e, whole)

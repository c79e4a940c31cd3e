"""Step time of the loaded step vs eager DDP / FSDP2 (and torch.compile), on real gloo ranks.

    python tools/bench/bench_step.py                    # 4 layers, d_model 128, context 64, AdamW; world 1, 2, 4
    python tools/bench/bench_step.py --sweep            # layers {2, 12} x d_model {64, 256}, few steps
    python tools/bench/bench_step.py --quick            # a smoke run of a few seconds per world
    python tools/bench/bench_step.py --with-torch-compile --worlds 2 --placements replicate
    python tools/bench/bench_step.py --sweep --fused-adamw   # every variant's AdamW fused=True
    python tools/bench/bench_step.py --kernels --with-torch-compile --layers 12 --batch 2   # compiled kernels
    python tools/bench/bench_step.py --kernels --with-torch-compile --worlds 4 --placements "hsdp,shard x tp"
    python tools/bench/bench_step.py --kernels --with-torch-compile --worlds 4 --placements "replicate x tp"
    python tools/bench/bench_step.py --context-parallel --seq 256   # cp 2 at world 2, dp_shard 2 x cp 2 at 4
    python tools/bench/bench_step.py --expert-parallel              # dp_shard 2 x ep 2 at world 4

For each (world, placement) the artifact is built offline first (``spmd_aot.build``), then
one process group per world size runs every configuration of that world. Each rank holds
identical copies of the example transformer + AdamW, one per variant:

  loaded    ``spmd_aot.compile(train_step, require_hit=True)`` (the artifact, no tracing)
  eager     plain eager at world 1; eager DDP for replicate; eager FSDP2 ``fully_shard`` per
            block then the root for shard; HSDP: the same on a (2, 2) mesh; ``shard x tp``
            (dp_shard 2 x tp 2, world 4: the blocks' MLPs column- then row-wise, ``TP_PLAN``):
            ``parallelize_module`` over tp, then ``fully_shard`` over dp_shard; ``replicate x tp``
            (dp_replicate 2 x tp 2, world 4, the same plan): ``parallelize_module`` over tp, then
            DDP over dp_replicate's group (torch's ``_pre_dp_module_transform`` first: DDP takes
            plain tensors, so TP's DTensor parameters are localized between forwards)
  compiled  (``--with-torch-compile``) ``torch.compile`` of that eager model; its first step
            is reported separately as compile seconds. For ``replicate x tp`` each block is
            compiled instead (``Module.compile`` after ``parallelize_module``, before DDP:
            torchtitan's order), since torch 2.13 cannot compile DDP over TP's localized
            parameters whole (``BLOCK_COMPILE``)
  kernels   (``--kernels``) the entry built with ``kernels=True``, loaded from a trusted cache:
            the step runs Inductor's kernels compiled at build time (``spmd_aot/building/kernels.py``);
            its first call (key, load, bind) is reported as kernels first s
  whole     (``--kernels --with-torch-compile``, world 1) ``torch.compile`` of the whole train step
            (forward, backward, AdamW: the kernels ``aot_compile`` of the step precompiles)

The optimizer is ``AdamW(lr=1e-3)`` with torch's defaults, as users write it; the loaded step
then runs the fused AdamW kernel (see docs/models.md "Optimizer implementation") where eager runs
torch's per-tensor loop on CPU. ``--fused-adamw`` gives every variant ``fused=True``, so the
ratio shows what is left without that choice.

``--context-parallel`` and ``--expert-parallel`` measure those axes instead (either or both):

  cp        the example transformer masks its scores by hand, and context parallel splits SDPA
            calls, so a causal SDPA model with RoPE from position ids in the batch (the one
            tests/parallel/test_context_parallel.py checks parity on) is built with
            ``context_parallel=True``: ``cp`` (cp 2, world 2) and ``shard x cp`` (dp_shard 2 x
            cp 2, world 4). The cp ranks of a data-parallel share pass the same batch. torch's own
            ``context_parallel`` does not run on CPU/gloo (no sharding strategy for the CPU flash
            attention op), so eager is the same model on the unsplit sequence: plain eager at
            world 2, ``fully_shard`` over dp_shard only at world 4; each cp rank of a share runs
            that same job, so eager's ms is what a job on world/cp ranks takes. Δloss compares the
            mean of the cp ranks' losses (each its tokens' mean) with eager's.
  ep        a MoE of our own (4 experts, top 2, a shared expert per block; the one
            tests/parallel/test_expert_parallel.py checks parity on) built with
            ``expert_parallel="auto"``: ``shard x ep`` (dp_shard 2 x ep 2, world 4), against eager
            ``fully_shard`` of the unsplit model over the 4 ranks, each rank its own batch.

Every variant is warmed up, then timed in interleaved blocks (the order rotates each block),
each block framed by barriers so it ends when the slowest rank does. ms/step is rank 0's
median over blocks; a ratio is the median over blocks of variant/eager within the same block.
Δloss is |loaded - eager| of rank 0's last loss: the variants did the same work.
Prints a Markdown table, writes a grouped bar chart (SVG) and optionally the rows as JSON.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import gc
import json
import multiprocessing as mp
import os
import queue as queue_mod
import shlex
import socket
import statistics
import sys
import tempfile
import time
import traceback
import warnings

# Noise on every process: torch without numpy, and FSDP2's note on the view our model returns.
QUIET = "ignore:Failed to initialize NumPy,ignore:FSDP2-wrapped module"
for _rule in QUIET.split(","):
    warnings.filterwarnings("ignore", message=_rule.split(":", 1)[1])

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import spmd_aot  # noqa: E402
from spmd_aot.examples.models import StackedExperts, Transformer, train_step  # noqa: E402

from bar_chart import write_svg  # noqa: E402  (a sibling file of this script)

VOCAB, HEADS = 256, 4
TARGET = {1: 0.95}  # loaded/eager the project aims for; 0.90 at world > 1
EAGER_NAME = {"single": "eager", "replicate": "DDP", "shard": "FSDP2", "hsdp": "FSDP2 2x2", "shard x tp": "FSDP2 x TP",
              "replicate x tp": "DDP x TP",
              "cp": "eager, whole seq", "shard x cp": "FSDP2 dp 2, whole seq", "shard x ep": "FSDP2"}
# context / expert parallel configurations: placement -> (spmd_aot placement, mesh shape, extra options)
AXIS_PLACEMENTS = {"cp": ("replicate", None, dict(context_parallel=True)),
                   "shard x cp": ("shard", (2, 2), dict(context_parallel=True)),
                   "shard x ep": ("shard", (2, 2), dict(expert_parallel="auto"))}
EXPERTS, TOP_K = 4, 2
# DP x TP (``shard x tp``, a (dp_shard 2, tp 2) mesh, and ``replicate x tp``, a (dp_replicate 2,
# tp 2) mesh, at world 4): each block's MLP split Megatron style; the example attention splits its
# fused qkv by the full width, so it stays whole
TP_PLAN = {"blocks.*.mlp.0": "colwise", "blocks.*.mlp.2": "rowwise"}
TP_MESH = {"shard x tp": ((2, 2), ("dp_shard", "tp")), "replicate x tp": ((2, 2), ("dp_replicate", "tp"))}
# Placements whose torch.compile variant compiles each block rather than the wrapped model. In torch
# 2.13, torch.compile of DDP over a TP model (whose DTensor parameters ``_pre_dp_module_transform``
# swaps for local tensors after each forward and back before the next) fails: by default AOTAutograd
# hashes a DTensorSpec holding a SymInt ("unhashable type: non-nested SymInt"; the same with
# ``optimize_ddp=False`` or compiling the model before DDP wraps it), and with ``dynamic=False`` the
# second step backwards through the first step's graph, the parameters having been re-registered.
BLOCK_COMPILE = {"replicate x tp"}


# ---------------------------------------------------------------------------- the cp and ep models
class RopeAttention(nn.Module):
    """RoPE on the position ids the batch carries (global ones, so they stay exact when context
    parallel splits the sequence), then causal SDPA: the call context parallel splits."""

    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        self.heads = n_heads
        self.q, self.k, self.v, self.o = (nn.Linear(d_model, d_model, bias=False) for _ in range(4))
        head_dim = d_model // n_heads
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim)),
                             persistent=False)

    def forward(self, x, pos):
        b, t, d = x.shape
        freqs = pos[..., None].float() * self.inv_freq  # [b, t, head_dim / 2]
        cos, sin = freqs.cos()[:, None], freqs.sin()[:, None]

        def heads(z, rope=True):
            z = z.view(b, t, self.heads, -1).transpose(1, 2)
            if not rope:
                return z
            z1, z2 = z[..., 0::2], z[..., 1::2]
            return torch.stack([z1 * cos - z2 * sin, z1 * sin + z2 * cos], dim=-1).flatten(-2)

        out = F.scaled_dot_product_attention(heads(self.q(x)), heads(self.k(x)), heads(self.v(x), rope=False),
                                             is_causal=True)
        return self.o(out.transpose(1, 2).reshape(b, t, d))


class CPBlock(nn.Module):
    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        self.ln1, self.ln2 = nn.RMSNorm(d_model), nn.RMSNorm(d_model)
        self.attn = RopeAttention(d_model, n_heads)
        self.up, self.down = nn.Linear(d_model, 4 * d_model), nn.Linear(4 * d_model, d_model)

    def forward(self, x, pos):
        x = x + self.attn(self.ln1(x), pos)
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class CPNet(nn.Module):
    """A causal SDPA transformer whose forward returns the loss over the tokens it is given."""

    def __init__(self, vocab: int, d_model: int, n_heads: int, n_layers: int):
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.blocks = nn.ModuleList([CPBlock(d_model, n_heads) for _ in range(n_layers)])
        self.ln_f, self.head = nn.RMSNorm(d_model), nn.Linear(d_model, vocab)

    def forward(self, input_ids, position_ids, targets):
        x = self.tok(input_ids)
        for block in self.blocks:
            x = block(x, position_ids)
        return F.cross_entropy(self.head(self.ln_f(x)).flatten(0, 1), targets.flatten())


class MoEBlock(nn.Module):
    def __init__(self, d_model: int):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.up, self.down = nn.Linear(d_model, 2 * d_model), nn.Linear(2 * d_model, d_model)
        self.router = nn.Linear(d_model, EXPERTS, bias=False)
        self.experts = StackedExperts(EXPERTS, d_model, 2 * d_model)
        self.shared = nn.Sequential(nn.Linear(d_model, d_model), nn.SiLU(), nn.Linear(d_model, d_model))

    def forward(self, x):
        x = x + self.down(F.gelu(self.up(self.norm1(x))))
        h = self.norm2(x).reshape(-1, x.shape[-1])
        weights, index = self.router(h).softmax(-1).topk(TOP_K, -1)
        weights = weights / weights.sum(-1, keepdim=True)
        return x + (self.experts(h, index, weights) + self.shared(h)).view_as(x)


class MoENet(nn.Module):
    """A MoE language model whose forward returns the loss."""

    def __init__(self, vocab: int, d_model: int, n_layers: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.blocks = nn.ModuleList(MoEBlock(d_model) for _ in range(n_layers))
        self.norm, self.head = nn.LayerNorm(d_model), nn.Linear(d_model, vocab)

    def forward(self, input_ids, labels):
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(self.norm(x)).flatten(0, 1), labels.flatten())


def loss_step(model, optim, batch):
    """The step of the cp and ep models, whose forward returns the loss."""
    loss = model(**batch)
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


@dataclasses.dataclass(frozen=True)
class Config:
    world: int
    placement: str  # "single" (world 1), "replicate", "shard", "hsdp" (shard on a 2x2 mesh), "shard x tp",
    #                 "replicate x tp", or AXIS_PLACEMENTS
    layers: int
    d_model: int

    @property
    def axis(self) -> str | None:
        """"cp" or "ep" for a context / expert parallel configuration."""
        return self.placement.rsplit(" ", 1)[-1] if self.placement in AXIS_PLACEMENTS else None

    @property
    def spmd_placement(self) -> str:
        if self.axis:
            return AXIS_PLACEMENTS[self.placement][0]
        return "shard" if self.placement in ("shard", "hsdp", "shard x tp") else "replicate"

    @property
    def mesh_shape(self):
        if self.axis:
            return AXIS_PLACEMENTS[self.placement][1]
        if self.placement in TP_MESH:
            return TP_MESH[self.placement][0]
        return (2, 2) if self.placement == "hsdp" else None

    @property
    def options(self) -> dict:
        """What build and compile take for this configuration, besides the communication options."""
        extra = AXIS_PLACEMENTS[self.placement][2] if self.axis else {}
        if self.placement in TP_MESH:
            extra = {"tp_plan": TP_PLAN}
        return dict(placement=self.spmd_placement, mesh_shape=self.mesh_shape, **extra)

    @property
    def step(self):
        return loss_step if self.axis else train_step

    @property
    def label(self) -> str:
        return f"w{self.world} {self.placement}\nL{self.layers} d{self.d_model}"


@dataclasses.dataclass(frozen=True)
class Settings:
    seq: int
    batch: int  # per rank, as DDP sees it
    steps: int  # per timed block
    blocks: int
    warmup: int
    with_compile: bool
    comm: dict
    fused_adamw: bool = False  # every variant's AdamW gets fused=True (not torch's default)
    kernels: bool = False  # also the entry with compiled kernels (``kernels=True``)


def _adamw(params, s: Settings):
    return torch.optim.AdamW(params, lr=1e-3, **({"fused": True} if s.fused_adamw else {}))


def _model_and_optim(cfg: Config, s: Settings):
    torch.manual_seed(0)  # identical copies on every rank and for every variant
    if cfg.axis == "cp":
        model = CPNet(vocab=VOCAB, d_model=cfg.d_model, n_heads=HEADS, n_layers=cfg.layers)
    elif cfg.axis == "ep":
        model = MoENet(vocab=VOCAB, d_model=cfg.d_model, n_layers=cfg.layers)
    else:
        model = Transformer(vocab=VOCAB, d_model=cfg.d_model, n_heads=HEADS, n_layers=cfg.layers, max_len=s.seq)
    return model, _adamw(model.parameters(), s)


def _batch(s: Settings, rank: int, cfg: Config | None = None):
    axis = cfg.axis if cfg is not None else None
    # the cp or tp ranks of a share (cp or tp is 2, the last dim) pass one batch
    share = rank // 2 if axis == "cp" or (cfg is not None and cfg.placement in TP_MESH) else rank
    g = torch.Generator().manual_seed(1000 + share)
    if axis == "cp":  # targets shifted before the step, global position ids: both follow the split
        tokens = torch.randint(0, VOCAB, (s.batch, s.seq + 1), generator=g)
        return {"input_ids": tokens[:, :-1].contiguous(), "targets": tokens[:, 1:].contiguous(),
                "position_ids": torch.arange(s.seq).expand(s.batch, s.seq).contiguous()}
    x, y = (torch.randint(0, VOCAB, (s.batch, s.seq), generator=g),
            torch.randint(0, VOCAB, (s.batch, s.seq), generator=g))
    return {"input_ids": x, "labels": y} if axis == "ep" else (x, y)


def build(cfg: Config, s: Settings, cache_dir: str) -> float:
    """Build the artifact offline, as CI would; returns seconds (0 when it was cached)."""
    job = spmd_aot.Job(step=cfg.step, model=lambda: _model_and_optim(cfg, s)[0],
                       optimizer=lambda m: _adamw(m.parameters(), s),
                       batch=lambda: _batch(s, 0, cfg))
    result = spmd_aot.build(job, world_size=cfg.world, cache_dir=cache_dir, **cfg.options, **s.comm)
    seconds = result.seconds if result.traced else 0.0
    if s.kernels:
        with_kernels = spmd_aot.build(job, world_size=cfg.world, cache_dir=cache_dir, kernels=True, **cfg.options,
                                      **s.comm)
        if with_kernels.stats.get("kernels") != "compiled":
            print(f"  no kernels for {cfg}: {with_kernels.stats.get('kernels')}", file=sys.stderr, flush=True)
        seconds += with_kernels.seconds if with_kernels.traced else 0.0
    return seconds


# ---------------------------------------------------------------------------- on every rank
def _eager_model(cfg: Config, world: int, s: Settings, compile_blocks: bool = False):
    """The eager oracle for this placement: (module to call, its optimizer); with
    ``compile_blocks`` (DP x TP only) each block compiled before the data-parallel wrapper."""
    model, optim = _model_and_optim(cfg, s)
    if world == 1 or cfg.placement == "cp":  # cp alone: every rank runs the unsplit sequence
        return model, optim
    if cfg.placement in TP_MESH:
        return _tp_eager_model(cfg, model, s, compile_blocks)
    if cfg.spmd_placement == "replicate":
        from torch.nn.parallel import DistributedDataParallel
        return DistributedDataParallel(model), optim
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    if cfg.axis == "cp":  # over dp_shard only; the cp ranks of a share run the same job
        mesh = init_device_mesh("cpu", cfg.mesh_shape, mesh_dim_names=("dp_shard", "cp"))["dp_shard"]
    else:  # ep: the unsplit model over the whole world
        shape = (world,) if cfg.axis == "ep" else cfg.mesh_shape or (world,)
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard")[-len(shape):])
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    # fully_shard swaps parameters for DTensors: the optimizer must see the new ones.
    return model, _adamw(model.parameters(), s)


def _tp_eager_model(cfg: Config, model, s: Settings, compile_blocks: bool = False):
    """DP x TP in torchtitan's order: ``parallelize_module`` over tp first, then the data-parallel
    wrapper over the other dim: ``fully_shard`` per block and on the root over dp_shard, or DDP
    over dp_replicate's group. DDP takes plain tensors, not TP's DTensors, so torch's
    ``_pre_dp_module_transform`` localizes them between forwards (the composable ``replicate``
    given a sub-mesh registers the same hooks): DDP then all-reduces each rank's local shard
    gradients over its replicas, as the built step does."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    shape, names = TP_MESH[cfg.placement]
    mesh_2d = init_device_mesh("cpu", shape, mesh_dim_names=names)
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    parallelize_module(model, mesh_2d["tp"], {k.replace("*", str(i)): styles[v]() for k, v in TP_PLAN.items()
                                              for i in range(len(model.blocks))})
    if compile_blocks:  # torchtitan's regional compile: blocks see TP's DTensor parameters
        for block in model.blocks:
            block.compile()
    if names[0] == "dp_replicate":
        from torch.distributed.tensor.parallel.ddp import _pre_dp_module_transform
        from torch.nn.parallel import DistributedDataParallel
        _pre_dp_module_transform(model)
        model = DistributedDataParallel(model, process_group=mesh_2d["dp_replicate"].get_group())
    else:
        from torch.distributed.fsdp import fully_shard
        for block in model.blocks:
            fully_shard(block, mesh=mesh_2d["dp_shard"])
        fully_shard(model, mesh=mesh_2d["dp_shard"])
    # both swap parameters (for DTensors, for their local tensors): the optimizer must see the new ones
    return model, _adamw(model.parameters(), s)


def _sync(world: int) -> None:
    if world > 1:
        torch.distributed.barrier()


def timed_blocks(variants: dict, blocks: int, steps: int, sync, last: dict | None = None) -> dict:
    """Milliseconds per call of each variant (name -> zero-argument callable), one figure per
    block: ``blocks`` rounds in which every variant makes ``steps`` calls, the order rotating
    each round, each run framed by ``sync()`` (barriers, a device synchronize) so it ends when
    the slowest rank does. ``last`` receives each variant's last return value."""
    names = list(variants)
    times = {name: [] for name in names}
    for b in range(blocks):
        for name in names[b % len(names):] + names[:b % len(names)]:
            fn = variants[name]
            sync()
            start = time.perf_counter()
            for _ in range(steps):
                value = fn()
            sync()
            times[name].append((time.perf_counter() - start) / steps * 1000)
            if last is not None:
                last[name] = value
    return times


def median_ratio(numerators: list[float], denominators: list[float]) -> float:
    """The median over blocks of one variant's time over another's in the same block."""
    return statistics.median(a / b for a, b in zip(numerators, denominators))


def _measure(cfg: Config, s: Settings, cache_dir: str, rank: int, world: int) -> dict:
    batch = _batch(s, rank, cfg)
    variants = {}
    model, optim = _model_and_optim(cfg, s)
    step = spmd_aot.compile(cfg.step, cache_dir=cache_dir, require_hit=True, **cfg.options, **s.comm)
    variants["loaded"] = lambda: step(model, optim, batch)
    eager, eager_optim = _eager_model(cfg, world, s)
    variants["eager"] = lambda: cfg.step(eager, eager_optim, batch)
    if s.with_compile:
        if cfg.placement in BLOCK_COMPILE:
            compiled_module, compiled_optim = _eager_model(cfg, world, s, compile_blocks=True)
        else:
            compiled_module, compiled_optim = _eager_model(cfg, world, s)
            compiled_module = torch.compile(compiled_module)
        variants["compiled"] = lambda: cfg.step(compiled_module, compiled_optim, batch)
    if s.kernels:
        variants.update(_kernel_variants(cfg, s, cache_dir, world, batch))

    first_s = {}
    for name, fn in variants.items():  # warm up; the first call binds, loads or compiles
        _sync(world)
        start = time.perf_counter()
        fn()
        _sync(world)
        first_s[name] = time.perf_counter() - start
        for _ in range(s.warmup - 1):
            fn()
    last = {}
    times = timed_blocks(variants, s.blocks, s.steps, lambda: _sync(world), last)
    names = list(variants)
    if cfg.axis == "cp":  # each cp rank's loss is its tokens' mean: their mean is the unsplit loss
        last["loaded"] = _mean_over_cp(last["loaded"].detach().clone())
    losses = {name: float(loss.detach().float()) for name, loss in last.items()}
    program = getattr(getattr(step, "_bound", None), "program", None)  # op count, if exposed
    row = dict(world=world, placement=cfg.placement, layers=cfg.layers, d_model=cfg.d_model,
               eager_kind=EAGER_NAME[cfg.placement], ops=getattr(program, "n_ops", None),
               load_s=step.cache_info.seconds, cache_hit=step.cache_info.hit,
               delta_loss=abs(losses["loaded"] - losses["eager"]))
    for name in names:
        row[f"{name}_ms"] = statistics.median(times[name])
        row[f"{name}_blocks_ms"] = times[name]
        if name != "eager":
            row[f"{name}_ratio"] = median_ratio(times[name], times["eager"])
    if s.with_compile:
        row["compile_s"] = first_s["compiled"]
        torch._dynamo.reset()  # the next configuration compiles from scratch
    for name in ("kernels", "whole"):
        if name in first_s:
            row[f"{name}_first_s"] = first_s[name]
            row[f"{name}_delta_loss"] = abs(losses[name] - losses["eager"])
    return row


def _mean_over_cp(loss):
    """The mean over this rank's cp group: consecutive pairs of ranks (cp is the last mesh dim, size 2)."""
    group, _ = torch.distributed.new_subgroups(2)
    torch.distributed.all_reduce(loss, group=group)
    return loss / 2


def _kernel_variants(cfg: Config, s: Settings, cache_dir: str, world: int, batch) -> dict:
    """The entry with compiled kernels, loaded from a trusted cache; at world 1 with
    ``--with-torch-compile`` also torch.compile of the whole step (what aot_compile precompiles)."""
    variants = {}
    model, optim = _model_and_optim(cfg, s)
    step = spmd_aot.compile(train_step, cache_dir=cache_dir, require_hit=True, kernels=True, trust_cache=True,
                            **cfg.options, **s.comm)
    variants["kernels"] = lambda: step(model, optim, batch)
    if s.with_compile and world == 1:
        whole_model, whole_optim = _model_and_optim(cfg, s)
        whole = torch.compile(train_step)
        variants["whole"] = lambda: whole(whole_model, whole_optim, batch)
    return variants


def _rank_main(rank, world, port, configs, s, cache_dir, results):
    torch.set_num_threads(1)
    import torch.distributed as dist
    try:
        if world > 1:
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                    world_size=world)
        rows = []
        for cfg in configs:
            rows.append(_measure(cfg, s, cache_dir, rank, world))
            if rank == 0:
                r = rows[-1]
                print(f"  measured world {world} {cfg.placement} L{cfg.layers} d{cfg.d_model}: loaded "
                      f"{r['loaded_ms']:.1f} ms, {r['eager_kind']} {r['eager_ms']:.1f} ms, "
                      f"ratio {r['loaded_ratio']:.2f}", file=sys.stderr, flush=True)
            gc.collect()
        results.put((rank, "ok", rows if rank == 0 else None))
    except BaseException as exc:  # report, never hang the parent
        results.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        if world > 1 and dist.is_initialized():
            dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def rank_context():
    """How ranks start: spawned, fresh interpreters, so the environment ``run_world`` sets is
    theirs from their first import (the tests' smoke run forks them from a torch-preloaded
    server instead, to start quickly)."""
    return mp.get_context("spawn")


def run_world(world: int, configs: list, s: Settings, cache_dir: str, timeout: float, rank_main=None) -> list:
    """Start ``world`` ranks (one process without a group at world 1); rank 0's result.
    ``rank_main`` (default: this tool's) is called on every rank as ``rank_main(rank, world,
    port, configs, s, cache_dir, results)`` and puts ``(rank, "ok" | "error", value)``."""
    ctx = rank_context()
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=rank_main or _rank_main, args=(r, world, port, configs, s, cache_dir, results))
             for r in range(world)]
    # A fresh inductor cache per world: "compile s" is a cold first step, not a disk-cache hit.
    child_env = dict(OMP_NUM_THREADS="1", TORCHINDUCTOR_COMPILE_THREADS="1", PYTHONWARNINGS=QUIET,
                     TORCHINDUCTOR_CACHE_DIR=os.path.join(cache_dir, f"inductor-world{world}"))
    saved = {k: os.environ.get(k) for k in child_env}
    os.environ.update(child_env)
    try:
        for p in procs:
            p.start()
        got = {}
        deadline = time.monotonic() + timeout
        while len(got) < world:
            try:
                rank, status, value = results.get(timeout=max(1.0, deadline - time.monotonic()))
            except queue_mod.Empty:
                raise RuntimeError(f"world {world}: ranks did not finish in {timeout:.0f}s "
                                   f"(finished: {sorted(got)})") from None
            got[rank] = (status, value)
            if status != "ok":
                break  # the others may wait on the failed rank forever
    finally:
        for p in procs:
            p.join(timeout=5 if len(got) == world else 0.1)
            if p.is_alive():
                p.kill()
                p.join()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    errors = [f"rank {r}: {v}" for r, (status, v) in sorted(got.items()) if status != "ok"]
    if errors:
        raise RuntimeError(f"world {world} failed:\n" + "\n".join(errors))
    return got[0][1]


# ---------------------------------------------------------------------------- report
def _target(world: int) -> float:
    return TARGET.get(world, 0.90)


def table(rows: list[dict], with_compile: bool) -> str:
    header = ["world", "placement", "layers", "d_model", "ops", "loaded ms", "eager", "eager ms",
              "loaded/eager", "target", "Δloss"]
    if with_compile:
        header += ["compiled ms", "compiled/eager", "compile s"]
    kernels = any("kernels_ms" in r for r in rows)
    if kernels:
        header += ["kernels ms", "kernels/eager", "kernels/compiled", "kernels first s", "Δloss k", "whole-step ms",
                   "kernels/whole"]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    for r in rows:
        ok = "yes" if r["loaded_ratio"] <= _target(r["world"]) else "no"
        # the targets are set for the data-parallel rows; cp and ep have none
        target = "-" if r["placement"] in AXIS_PLACEMENTS else f"<={_target(r['world']):.2f} {ok}"
        cells = [r["world"], r["placement"], r["layers"], r["d_model"], r["ops"] if r["ops"] is not None else "-",
                 f"{r['loaded_ms']:.2f}", r["eager_kind"], f"{r['eager_ms']:.2f}", f"{r['loaded_ratio']:.3f}",
                 target, f"{r['delta_loss']:.0e}"]
        if with_compile:
            cells += [f"{r['compiled_ms']:.2f}", f"{r['compiled_ratio']:.3f}", f"{r['compile_s']:.1f}"]
        if kernels:
            cells += _kernel_cells(r)
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def _kernel_cells(r: dict) -> list[str]:
    """Kernels vs eager, vs torch.compile (same blocks: the ratio of the two median ratios' blocks)
    and, at world 1, vs torch.compile of the whole step."""
    if "kernels_ms" not in r:
        return ["-"] * 7
    def vs(name):
        if f"{name}_blocks_ms" not in r:
            return "-"
        return f"{median_ratio(r['kernels_blocks_ms'], r[f'{name}_blocks_ms']):.3f}"
    whole = f"{r['whole_ms']:.2f}" if "whole_ms" in r else "-"
    return [f"{r['kernels_ms']:.2f}", f"{r['kernels_ratio']:.3f}", vs("compiled"), f"{r['kernels_first_s']:.2f}",
            f"{r['kernels_delta_loss']:.0e}", whole, vs("whole")]


def plot(path: str, rows: list[dict], with_compile: bool, title: str) -> None:
    labels = [Config(r["world"], r["placement"], r["layers"], r["d_model"]).label for r in rows]
    series = {"loaded": [r["loaded_ms"] for r in rows], "eager (DDP / FSDP2)": [r["eager_ms"] for r in rows]}
    if with_compile:
        series["torch.compile"] = [r["compiled_ms"] for r in rows]
    if any("kernels_ms" in r for r in rows):
        series["kernels"] = [r.get("kernels_ms", 0.0) for r in rows]
    write_svg(path, labels, series, title, notes=[f"{r['loaded_ratio']:.2f}x" for r in rows])


# ---------------------------------------------------------------------------- command line
def _parse_comm(items: list[str]) -> dict:
    comm = {}
    for item in items:
        key, _, value = item.partition("=")
        try:
            comm[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            comm[key] = value
    return comm


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def configs_for(worlds, placements, layer_list, d_model_list) -> list[Config]:
    configs = []
    for world in worlds:
        for layers in layer_list:
            for d_model in d_model_list:
                if world == 1:
                    configs.append(Config(1, "single", layers, d_model))
                    continue
                for placement in placements:
                    if placement in ("hsdp", *TP_MESH) and world != 4:
                        continue  # HSDP and DP x TP are measured on a 2x2 mesh
                    configs.append(Config(world, placement, layers, d_model))
    return configs


def axis_configs(worlds, context: bool, expert: bool, layer_list, d_model_list) -> list[Config]:
    """Context parallel at world 2 (cp 2) and 4 (dp_shard 2 x cp 2); expert parallel at world 4
    (dp_shard 2 x ep 2)."""
    wanted = ([(2, "cp"), (4, "shard x cp")] if context else []) + ([(4, "shard x ep")] if expert else [])
    return [Config(world, placement, layers, d_model) for world in worlds for layers in layer_list
            for d_model in d_model_list for w, placement in wanted if w == world]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=_ints, help="comma-separated (default 4; --sweep: 2,12)")
    parser.add_argument("--d-model", type=_ints, help="comma-separated (default 128; --sweep: 64,256)")
    parser.add_argument("--seq", type=int, help="context length (default 64)")
    parser.add_argument("--batch", type=int, help="sequences per rank (default 8)")
    parser.add_argument("--steps", type=int, help="steps per timed block (default 10; --sweep 4)")
    parser.add_argument("--blocks", type=int, help="timed blocks per variant (default 5; --sweep 3)")
    parser.add_argument("--warmup", type=int, help="warm-up steps per variant (default 3)")
    parser.add_argument("--worlds", type=_ints, default=[1, 2, 4])
    parser.add_argument("--placements", default=None,
                        help="comma-separated of replicate, shard, hsdp, 'shard x tp', 'replicate x tp' (default "
                             "the first three; --sweep: replicate,shard); world 1 runs once, plain; hsdp and the x tp "
                             "only at world 4 (2x2)")
    parser.add_argument("--with-torch-compile", action="store_true", help="also time torch.compile(eager model)")
    parser.add_argument("--sweep", action="store_true", help="layers {2,12} x d_model {64,256}: the target range")
    parser.add_argument("--quick", action="store_true", help="tiny model, few steps: a smoke run")
    parser.add_argument("--comm", action="append", default=[], metavar="KEY=VALUE",
                        help="communication option passed to build and compile, e.g. bucket_cap_mb=4")
    parser.add_argument("--plot", default=os.path.join(tempfile.gettempdir(), "bench_step.svg"),
                        help="SVG file for the bar chart (default: %(default)s)")
    parser.add_argument("--json", help="also write the rows to this JSON file")
    parser.add_argument("--fused-adamw", action="store_true",
                        help="every variant's AdamW with fused=True, so the ratio does not count the loaded "
                             "step's own choice of the fused kernel (torch's default on CPU is the per-tensor loop)")
    parser.add_argument("--kernels", action="store_true",
                        help="also build with kernels=True and time the compiled-kernels step (trusted cache)")
    parser.add_argument("--context-parallel", action="store_true",
                        help="instead: context parallel on a causal SDPA model, world 2 (cp 2) and 4 (dp_shard 2 x "
                             "cp 2), against eager on the unsplit sequence over the data-parallel ranks")
    parser.add_argument("--expert-parallel", action="store_true",
                        help="instead: expert parallel on a MoE, world 4 (dp_shard 2 x ep 2), against eager FSDP2 "
                             "of the unsplit model")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per world before giving up")
    args = parser.parse_args(argv)

    mode = "quick" if args.quick else "sweep" if args.sweep else "default"
    defaults = {
        "default": dict(layers=[4], d_model=[128], seq=64, batch=8, steps=10, blocks=5, warmup=3,
                        placements="replicate,shard,hsdp"),
        "sweep": dict(layers=[2, 12], d_model=[64, 256], seq=64, batch=8, steps=4, blocks=3, warmup=2,
                      placements="replicate,shard"),
        "quick": dict(layers=[2], d_model=[32], seq=16, batch=2, steps=2, blocks=2, warmup=1,
                      placements="replicate,shard,hsdp"),
    }[mode]
    def pick(name):
        return getattr(args, name) if getattr(args, name) is not None else defaults[name]

    placements = [p for p in pick("placements").split(",") if p]
    unknown = set(placements) - {"replicate", "shard", "hsdp", *TP_MESH}
    if unknown:
        parser.error(f"unknown placement(s) {sorted(unknown)}; expected replicate, shard, hsdp, "
                     "'shard x tp', 'replicate x tp'")
    s = Settings(seq=pick("seq"), batch=pick("batch"), steps=pick("steps"), blocks=pick("blocks"),
                 warmup=max(1, pick("warmup")), with_compile=args.with_torch_compile,
                 comm=_parse_comm(args.comm), fused_adamw=args.fused_adamw, kernels=args.kernels)
    axes = args.context_parallel or args.expert_parallel
    if axes and args.kernels:
        parser.error("--kernels measures the data-parallel rows only; drop it with --context-parallel/--expert-parallel")
    if args.context_parallel and pick("seq") % 4:
        parser.error(f"--context-parallel splits the sequence into 4 chunks (2 per cp rank): --seq {pick('seq')} "
                     "does not divide by 4")
    if axes:
        configs = axis_configs(args.worlds, args.context_parallel, args.expert_parallel, pick("layers"),
                               pick("d_model"))
    else:
        configs = configs_for(args.worlds, placements, pick("layers"), pick("d_model"))

    command = "python tools/bench/bench_step.py " + " ".join(map(shlex.quote, sys.argv[1:] if argv is None else argv))
    print(f"# {command.strip()}")
    print(f"# torch {torch.__version__}, CPU, gloo, {os.cpu_count()} cores, 1 thread per rank; "
          f"AdamW{' fused=True' if s.fused_adamw else ' (defaults)'}, vocab {VOCAB}, {HEADS} heads, "
          f"context {s.seq}, batch {s.batch} per rank; "
          f"{s.blocks} blocks x {s.steps} steps after {s.warmup} warm-up" +
          (f"; comm {s.comm}" if s.comm else ""), flush=True)
    if args.context_parallel:
        print("# context parallel: causal SDPA model with RoPE, batch per data-parallel share (the cp ranks of a "
              "share pass the same one); torch's own context_parallel does not run on CPU/gloo, so eager is the "
              "unsplit sequence (plain, or fully_shard over dp_shard), run by each cp rank; Δloss: the cp ranks' "
              "mean loss", flush=True)
    if s.with_compile and any(c.placement in BLOCK_COMPILE for c in configs):
        print(f"# torch.compile of {', '.join(sorted(BLOCK_COMPILE))}: each block compiled (torch 2.13 cannot "
              "compile DDP over TP's localized parameters whole)", flush=True)
    if args.expert_parallel:
        print(f"# expert parallel: MoE with {EXPERTS} experts, top {TOP_K}, a shared expert per block; eager is "
              "fully_shard of the unsplit model over every rank", flush=True)
    rows, failures = [], []
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench_step_cache_") as cache_dir:
        for world in args.worlds:
            world_configs = [c for c in configs if c.world == world]
            if not world_configs:
                continue
            try:
                for cfg in world_configs:
                    seconds = build(cfg, s, cache_dir)
                    print(f"  built world {world} {cfg.placement} L{cfg.layers} d{cfg.d_model} "
                          f"in {seconds:.1f}s", file=sys.stderr, flush=True)
                rows += run_world(world, world_configs, s, cache_dir, args.timeout)
            except Exception as exc:  # report it, measure the other worlds
                failures.append(f"world {world}: {exc}")
                print(f"error: world {world}: {exc}", file=sys.stderr, flush=True)
    if rows:
        print(table(rows, s.with_compile))
        plot(args.plot, rows, s.with_compile,
             f"ms/step, loaded vs eager (label: loaded/eager); context {s.seq}, batch {s.batch}/rank")
        print(f"# plot: {args.plot}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(dict(command=command.strip(), settings=dataclasses.asdict(s), rows=rows), f, indent=1)
            print(f"# rows: {args.json}")
    print(f"# {time.perf_counter() - start:.0f}s in all", flush=True)
    return 1 if failures or not rows else 0


if __name__ == "__main__":
    sys.exit(main())

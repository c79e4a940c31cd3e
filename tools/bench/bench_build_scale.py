"""Build time and peak RSS of an 80-layer Llama-70B-shaped AdamW step for a large world.

Everything is fake (parameters under FakeTensorMode, a fake process group), so this runs on
a CPU box: it measures what ``spmd-aot build`` costs for a 70B job, not the job itself.
Defaults: d_model 8192, 64 heads (8 key/value heads), FFN 28672, vocabulary 128256, 80
layers, sequence 4096, world 1024 under ``shard`` (default groups: one per layer).

``--layers 8,16,32,80`` builds each depth in a fresh process and prints how build time grows
with depth (the ratio of the deepest to the shallowest). ``--stages`` prints the CPU seconds of
each build stage (trace, passes, code generation, load check, encoding). ``--without-recorder``
builds without the source recorder that finds which files the trace ran (``keying/guards.py``):
it measures that recorder's share only; the entry it stores, in a temporary cache, guards
nothing.

``--shape 8b|70b|405b`` builds a Llama-3 shape instead (``llama3_shapes.py``: SDPA attention,
sequence 8192 unless ``--seq``), with ``--param-dtype bf16``, ``--checkpoint`` (every block),
``--mesh-shape RxS[xT]`` and ``--tp`` (torchtitan's TP plan on the last mesh dimension), and prints
``spmd-aot plan``'s per-rank estimate for the same configuration beside the build's.
``--full-trace`` traces every block instead of stamping the stack from three (the baseline).

    PYTHONPATH=. python tools/bench/bench_build_scale.py [--layers 80] [--world 1024] [--placement shard]
        [--stages] [--without-recorder]
    PYTHONPATH=. python tools/bench/bench_build_scale.py --shape 70b --world 1024 --param-dtype bf16 --checkpoint
    PYTHONPATH=. python tools/bench/bench_build_scale.py --shape 405b --layers 126 --world 2048 \
        --mesh-shape 256x8 --tp --param-dtype bf16 --checkpoint
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import json
import math
import os
import subprocess
import resource
import sys
import tempfile
import time

import torch
import torch.nn.functional as F
from torch import nn

import spmd_aot
from spmd_aot.examples.models import train_step


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Attention(nn.Module):
    def __init__(self, d: int, heads: int, kv_heads: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, d // heads
        self.wq = nn.Linear(d, d, bias=False)
        self.wk = nn.Linear(d, kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(d, kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(d, d, bias=False)

    def forward(self, x):
        b, t, d = x.shape
        q = self.wq(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        repeat = self.heads // self.kv_heads
        k = k.repeat_interleave(repeat, dim=1)
        v = v.repeat_interleave(repeat, dim=1)
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        out = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1) @ v
        return self.wo(out.transpose(1, 2).reshape(b, t, d))


class Layer(nn.Module):
    def __init__(self, d: int, heads: int, kv_heads: int, ffn: int):
        super().__init__()
        self.attn_norm = RMSNorm(d)
        self.attn = Attention(d, heads, kv_heads)
        self.ffn_norm = RMSNorm(d)
        self.w1 = nn.Linear(d, ffn, bias=False)
        self.w2 = nn.Linear(ffn, d, bias=False)
        self.w3 = nn.Linear(d, ffn, bias=False)

    def forward(self, x):
        x = x + self.attn(self.attn_norm(x))
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class Llama(nn.Module):
    def __init__(self, vocab=128256, d=8192, layers=80, heads=64, kv_heads=8, ffn=28672):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(Layer(d, heads, kv_heads, ffn) for _ in range(layers))
        self.norm = RMSNorm(d)
        self.out = nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        x = self.tok(idx)
        for layer in self.layers:
            x = layer(x)
        return self.out(self.norm(x))


step = train_step  # the canonical step: forward, cross-entropy, backward, AdamW, zero grads


# (module, attribute, stage): the functions whose CPU seconds --stages reports
_STAGES = [
    ("spmd_aot.building.pipeline", "trace_step", "trace (make_fx: forward, backward, optimizer; expansion)"),
    ("spmd_aot.building.pipeline", "strip_profiler_ops", "passes"),
    ("spmd_aot.building.pipeline", "remove_detach", "passes"),
    ("spmd_aot.building.pipeline", "dedupe_collectives", "passes"),
    ("spmd_aot.building.pipeline", "prefetch_groups", "passes"),
    ("spmd_aot.building.pipeline", "rewrite_inplace_views", "passes"),
    ("spmd_aot.building.pipeline", "sink_waits", "passes"),
    ("spmd_aot.building.pipeline", "fold_views", "passes"),
    ("spmd_aot.building.pipeline", "graph_peak_bytes", "statistics (peak bytes, collectives)"),
    ("spmd_aot.building.pipeline", "collective_stats", "statistics (peak bytes, collectives)"),
    ("spmd_aot.building.pipeline", "layout_entries", "encoding (layout, graph, manifest)"),
    ("spmd_aot.building.pipeline", "encode_artifact", "encoding (layout, graph, manifest)"),
    ("spmd_aot.building.pipeline", "check_before_storing", "load check of the new entry"),
    ("spmd_aot.building.pipeline", "store_artifact", "store"),
    ("spmd_aot.building.builder", "_fake_state", "fake model, optimizer and batch"),
    ("spmd_aot.building.builder", "compute_key", "key"),
]


@contextlib.contextmanager
def _stage_clock():
    """CPU seconds (``process_time``: what a loaded machine does not inflate) per build stage,
    by wrapping the stage functions where the build looks them up; ``recompile`` (FX code
    generation) is counted apart and left out of the stage that calls it."""
    import importlib

    import torch.fx

    seconds: dict[str, float] = collections.defaultdict(float)
    inner = [0.0]  # recompile seconds inside the stage running now

    def timed(fn, stage):
        @functools.wraps(fn)
        def run(*args, **kwargs):
            start, before = time.process_time(), inner[0]
            try:
                return fn(*args, **kwargs)
            finally:
                seconds[stage] += time.process_time() - start - (inner[0] - before)
        return run

    recompile = torch.fx.GraphModule.recompile

    def recompile_timed(self, *args, **kwargs):
        start = time.process_time()
        try:
            return recompile(self, *args, **kwargs)
        finally:
            spent = time.process_time() - start
            seconds["FX code generation (recompile)"] += spent
            inner[0] += spent

    originals = []
    for module_name, name, stage in _STAGES:
        module = importlib.import_module(module_name)
        originals.append((module, name, getattr(module, name)))
        setattr(module, name, timed(getattr(module, name), stage))
    torch.fx.GraphModule.recompile = recompile_timed
    try:
        yield seconds
    finally:
        torch.fx.GraphModule.recompile = recompile
        for module, name, fn in originals:
            setattr(module, name, fn)


@contextlib.contextmanager
def _without_recorder():
    from spmd_aot.keying import guards

    @contextlib.contextmanager
    def nothing_recorded():
        yield set()

    original = guards.recording_sources
    guards.recording_sources = nothing_recorded
    try:
        yield
    finally:
        guards.recording_sources = original


@contextlib.contextmanager
def _full_trace():
    """No stack counts as deep enough to stamp: every block is traced, as before stamping."""
    from spmd_aot.tracing import repeated

    original = repeated.MIN_BLOCKS
    repeated.MIN_BLOCKS = sys.maxsize
    try:
        yield
    finally:
        repeated.MIN_BLOCKS = original


def _shape_job(args, layers: int):
    """A Llama-3 shape (``--shape``), its build options and the plan's estimate of them (GiB per rank)."""
    import llama3_shapes
    from spmd_aot.planning.candidates import plan_fit
    from spmd_aot.planning.memory_model import Candidate

    seq = args.seq or llama3_shapes.SEQ
    job = llama3_shapes.job(args.shape, layers=layers, seq=seq, checkpoint=args.checkpoint)
    mesh = tuple(int(x) for x in args.mesh_shape.split("x")) if args.mesh_shape else None
    tp = mesh[-1] if args.tp and mesh else (args.world if args.tp else 1)
    dp = mesh[:-1] if args.tp and mesh else (mesh or (args.world // tp,))
    dtype = torch.bfloat16 if args.param_dtype == "bf16" else None
    options = {"placement": args.placement, "param_dtype": dtype, "mesh_shape": mesh,
               "tp_plan": llama3_shapes.TP_PLAN if args.tp else ()}
    replicas, shards = (dp[0], dp[-1]) if len(dp) == 2 else \
        ((dp[0], 1) if args.placement == "replicate" else (1, dp[0]))
    plain = llama3_shapes.job(args.shape, layers=layers, seq=seq)  # the plan checkpoints its 'ac' rows itself
    estimate = plan_fit(plain, [Candidate(args.placement, replicas, shards, tp, args.checkpoint, dtype)],
                        options["tp_plan"]).estimates[0]
    return job, {k: v for k, v in options.items() if v not in (None, ())}, estimate.peak_bytes / 2**30


def _build_once(args, layers: int) -> dict:
    vocab = 128256
    plan_gib, options = None, {"placement": args.placement}
    if args.shape:
        job, options, plan_gib = _shape_job(args, layers)
    else:
        seq = args.seq or 4096
        job = spmd_aot.Job(
            step=step, model=lambda: Llama(layers=layers),
            optimizer=lambda m: torch.optim.AdamW(m.parameters(), lr=1e-4),
            batch=lambda: (torch.randint(0, vocab, (1, seq)), torch.randint(0, vocab, (1, seq))))
    with tempfile.TemporaryDirectory() as cache, \
            (_stage_clock() if args.stages else contextlib.nullcontext({})) as stages, \
            (_without_recorder() if args.without_recorder else contextlib.nullcontext()), \
            (_full_trace() if args.full_trace else contextlib.nullcontext()):
        start, cpu = time.perf_counter(), time.process_time()
        built = spmd_aot.build(job, world_size=args.world, cache_dir=cache, **options)
        seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    return {"layers": layers, "seconds": seconds, "cpu": cpu,
            "rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,  # KiB on Linux
            "nodes": built.stats["nodes"], "by_kind": built.stats["by_kind"],
            "peak_gib": built.stats.get("peak_bytes", 0) / 2**30, "plan_gib": plan_gib, "stages": dict(stages),
            "blocks": built.stats.get("blocks")}


def _report(args, r: dict) -> None:
    print(f"{r['layers']} layers, world {args.world}, {args.placement}: built in {r['seconds']:.1f} s "
          f"({r['cpu']:.1f} CPU-seconds: on a shared machine this is the figure to compare), "
          f"peak RSS {r['rss_gb']:.2f} GB, {r['nodes']} nodes, collectives {r['by_kind']}, "
          f"estimated peak live tensors {r['peak_gib']:.2f} GiB per rank"
          + (f"; spmd-aot plan's estimate {r['plan_gib']:.2f} GiB" if r.get("plan_gib") is not None else "")
          + (" [without the source recorder]" if args.without_recorder else "")
          + (" [every block traced]" if args.full_trace else ""))
    if r.get("blocks"):  # a stack of identical blocks: stamped from three and four, or why it was traced whole
        print(f"    blocks: {r['blocks']}")
    stages = dict(r["stages"])
    if stages:  # the rest: imports and torch's first-use set-up inside build, the entry read back
        stages["other (first-use imports and set-up, reading the entry back)"] = r["cpu"] - sum(stages.values())
    for stage, spent in sorted(stages.items(), key=lambda kv: -kv[1]):
        print(f"    {spent:7.2f} CPU-s  {100 * spent / max(r['cpu'], 1e-9):5.1f}%  {stage}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", default="80", help="a depth, or depths separated by commas (8,16,32,80)")
    parser.add_argument("--world", type=int, default=1024)
    parser.add_argument("--placement", default="shard")
    parser.add_argument("--seq", type=int, default=None, help="tokens per rank (default 4096; 8192 with --shape)")
    parser.add_argument("--shape", choices=("8b", "70b", "405b"), help="a Llama-3 shape (llama3_shapes.py)")
    parser.add_argument("--mesh-shape", help="with --shape: the mesh, e.g. 16x64 or 128x8 with --tp")
    parser.add_argument("--tp", action="store_true", help="with --shape: TP over the last mesh dimension")
    parser.add_argument("--param-dtype", choices=("bf16",), help="with --shape: bf16 compute, fp32 master weights")
    parser.add_argument("--checkpoint", action="store_true", help="with --shape: checkpoint every block")
    parser.add_argument("--stages", action="store_true", help="CPU seconds per build stage")
    parser.add_argument("--without-recorder", action="store_true",
                        help="build without the source recorder (measures its share; the entry guards nothing)")
    parser.add_argument("--full-trace", action="store_true",
                        help="trace every block, as before stacks were stamped (the baseline to compare)")
    parser.add_argument("--json", action="store_true", help=argparse.SUPPRESS)  # one depth, for the parent
    args = parser.parse_args(argv)
    depths = [int(d) for d in args.layers.split(",")]
    if len(depths) == 1:
        result = _build_once(args, depths[0])
        if args.json:
            print(json.dumps(result))
        else:
            _report(args, result)
        return 0
    results = []
    for layers in depths:  # each in a fresh process, as `spmd-aot build` runs: no warm caches, own RSS
        command = [sys.executable, __file__, "--layers", str(layers), "--world", str(args.world),
                   "--placement", args.placement, "--json"] + (["--seq", str(args.seq)] if args.seq else [])
        for flag in ("shape", "mesh_shape", "param_dtype"):
            command += [f"--{flag.replace('_', '-')}", getattr(args, flag)] if getattr(args, flag) else []
        command += ["--tp"] * args.tp + ["--checkpoint"] * args.checkpoint
        command += ["--stages"] * args.stages + ["--without-recorder"] * args.without_recorder
        command += ["--full-trace"] * args.full_trace
        done = subprocess.run(command, capture_output=True, text=True, env=dict(os.environ))
        if done.returncode:
            sys.stderr.write(done.stderr)
            return done.returncode
        results.append(json.loads(done.stdout.strip().splitlines()[-1]))
        _report(args, results[-1])
    low, high = min(results, key=lambda r: r["layers"]), max(results, key=lambda r: r["layers"])
    print(f"{high['layers']} layers / {low['layers']} layers: {high['cpu'] / low['cpu']:.2f}x CPU-seconds, "
          f"{high['seconds'] / low['seconds']:.2f}x seconds ({high['layers'] / low['layers']:.0f}x the layers)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

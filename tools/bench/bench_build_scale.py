"""Build time and peak RSS of an 80-layer Llama-70B-shaped AdamW step for a large world.

Everything is fake (parameters under FakeTensorMode, a fake process group), so this runs on
a CPU box: it measures what ``spmd-aot build`` costs for a 70B job, not the job itself.
Defaults: d_model 8192, 64 heads (8 key/value heads), FFN 28672, vocabulary 128256, 80
layers, sequence 4096, world 1024 under ``shard`` (default groups: one per layer).

    PYTHONPATH=. python tools/bench/bench_build_scale.py [--layers 80] [--world 1024] [--placement shard]
"""

from __future__ import annotations

import argparse
import math
import resource
import sys
import tempfile
import time

import torch
import torch.nn.functional as F
from torch import nn

import spmd_aot


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


def step(model, optim, batch):
    x, y = batch
    logits = model(x)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=80)
    parser.add_argument("--world", type=int, default=1024)
    parser.add_argument("--placement", default="shard")
    parser.add_argument("--seq", type=int, default=4096)
    args = parser.parse_args(argv)
    vocab = 128256
    job = spmd_aot.Job(
        step=step, model=lambda: Llama(layers=args.layers),
        optimizer=lambda m: torch.optim.AdamW(m.parameters(), lr=1e-4),
        batch=lambda: (torch.randint(0, vocab, (1, args.seq)), torch.randint(0, vocab, (1, args.seq))))
    with tempfile.TemporaryDirectory() as cache:
        start, cpu = time.perf_counter(), time.process_time()
        built = spmd_aot.build(job, world_size=args.world, placement=args.placement, cache_dir=cache)
        seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    rss_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
    print(f"{args.layers} layers, world {args.world}, {args.placement}: built in {seconds:.1f} s "
          f"({cpu:.1f} CPU-seconds: on a shared machine this is the figure to compare), "
          f"peak RSS {rss_gb:.2f} GB, {built.stats['nodes']} nodes, collectives {built.stats['by_kind']}, "
          f"estimated peak live tensors {built.stats.get('peak_bytes', 0) / 2**30:.2f} GiB per rank")
    return 0


if __name__ == "__main__":
    sys.exit(main())

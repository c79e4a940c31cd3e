"""Llama-3-shaped jobs (8B, 70B, 405B) for ``spmd-aot plan`` and the build-scale bench.

The published shapes (vocabulary 128256, grouped-query attention with 8 key/value heads, SwiGLU
FFN), SDPA attention (no T x T scores are kept), RMSNorm, untied output head, AdamW over fp32
master weights, one sequence of 8192 tokens per rank. Rotary embeddings are left out (a few
elementwise ops per block; they change no parameter and little memory). ``TP_PLAN`` is
torchtitan's: q/k/v and the FFN's w1/w3 column-wise, the attention output and w2 row-wise.

    spmd-aot plan tools/bench/llama3_shapes.py:llama3_70b -w 1024 --gpu-memory 80GiB \\
        --tp-plan 'layers.*.attn.w?=colwise' ... (every TP_PLAN entry; docs/plan.md)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import spmd_aot

VOCAB, SEQ = 128256, 8192
SHAPES = {  # d_model, layers, heads, key/value heads, FFN hidden
    "8b": (4096, 32, 32, 8, 14336),
    "70b": (8192, 80, 64, 8, 28672),
    "405b": (16384, 126, 128, 8, 53248),
}
TP_PLAN = (("layers.*.attn.wq", "colwise"), ("layers.*.attn.wk", "colwise"), ("layers.*.attn.wv", "colwise"),
           ("layers.*.attn.wo", "rowwise"), ("layers.*.ffn.w1", "colwise"), ("layers.*.ffn.w3", "colwise"),
           ("layers.*.ffn.w2", "rowwise"))


class Attention(nn.Module):
    def __init__(self, d: int, heads: int, kv_heads: int):
        super().__init__()
        self.head_dim = d // heads
        self.wq = nn.Linear(d, d, bias=False)
        self.wk = nn.Linear(d, kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(d, kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(d, d, bias=False)

    def forward(self, x):
        b, t, _ = x.shape  # -1 heads: the local count under tensor parallelism
        q, k, v = (w(x).view(b, t, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.w1, self.w3 = nn.Linear(d, hidden, bias=False), nn.Linear(d, hidden, bias=False)
        self.w2 = nn.Linear(hidden, d, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Layer(nn.Module):
    def __init__(self, d: int, heads: int, kv_heads: int, hidden: int):
        super().__init__()
        self.attn_norm, self.ffn_norm = nn.RMSNorm(d, eps=1e-5), nn.RMSNorm(d, eps=1e-5)
        self.attn, self.ffn = Attention(d, heads, kv_heads), FeedForward(d, hidden)

    def forward(self, x):
        x = x + self.attn(self.attn_norm(x))
        return x + self.ffn(self.ffn_norm(x))


class Llama3(nn.Module):
    def __init__(self, d: int, layers: int, heads: int, kv_heads: int, hidden: int, vocab: int = VOCAB):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(Layer(d, heads, kv_heads, hidden) for _ in range(layers))
        self.norm = nn.RMSNorm(d, eps=1e-5)
        self.out = nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        x = self.tok(idx)
        for layer in self.layers:
            x = layer(x)
        return self.out(self.norm(x))


def step(model, optim, batch):
    x, y = batch
    logits = model(x)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def job(size: str, *, layers: int | None = None, seq: int = SEQ, checkpoint: bool = False) -> spmd_aot.Job:
    """The ``size`` shape (``SHAPES``), ``layers`` blocks instead of its own; ``checkpoint``: every
    block under non-reentrant ``torch.utils.checkpoint`` (what the plan's 'ac' rows assume)."""
    d, n, heads, kv, hidden = SHAPES[size]

    def model():
        m = Llama3(d, layers or n, heads, kv, hidden)
        if checkpoint:
            from spmd_aot.planning.footprint import checkpoint_blocks

            checkpoint_blocks(m)
        return m

    return spmd_aot.Job(
        step=step, model=model,
        optimizer=lambda m: torch.optim.AdamW(m.parameters(), lr=1e-4),
        batch=lambda: (torch.randint(0, VOCAB, (1, seq)), torch.randint(0, VOCAB, (1, seq))))


def llama3_8b():
    return job("8b")


def llama3_70b():
    return job("70b")


def llama3_405b():
    return job("405b")

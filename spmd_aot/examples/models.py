"""Small models for examples and tests: an MLP and a GPT-style transformer.

Attention is written with plain ops (matmul, masked softmax): it traces in well under a second
per layer, where ``nn.MultiheadAttention`` under make_fx took minutes on a 2-layer model.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["MLP", "Transformer", "StackedExperts", "train_step"]


class MLP(nn.Module):
    def __init__(self, d_in: int = 32, d_hidden: int = 64, n_classes: int = 10):
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_hidden)
        self.fc2 = nn.Linear(d_hidden, d_hidden)
        self.head = nn.Linear(d_hidden, n_classes)

    def forward(self, x):
        return self.head(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


class Attention(nn.Module):
    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        self.n_heads = n_heads
        # No qkv bias (as in GPT-NeoX/LLaMA): the key bias has an exactly-zero gradient (softmax
        # is shift invariant), so Adam would amplify rounding noise in it to lr-sized updates.
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        heads = lambda z: z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2)  # noqa: E731
        q, k, v = heads(q), heads(k), heads(v)
        scores = q @ k.transpose(-2, -1) / math.sqrt(d // self.n_heads)
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        out = torch.softmax(scores, dim=-1) @ v
        return self.proj(out.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = Attention(d_model, n_heads)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Transformer(nn.Module):
    """Token + position embeddings, pre-norm blocks, final norm, vocabulary head."""

    def __init__(self, vocab: int = 64, d_model: int = 32, n_heads: int = 4, n_layers: int = 2,
                 max_len: int = 16):
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(max_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_heads) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab)

    def forward(self, idx):
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def train_step(model, optim, batch):
    """The canonical step: forward, cross-entropy, backward, optimizer step, zero grads."""
    x, y = batch
    logits = model(x)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


class StackedExperts(nn.Module):
    """A mixture-of-experts expert module in the form expert parallel splits (``num_experts``,
    parameters stacked per expert, ``forward(hidden [T, D], top_k_index [T, k], top_k_weights
    [T, k])``, as transformers' MoE experts), with static shapes: every expert over every row,
    weighted by its share of each row's routing weights."""

    def __init__(self, experts: int, d: int, hidden: int):
        super().__init__()
        self.num_experts = experts
        self.w_in = nn.Parameter(torch.randn(experts, hidden, d) * d ** -0.5)
        self.w_out = nn.Parameter(torch.randn(experts, d, hidden) * hidden ** -0.5)

    def forward(self, x, top_k_index, top_k_weights):
        out = torch.zeros_like(x)
        for e in range(self.num_experts):
            weight = (top_k_weights * (top_k_index == e)).sum(-1, keepdim=True)
            out = out + F.linear(F.silu(F.linear(x, self.w_in[e])), self.w_out[e]) * weight
        return out

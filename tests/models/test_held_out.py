"""Constructs of real models outside the corpus, each written small, built with the stock
package and run on 2 gloo ranks against eager PyTorch (DDP, ``fully_shard``):

* recurrent layers (``nn.LSTM``, ``nn.GRU``): traced as torch's native cells, not oneDNN's
  ``mkldnn_rnn_layer``, with ``unsafe_split`` as copies (``tracing/rnn.py``); sharded;
* a depthwise convolution over a sequence viewed as an image (``transpose(1, 2).view(...)``,
  Segformer's Mix-FFN): oneDNN returns it channels-last, and the sequence view of its output
  that the graph records only fits those strides (``format/device_results.py``);
* an in-place ``scatter_`` of a routing mask (DeepSeek-V3's group-limited top-k), ``bucketize``d
  positions, a parameter table resized with ``interpolate(size=..., mode="bilinear")`` (BEiT's
  relative position bias), a scan written step by step into a transposed buffer (RecurrentGemma:
  its backward copies with ``new_empty_strided``), a weight-normed convolution (Wav2Vec2's
  positional convolution: ``_weight_norm_interface``) and SigLIP's pairwise loss (``torch.eye``
  labels, ``F.logsigmoid``); replicated.

A position index memoized in a ``functools.lru_cache`` shared by every instance (BEiT's relative
position index): a second build in the same process must not get the first trace's fake tensor.

And transformers' CTC heads, refused at build naming the fix (CTC's kernel indexes with label
values it does not bound, so no load admits it).

Tolerance: the README's, 1e-5 after 5 AdamW steps.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import spmd_aot
from spmd_aot.errors import UnsupportedError
from support.multiproc import run_ranks

V, D, T, B, E = 32, 16, 8, 4, 4
STEPS, TOL = 5, 1e-5


class Recurrent(nn.Module):
    """Tokens through a 2-layer LSTM and a GRU."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.lstm = nn.LSTM(D, D, num_layers=2, batch_first=True)
        self.gru = nn.GRU(D, D, batch_first=True)
        self.head = nn.Linear(D, V)

    def forward(self, x):
        h, _ = self.lstm(self.emb(x))
        h, _ = self.gru(h)
        return self.head(h)


class HeldOut(nn.Module):
    """The replicated constructs of the module docstring, one after the other."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.buckets = nn.Embedding(4, D)
        self.register_buffer("bounds", torch.tensor([2.0, 4.0, 6.0]), persistent=False)
        self.fc1, self.dw, self.fc2 = nn.Linear(D, D), nn.Conv2d(D, D, 3, padding=1, groups=D), nn.Linear(D, D)
        self.table = nn.Parameter(torch.randn(1, 1, 3, 3) * 0.1)  # a relative bias, resized to T x T
        self.qkv = nn.Linear(D, 3 * D)
        self.gate, self.experts = nn.Linear(D, E), nn.Parameter(torch.randn(E, D) * 0.1)
        self.decay = nn.Parameter(torch.full((D,), 0.5))
        # Wav2Vec2's positional convolution: weight norm over the last dim (``_weight_norm_interface``)
        self.pos_conv = nn.utils.parametrizations.weight_norm(nn.Conv1d(D, D, 3, padding=1, groups=2), dim=2)
        self.head = nn.Linear(D, V)

    def forward(self, x):
        pos = torch.arange(T).expand(x.shape[0], T)
        h = self.emb(x) + self.buckets(torch.bucketize(pos.float(), self.bounds))
        # Mix-FFN: the sequence as a 2 x 4 image, a depthwise convolution, back to a sequence
        u = self.fc1(h).transpose(1, 2).view(x.shape[0], D, 2, T // 2)
        h = h + self.fc2(F.gelu(self.dw(u).flatten(2).transpose(1, 2)))
        # attention with a bilinearly resized bias table
        q, k, v = self.qkv(h).chunk(3, -1)
        bias = F.interpolate(self.table, size=(T, T), mode="bilinear", align_corners=False)[0]
        h = h + F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        # top-1 routing mask by in-place scatter
        scores = self.gate(h)
        mask = torch.zeros_like(scores).scatter_(-1, scores.topk(1, dim=-1).indices, 1.0)
        h = h + (mask * scores.softmax(-1)) @ self.experts
        # a linear recurrence written step by step into a transposed buffer
        hs = h.new_zeros(x.shape[0], D, T).transpose(1, 2)
        prev = torch.zeros_like(h[:, 0])
        for t in range(T):
            prev = self.decay * prev + h[:, t]
            hs[:, t] = prev
        return self.head(hs + self.pos_conv(hs.transpose(1, 2)).transpose(1, 2))


def lm_step(model, optim, batch):
    x, y = batch
    logits = model(x)
    loss = F.cross_entropy(logits.reshape(-1, V), y.reshape(-1))
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def pairwise_step(model, optim, batch):
    """Cross entropy plus SigLIP's pairwise sigmoid loss between the sequences' mean logits."""
    x, y = batch
    logits = model(x)
    z = F.normalize(logits.mean(1), dim=-1)
    labels = 2 * torch.eye(z.shape[0]) - 1
    loss = F.cross_entropy(logits.reshape(-1, V), y.reshape(-1)) - F.logsigmoid(labels * (z @ z.T) * 10).mean()
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def batch_of(rank, step):
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randint(0, V, (B, T), generator=g), torch.randint(0, V, (B, T), generator=g)


def _optim(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


VARIANTS = {  # name -> (model class, step, placement)
    "recurrent": (Recurrent, lm_step, "shard"),
    "held_out": (HeldOut, pairwise_step, "replicate"),
}


def _make(cls):
    def make():
        torch.manual_seed(0)
        return cls()
    return make


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """name -> cache dir: built offline with the stock package (no opt-in)."""
    out = {}
    for name, (cls, step, placement) in VARIANTS.items():
        cache = tmp_path_factory.mktemp(name)
        job = spmd_aot.Job(step=step, model=_make(cls), optimizer=_optim, batch=lambda: batch_of(0, 0))
        spmd_aot.build(job, world_size=2, cache_dir=cache, placement=placement)
        out[name] = str(cache)
    return out


def _parity_worker(rank, world, built):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    out = {}
    for name, (cls, step, placement) in VARIANTS.items():
        ref = _make(cls)()
        wrapped = fully_shard(ref, mesh=init_device_mesh("cpu", (world,))) if placement == "shard" \
            else DistributedDataParallel(ref)
        ref_optim = _optim(wrapped)
        ref_losses = [step(wrapped, ref_optim, batch_of(rank, s)).detach() for s in range(STEPS)]
        model = _make(cls)()
        optim = _optim(model)
        fn = spmd_aot.compile(step, cache_dir=built[name], placement=placement, require_hit=True)
        losses = [fn(model, optim, batch_of(rank, s)).detach() for s in range(STEPS)]
        full = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in ref.parameters()]
        out[name] = {"param": max((a.detach() - b.detach()).abs().max().item()
                                  for a, b in zip(full, [p.full_tensor() if hasattr(p, "full_tensor") else p
                                                         for p in model.parameters()])),
                     "loss": max((a - b).abs().item() for a, b in zip(ref_losses, losses)),
                     "traces": fn.cache_info.traces}
    return out


def test_each_model_loads_without_opt_in_and_matches_eager_on_two_gloo_ranks(built, monkeypatch):
    monkeypatch.delenv("SPMD_AOT_ALLOW_OPS", raising=False)
    for rank, results in enumerate(run_ranks(_parity_worker, 2, built)):
        for name, r in results.items():
            print(f"rank {rank} {name}: max |param diff| {r['param']:.2e}, max |loss diff| {r['loss']:.2e}")
            assert r["traces"] == 0 and r["param"] <= TOL and r["loss"] <= TOL, (rank, name, r)


def test_a_ctc_head_with_labels_is_refused_naming_a_loss_that_builds(tmp_path):
    """``Wav2Vec2ForCTC(labels=...)`` checks its labels on the host (``labels.max()``) and then
    computes CTC: the build says it is a CTC head, that CTC cannot be stored, and what builds
    (a per-frame loss with ``layerdrop=0.0``; LayerDrop's own refusal names that option)."""
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    config = transformers.Wav2Vec2Config(vocab_size=16, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                         intermediate_size=32, conv_dim=(16, 16), conv_stride=(5, 2),
                                         conv_kernel=(10, 3), num_conv_pos_embeddings=16,
                                         num_conv_pos_embedding_groups=2, mask_time_prob=0.0, pad_token_id=0)

    def ctc_step(model, optim, batch):
        loss = model(**batch).loss
        loss.backward()
        optim.step()
        optim.zero_grad()
        return loss

    job = spmd_aot.Job(step=ctc_step, model=lambda: transformers.Wav2Vec2ForCTC(config), optimizer=_optim,
                       batch=lambda: {"input_values": torch.randn(2, 400), "labels": torch.randint(1, 16, (2, 4))})
    with pytest.raises(UnsupportedError) as info:
        spmd_aot.build(job, world_size=1, cache_dir=tmp_path)
    message = str(info.value)
    assert "\n" not in message and "label check of a CTC head" in message, message
    assert "modeling_wav2vec2.py" in message and "test_held_out.py" in message, message
    assert "F.cross_entropy" in message and "experts_implementation" not in message, message

    def frames_step(model, optim, batch):  # the rewrite the message names, before layerdrop=0.0
        logits = model(input_values=batch["input_values"]).logits
        loss = F.cross_entropy(logits.reshape(-1, 16), batch["labels"].reshape(-1))
        loss.backward()
        optim.step()
        optim.zero_grad()
        return loss

    config.layerdrop = 0.1  # transformers' default: a host-side draw per layer while training
    job = spmd_aot.Job(step=frames_step, model=lambda: transformers.Wav2Vec2ForCTC(config), optimizer=_optim,
                       batch=lambda: {"input_values": torch.randn(2, 400), "labels": torch.randint(0, 16, (2, 39))})
    with pytest.raises(UnsupportedError) as info:
        spmd_aot.build(job, world_size=1, cache_dir=tmp_path)
    assert "transformers' LayerDrop" in str(info.value) and "`layerdrop=0.0`" in str(info.value), str(info.value)


class CachedIndex(nn.Module):
    """BEiT's pattern: an index computed from Python numbers, memoized for every instance."""

    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.randn(2 * T - 1, 1))

    @staticmethod
    @functools.lru_cache(maxsize=4)
    def index(n: int) -> torch.Tensor:
        pos = torch.arange(n)
        return pos[:, None] - pos[None, :] + n - 1

    def forward(self, x):
        return (self.table[self.index(T).reshape(-1)].reshape(T, T) * x[:, :, None]).sum(-1)


def test_a_tensor_memoized_by_the_model_is_computed_again_in_each_build(tmp_path):
    """Two builds in one process (``spmd-aot build -p replicate -p shard``): the second trace does
    not meet the first one's fake tensor in the model's cache ("Mixing fake modes")."""
    def square_step(model, optim, batch):
        loss = model(batch).pow(2).mean()
        loss.backward()
        optim.step()
        optim.zero_grad()
        return loss

    CachedIndex.index.cache_clear()
    job = spmd_aot.Job(step=square_step, model=CachedIndex, optimizer=_optim, batch=lambda: torch.randn(2, T))
    for placement in ("replicate", "shard"):
        assert spmd_aot.build(job, world_size=2, cache_dir=tmp_path, placement=placement).traced

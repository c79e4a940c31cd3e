"""Constructs of users' models that emit ops admitted by contract, built with the stock package
(no opt-in) and run on 2 gloo ranks against eager PyTorch:

* complex-number rotary embeddings as torchtitan and Meta's reference Llama write them
  (``view_as_complex``, ``polar``, ``view_as_real``, ``_conj`` in the backward), with
  ``freqs_cis`` a non-persistent complex64 buffer (torchtitan), a persistent one (stored with
  the state) or computed in forward, against DDP, and sharded, against ``fully_shard`` per block;
* ``nn.AdaptiveAvgPool1d`` on a transposed input (``as_strided_`` in its forward, rewritten to
  ``as_strided`` at build time), against DDP;
* a broadcast view of a parameter (``D[None, :, None]``) saved for backward in a block resharded
  after forward: its re-gather rebuilds the view by reshaping, against ``fully_shard`` per block.

Complex state: a complex64 buffer is a layout input of its dtype, and a complex64 graph constant
goes through the constants blob (safetensors stores complex64 as it is) with its values.

Tolerance: the README's, 1e-5 after 5 AdamW steps (measured differences are ~1e-7).
"""

from __future__ import annotations

import msgpack
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import spmd_aot
from spmd_aot.entries import read_manifest
from spmd_aot.store import LocalStore
from support.multiproc import run_ranks
from support.train_steps import plain_step as class_step

VOCAB, D, HEADS, LAYERS, CTX = 64, 32, 4, 2, 8
STEPS, TOL = 5, 1e-5


# ---------------------------------------------------------------- complex RoPE (torchtitan / Llama)
def precompute_freqs_cis(dim: int, end: int, theta: float = 10000.0) -> torch.Tensor:
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: dim // 2].float() / dim))
    t = torch.arange(end, device=freqs.device)
    freqs = torch.outer(t, freqs).float()
    return torch.polar(torch.ones_like(freqs), freqs)  # complex64


def apply_rotary_emb(xq, xk, freqs_cis):
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs_cis = freqs_cis.view(1, xq_.shape[1], 1, xq_.shape[-1])
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


class RopeAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(D, D, bias=False) for _ in range(4))

    def forward(self, x, freqs_cis):
        b, s, _ = x.shape
        q, k, v = (w(x).view(b, s, HEADS, D // HEADS) for w in (self.wq, self.wk, self.wv))
        q, k = apply_rotary_emb(q, k, freqs_cis)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, D))


class RopeLM(nn.Module):
    """``freqs``: "buffer" (non-persistent, torchtitan), "persistent" (in the state dict) or
    "forward" (computed each call)."""

    def __init__(self, freqs: str):
        super().__init__()
        self.freqs = freqs
        self.tok = nn.Embedding(VOCAB, D)
        self.layers = nn.ModuleDict({str(i): RopeAttention() for i in range(LAYERS)})
        self.head = nn.Linear(D, VOCAB)
        if freqs != "forward":
            self.register_buffer("freqs_cis", precompute_freqs_cis(D // HEADS, CTX), persistent=freqs == "persistent")

    def forward(self, idx):
        freqs_cis = self.freqs_cis if self.freqs != "forward" else precompute_freqs_cis(D // HEADS, CTX)
        freqs_cis = freqs_cis[: idx.shape[1]]
        h = self.tok(idx)
        for layer in self.layers.values():
            h = h + layer(h, freqs_cis)
        return self.head(h)


def lm_step(model, optim, batch):
    x, y = batch
    loss = F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def lm_batch(rank, step):
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randint(0, VOCAB, (2, CTX), generator=g), torch.randint(0, VOCAB, (2, CTX), generator=g)


# ---------------------------------------------------------------- as_strided emitters
class PoolNet(nn.Module):
    """Sequence features pooled over time: ``AdaptiveAvgPool1d`` on a transposed input."""

    def __init__(self):
        super().__init__()
        self.lin, self.pool, self.head = nn.Linear(8, 8), nn.AdaptiveAvgPool1d(1), nn.Linear(8, 3)

    def forward(self, x):
        return self.head(self.pool(self.lin(x).transpose(1, 2)).squeeze(-1))


class ScaleBlock(nn.Module):
    """A per-channel scale broadcast as ``D[None, :, None]`` (as state-space blocks write it)."""

    def __init__(self):
        super().__init__()
        self.lin, self.D = nn.Linear(8, 8), nn.Parameter(torch.randn(8))

    def forward(self, x):
        return self.lin((x * self.D[None, :, None]).transpose(1, 2)).transpose(1, 2)


class ScaleNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([ScaleBlock(), ScaleBlock()])
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        x = x.transpose(1, 2)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x.mean(-1))


def class_batch(rank, step):
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(4, 6, 8, generator=g), torch.randint(0, 3, (4,), generator=g)


def _optim(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


VARIANTS = {  # name -> (model factory, step, batch, placement)
    "rope_buffer": (lambda: RopeLM("buffer"), lm_step, lm_batch, "replicate"),
    "rope_persistent": (lambda: RopeLM("persistent"), lm_step, lm_batch, "replicate"),
    "rope_forward": (lambda: RopeLM("forward"), lm_step, lm_batch, "replicate"),
    "rope_sharded": (lambda: RopeLM("buffer"), lm_step, lm_batch, "shard"),
    "pool_transposed": (PoolNet, class_step, class_batch, "replicate"),
    "scale_resharded": (ScaleNet, class_step, class_batch, "shard"),
}


def _job(name):
    make, step, batch, _ = VARIANTS[name]
    return spmd_aot.Job(step=step, model=make, optimizer=_optim, batch=lambda: batch(0, 0))


def _graph_ops(cache, digest) -> set:
    store = LocalStore(cache)
    doc = msgpack.unpackb(store.get(read_manifest(store, digest)["blobs"]["graph"]), raw=False)
    return {n["target"] for n in doc["nodes"] if n["op"] == "call_function"}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """name -> (cache dir, ops of its stored graph): built offline with the stock package."""
    out = {}
    for name, (_, _, _, placement) in VARIANTS.items():
        cache = tmp_path_factory.mktemp(name)
        result = spmd_aot.build(_job(name), world_size=2, cache_dir=cache, placement=placement)
        out[name] = (str(cache), _graph_ops(cache, result.digest))
    return out


def test_the_stored_graphs_call_the_admitted_ops_and_never_an_in_place_view(built):
    for name in ("rope_buffer", "rope_persistent", "rope_forward", "rope_sharded"):
        ops = built[name][1]
        assert {"aten::view_as_complex.default", "aten::view_as_real.default", "aten::_conj.default"} <= ops, name
    assert "aten::polar.default" in built["rope_forward"][1]
    assert "aten::as_strided.default" in built["pool_transposed"][1]
    assert not any("as_strided_" in op for _, ops in built.values() for op in ops)
    # the re-gathered D[None, :, None] is a reshape of the gathered parameter, not a raw view
    assert "aten::as_strided.default" not in built["scale_resharded"][1]


def _state(model):
    """Every parameter and buffer as real tensors (complex ones as their (real, imag) pairs)."""
    out = {}
    for n, t in [*model.named_parameters(), *model.named_buffers()]:
        t = t.full_tensor() if hasattr(t, "full_tensor") else t
        out[n] = torch.view_as_real(t.detach()) if t.is_complex() else t.detach()
    return out


def _parity_worker(rank, world, built):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    out = {}
    for name, (make, step, batch, placement) in VARIANTS.items():
        torch.manual_seed(0)
        ref = make()
        if placement == "shard":
            mesh = init_device_mesh("cpu", (world,))
            for block in (ref.blocks if hasattr(ref, "blocks") else ref.layers.values()):
                fully_shard(block, mesh=mesh)
            wrapped = fully_shard(ref, mesh=mesh)
        else:
            wrapped = DistributedDataParallel(ref)
        ref_optim = _optim(wrapped)
        ref_losses = [step(wrapped, ref_optim, batch(rank, s)).detach() for s in range(STEPS)]
        torch.manual_seed(0)
        model = make()
        optim = _optim(model)
        fn = spmd_aot.compile(step, cache_dir=built[name][0], placement=placement)
        losses = [fn(model, optim, batch(rank, s)).detach() for s in range(STEPS)]
        ref_state, state = _state(ref), _state(model)
        assert ref_state.keys() == state.keys(), (name, ref_state.keys() ^ state.keys())
        out[name] = {"param": max((ref_state[k] - state[k]).abs().max().item() for k in state),
                     "loss": max((a - b).abs().item() for a, b in zip(ref_losses, losses))}
    return out


def test_each_model_loads_without_opt_in_and_matches_eager_on_two_gloo_ranks(built, monkeypatch):
    monkeypatch.delenv("SPMD_AOT_ALLOW_OPS", raising=False)
    for rank, results in enumerate(run_ranks(_parity_worker, 2, built)):
        for name, r in results.items():
            print(f"rank {rank} {name}: max |param diff| {r['param']:.2e}, max |loss diff| {r['loss']:.2e}")
            assert r["param"] <= TOL and r["loss"] <= TOL, (rank, name, r)


def test_a_complex_buffer_is_state_in_the_layout_and_the_step_keeps_it(tmp_path):
    """A persistent complex64 ``freqs_cis`` is a state input like any buffer: the layout records
    its dtype, and a compiled step reads the live buffer and leaves it as training leaves it."""
    from spmd_aot.entries import read_artifact

    torch.manual_seed(0)
    model = RopeLM("persistent")
    before = model.freqs_cis.clone()
    result = spmd_aot.build(_job("rope_persistent"), world_size=1, cache_dir=tmp_path)
    inputs = read_artifact(LocalStore(tmp_path), result.digest).layout["inputs"]
    assert [e["dtype"] for e in inputs if e["fqn"] == "freqs_cis"] == ["complex64"]
    fn = spmd_aot.compile(lm_step, cache_dir=tmp_path, require_hit=True)
    fn(model, _optim(model), lm_batch(0, 0))
    assert model.freqs_cis.dtype == torch.complex64 and torch.equal(model.freqs_cis, before)

class ComplexConstantNet(nn.Module):
    """Rotations written as a complex literal in forward: a complex64 graph constant."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        h = torch.view_as_complex(self.lin(x).reshape(*x.shape[:-1], 4, 2))
        return torch.view_as_real(h * torch.tensor([1 + 1j, 0.5j, 2.0, -1j])).flatten(-2)


def _square_step(model, optim, batch):
    loss = model(batch).pow(2).mean()
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def test_a_complex_graph_constant_survives_the_constants_blob(tmp_path):
    """safetensors stores complex64 as it is: the stored constant loads with its values."""
    job = spmd_aot.Job(step=_square_step, model=ComplexConstantNet, optimizer=_optim, batch=lambda: torch.randn(2, 8))
    built = spmd_aot.build(job, world_size=1, cache_dir=tmp_path)
    assert "constants" in read_manifest(LocalStore(tmp_path), built.digest)["blobs"]
    torch.manual_seed(0)
    model, ref = ComplexConstantNet(), ComplexConstantNet()
    ref.load_state_dict(model.state_dict())
    optim, ref_optim = _optim(model), _optim(ref)
    fn = spmd_aot.compile(_square_step, cache_dir=tmp_path, require_hit=True)
    for s in range(3):
        batch = torch.randn(2, 8, generator=torch.Generator().manual_seed(s))
        assert abs(fn(model, optim, batch).item() - _square_step(ref, ref_optim, batch).item()) <= TOL
    assert max((p - q).abs().max().item() for p, q in zip(model.parameters(), ref.parameters())) <= TOL

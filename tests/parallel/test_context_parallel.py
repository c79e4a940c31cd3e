"""Context parallelism: the batch's sequence split over a ``cp`` mesh dimension, alone (world 2,
and cp 4 at world 4), with DDP (``(dp_replicate, cp)``) and FSDP (``(dp_shard, cp)``) at world 4,
with FSDP and TP (``(dp_shard, cp, tp)``) and HSDP (``(dp_replicate, dp_shard, cp)``) at world 8,
for causal and full attention, on a model of our own (RoPE from position ids in the batch, SDPA)
and on transformers' Llama (sdpa). Steps built offline, loaded with 0 traces on every rank, match
the same model on the whole sequence under eager PyTorch (plain, DDP, ``fully_shard`` over the
data-parallel mesh, + ``parallelize_module`` over tp) after 3 AdamW steps. torch's own
``context_parallel`` does not run on CPU (no sharding strategy for
``_scaled_dot_product_flash_attention_for_cpu``), so the unsplit model is the oracle: the two
are mathematically equal."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import spmd_aot
from spmd_aot.entries import read_artifact
from spmd_aot.parallel.context_parallel import load_balanced_positions
from spmd_aot.store import LocalStore
from support.multiproc import run_ranks

STEPS = 3
TOL = 1e-4
VOCAB, D, HEAD_DIM = 32, 16, 4  # 4 heads: 2 per rank at tp=2
SEQ = 16  # 4 chunks of 2 per rank at cp=2 (the sequence is 4x a chunk), 8 chunks of 2 at cp=4


# ---------------------------------------------------------------------------- our model
class Attention(nn.Module):
    """RoPE on positions from the batch (or, with ``table``, from a buffer of angles per position
    sliced by the input's length, as torchtitan slices ``freqs_cis[:seqlen]``), then SDPA (causal
    or not); local heads from ``q``."""

    def __init__(self, causal: bool, table: bool = False):
        super().__init__()
        self.causal, self.table = causal, table
        self.q, self.k, self.v, self.o = (nn.Linear(D, D, bias=False) for _ in range(4))
        inv_freq = 1.0 / (10000 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        if table:
            self.register_buffer("angles", torch.arange(SEQ).float()[:, None] * inv_freq, persistent=False)

    def rope(self, x, pos):
        if self.table:
            freqs = self.angles[:x.shape[-2]]  # [t, head_dim / 2]
            cos, sin = freqs.cos(), freqs.sin()
        else:
            freqs = pos[..., None].float() * self.inv_freq  # [b, t, head_dim / 2]
            cos, sin = freqs.cos()[:, None], freqs.sin()[:, None]
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)

    def forward(self, x, pos):
        b, t, _ = x.shape
        q, k, v = self.q(x), self.k(x), self.v(x)
        heads = q.shape[-1] // HEAD_DIM  # this rank's heads under TP
        split = lambda z: z.view(b, t, heads, HEAD_DIM).transpose(1, 2)  # noqa: E731
        q, k, v = self.rope(split(q), pos), self.rope(split(k), pos), split(v)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return self.o(out.transpose(1, 2).reshape(b, t, heads * HEAD_DIM))


class Block(nn.Module):
    def __init__(self, causal: bool, table: bool = False):
        super().__init__()
        self.ln1, self.ln2 = nn.RMSNorm(D), nn.RMSNorm(D)
        self.attn = Attention(causal, table)
        self.up, self.down = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x, pos):
        x = x + self.attn(self.ln1(x), pos)
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class CPNet(nn.Module):
    def __init__(self, causal: bool = True, table: bool = False):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList([Block(causal, table) for _ in range(2)])
        self.ln_f = nn.RMSNorm(D)
        self.head = nn.Linear(D, VOCAB)

    def forward(self, idx, pos):
        x = self.tok(idx)
        for block in self.blocks:
            x = block(x, pos)
        return self.head(self.ln_f(x))


def own_step(model, optim, batch):
    logits = model(batch["input_ids"], batch["position_ids"])
    loss = F.cross_entropy(logits.flatten(0, 1), batch["targets"].flatten())
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def llama_step(model, optim, batch):
    """transformers' model with global position ids; the targets are shifted before the step
    (``labels=`` would shift inside the rank's tokens)."""
    logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
    loss = F.cross_entropy(logits.flatten(0, 1), batch["targets"].flatten())
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def make_batch(share: int = 0, s: int = 0, seq: int = SEQ) -> dict:
    """One data-parallel share's batch; the cp (and TP) ranks of a share pass the same one."""
    g = torch.Generator().manual_seed(1000 * share + s)
    tokens = torch.randint(0, VOCAB, (2, seq + 1), generator=g)
    return {"input_ids": tokens[:, :-1].contiguous(), "position_ids": torch.arange(seq).expand(2, seq).contiguous(),
            "targets": tokens[:, 1:].contiguous()}


def _llama():
    from support.corpus import _decoder

    return _decoder("LlamaConfig", "LlamaForCausalLM")


MODELS = {"causal": (lambda: CPNet(True), own_step), "full": (lambda: CPNet(False), own_step),
          "llama": (_llama, llama_step), "rope_table": (lambda: CPNet(True, table=True), own_step)}
# options a model needs beyond its configuration's
MODEL_OPTIONS = {"rope_table": {"context_parallel_buffers": ("blocks.*.attn.angles",)}}
TP_PLAN = {"blocks.*.attn.q": "colwise", "blocks.*.attn.k": "colwise", "blocks.*.attn.v": "colwise",
           "blocks.*.attn.o": "rowwise", "blocks.*.up": "colwise", "blocks.*.down": "rowwise"}
# world -> config -> (placement, mesh shape, tp plan, models)
CONFIGS = {
    2: {"cp": ("replicate", (2,), None, ("causal", "full", "llama", "rope_table"))},
    4: {"fsdp_cp": ("shard", (2, 2), None, ("causal", "full", "llama", "rope_table")),
        "cp4": ("replicate", (4,), None, ("causal", "full")),
        "ddp_cp": ("replicate", (2, 2), None, ("causal",))},
    8: {"fsdp_cp_tp": ("shard", (2, 2, 2), TP_PLAN, ("causal", "full")),
        "hsdp_cp": ("shard", (2, 2, 2), None, ("causal",))},
}


def optimizer(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _options(world, config, model_name=None):
    placement, shape, tp_plan, _ = CONFIGS[world][config]
    return {"placement": placement, "mesh_shape": shape if len(shape) > 1 else None,
            "tp_plan": tp_plan or (), "context_parallel": True, **MODEL_OPTIONS.get(model_name, {})}


def _roles(world, config):
    return spmd_aot.Plan(world, **{k: v for k, v in _options(world, config).items()}).mesh_roles


# ---------------------------------------------------------------------------- the ranks
def _eager(world, config, model_name, rank, mesh):
    """The oracle: the unsplit sequence; fully_shard per block and on the root over the
    data-parallel mesh (dp_shard, or HSDP's 2-D mesh), or DDP over dp_replicate;
    parallelize_module over tp (the cp ranks of a share each run the same eager job)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    placement, shape, tp_plan, _ = CONFIGS[world][config]
    make, step = MODELS[model_name]
    torch.manual_seed(0)
    model = make()
    if tp_plan:
        styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
        parallelize_module(model, mesh["tp"], {k: styles[v]() for k, v in tp_plan.items()})
    dp = tuple(role for role in _roles(world, config) if role.startswith("dp_"))
    if placement == "shard":
        for block in (model.model.layers if model_name == "llama" else model.blocks):
            fully_shard(block, mesh=mesh[dp])
        fully_shard(model, mesh=mesh[dp])
    elif dp:
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model, process_group=mesh["dp_replicate"].get_group())
    optim = optimizer(model)
    share = _share(world, config, rank)
    return model, optim, [step(model, optim, make_batch(share, s)).detach() for s in range(STEPS)]


def _share(world, config, rank):
    roles, shape = _roles(world, config), CONFIGS[world][config][1]
    return rank // (shape[roles.index("cp")] * (shape[roles.index("tp")] if "tp" in roles else 1))


def _compiled(world, config, model_name, rank, cache):
    make, step = MODELS[model_name]
    torch.manual_seed(0)
    model = make()
    optim = optimizer(model)
    fn = spmd_aot.compile(step, cache_dir=cache, require_hit=True, **_options(world, config, model_name))
    share = _share(world, config, rank)
    return model, optim, [fn(model, optim, make_batch(share, s)).detach() for s in range(STEPS)], fn.cache_info


def _parity_worker(rank, world, caches):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from support import features

    out = {}
    for (config, model_name), cache in caches.items():
        mesh = init_device_mesh("cpu", CONFIGS[world][config][1], mesh_dim_names=_roles(world, config))
        ref_model, ref_optim, ref_losses = _eager(world, config, model_name, rank, mesh)
        model, optim, losses, info = _compiled(world, config, model_name, rank, cache)
        mine = [loss.clone() for loss in losses]
        for loss in losses:  # each cp rank returns the mean over its tokens: their mean is the whole's
            dist.all_reduce(loss, group=mesh["cp"].get_group())
            loss /= mesh["cp"].size()
        diffs = features.max_diffs(ref_model, ref_optim, model, optim, ref_losses, losses)
        out[config, model_name] = {**diffs, "hit": info.hit, "traces": info.traces,
                                   "own_loss_differs": max((a - b).abs().item() for a, b in zip(mine, ref_losses))}
    return out


# ---------------------------------------------------------------------------- the tests
@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """world -> {(config, model): (cache dir, build result)}: each world's configurations built
    offline once, when a test first asks for that world."""
    out = {}

    def world_builds(world):
        if world not in out:
            out[world] = {}
            for config, (_, _, _, models) in CONFIGS[world].items():
                for name in models:
                    cache = str(tmp_path_factory.mktemp(f"cp-{world}-{config}-{name}"))
                    make, step = MODELS[name]
                    job = spmd_aot.Job(step=step, model=make, optimizer=optimizer, batch=make_batch)
                    out[world][config, name] = cache, spmd_aot.build(job, world_size=world, cache_dir=cache,
                                                                     **_options(world, config, name))
        return out[world]

    return world_builds


@pytest.fixture(scope="module")
def parity(built):
    """world -> per-rank results: one launch per world runs every configuration and model."""
    out = {}

    def world_parity(world):
        if world not in out:
            out[world] = run_ranks(_parity_worker, world, {k: v[0] for k, v in built(world).items()}, timeout=900)
        return out[world]

    return world_parity


CASES = [(w, c, m) for w, configs in CONFIGS.items() for c, (*_, models) in configs.items() for m in models]


@pytest.mark.parametrize("world,config,model_name", CASES)
def test_cp_matches_the_unsplit_sequence_and_hits_with_no_trace(parity, world, config, model_name):
    for rank, per_rank in enumerate(parity(world)):
        r = per_rank[config, model_name]
        assert r["hit"] and r["traces"] == 0, (rank, r)
        assert r["param"] <= TOL and r["state"] <= TOL and r["loss"] <= TOL, f"rank {rank}: {r}"
        # the rank's own loss is its tokens' mean, not the whole sequence's (a wrong split would
        # still make some rank's equal by chance only)
        assert r["own_loss_differs"] > 1e-3, (rank, r)


def _collectives(cache, result):
    art = read_artifact(LocalStore(cache), result.digest)
    return [(e["collective"], e["group"], e["label"]) for e in art.schema["nodes"].values() if "collective" in e]


@pytest.mark.parametrize("world,config,model_name", CASES)
def test_stored_graph_has_the_gathers_and_scatters_of_each_attention_over_cp(built, world, config, model_name):
    cache, result = built(world)[config, model_name]
    cp_dim = _roles(world, config).index("cp")
    found = [c for c in _collectives(cache, result) if (c[2] or "").startswith("cp ")]
    layers = 2
    # causal attention keeps only the local keys and values for backward and gathers them again there
    again = [("all_gather_into_tensor", "cp attention keys and values for backward")] * layers
    assert sorted((kind, label) for kind, _, label in found) == sorted(
        [("reduce_scatter_tensor", "cp batch rank index")]
        + [("all_gather_into_tensor", "cp attention keys and values")] * layers
        + (again if model_name != "full" else [])
        + [("reduce_scatter_tensor", "cp attention keys and values gradient")] * layers)
    assert {group for _, group, _ in found} == {cp_dim}
    assert result.stats["by_kind"]["all_gather_into_tensor"] >= layers


def eval_step(model, batch):
    logits = model(batch["input_ids"], batch["position_ids"])
    return F.cross_entropy(logits.flatten(0, 1), batch["targets"].flatten()), logits


def _eval_worker(rank, world, cache):
    import torch.distributed as dist

    torch.manual_seed(0)
    model = CPNet(True)
    with torch.no_grad():
        ref_loss, ref_logits = eval_step(model, make_batch(0, 7))
    fn = spmd_aot.compile(eval_step, cache_dir=cache, require_hit=True, context_parallel=True)
    loss, logits = fn(model, make_batch(0, 7))
    mine = load_balanced_positions(SEQ, world, rank)  # this rank's tokens of the whole sequence
    dist.all_reduce(loss)
    return {"logits": (logits - ref_logits[:, mine]).abs().max().item(),
            "loss": (loss / world - ref_loss).abs().item(), "traces": fn.cache_info.traces}


def test_a_forward_only_step_returns_its_tokens_logits(tmp_path):
    """An evaluation step (no optimizer) under context parallel: each rank's logits are the
    unsplit model's at its load-balanced positions."""
    job = spmd_aot.Job(step=eval_step, model=lambda: CPNet(True), optimizer=None, batch=make_batch)
    result = spmd_aot.build(job, world_size=2, cache_dir=str(tmp_path), context_parallel=True)
    assert result.stats["by_kind"] == {"reduce_scatter_tensor": 1, "all_gather_into_tensor": 2}
    for r in run_ranks(_eval_worker, 2, str(tmp_path), timeout=600):
        assert r["traces"] == 0 and r["logits"] <= 1e-5 and r["loss"] <= 1e-5, r


def test_load_balanced_positions_are_torch_head_tail_chunks():
    """Rank i of cp holds chunks i and 2cp-1-i: every position once, equal causal work per rank."""
    cp, seq = 4, 32
    held = [load_balanced_positions(seq, cp, r).tolist() for r in range(cp)]
    assert held[0] == [0, 1, 2, 3, 28, 29, 30, 31] and held[3] == [12, 13, 14, 15, 16, 17, 18, 19]
    assert sorted(p for h in held for p in h) == list(range(seq))
    assert len({sum(h) for h in held}) == 1  # causal work: sum of (position + 1) over the queries
    tensor_rank = load_balanced_positions(seq, cp, torch.tensor([2]))
    assert tensor_rank.tolist() == held[2]


class _OneRank:
    """What ``CausalBlocks`` asks of the context-parallel mode, for rank ``rank`` of ``size`` in
    one process: ``gather`` returns the whole sequence's keys and values (given, in rank order);
    ``scatter`` keeps the whole sequence's gradient it is given (this rank's queries' share) and
    returns this rank's rows of it."""

    def __init__(self, size, rank, whole_flat):
        self.size, self.rank, self.whole_flat, self.scattered = size, rank, whole_flat, None

    def gather(self, t, what):
        return self.whole_flat

    def scatter(self, t, what):
        self.scattered = t
        return t.unflatten(0, (self.size, -1))[self.rank]


@pytest.mark.parametrize("cp", [1, 2, 4, 8])
def test_blockwise_causal_attention_equals_sdpa_on_the_whole_sequence(cp):
    """Every rank's output and gradients (queries; keys and values at every global position)
    equal those of causal SDPA over the whole sequence for that rank's queries: grouped-query
    heads, a scale, fp32; the rank-dependent blocks are dropped on the right ranks."""
    from spmd_aot.parallel.context_parallel import load_balanced_keys
    from spmd_aot.parallel.cp_attention import CausalBlocks, _tokens_first

    b, h, hk, seq, e, scale = 2, 4, 2, 48 * cp, 8, 0.3
    g = torch.Generator().manual_seed(cp)
    q_all, k_all, v_all = (torch.randn(b, heads, seq, e, generator=g) for heads in (h, hk, hk))
    keys = load_balanced_keys(seq, cp)
    whole_flat = torch.cat([_tokens_first(k_all[:, :, keys]), _tokens_first(v_all[:, :, keys])], dim=1)
    worst = 0.0
    for rank in range(cp):
        pos = load_balanced_positions(seq, cp, rank)
        q, k, v = (t[:, :, pos].clone().requires_grad_() for t in (q_all, k_all, v_all))
        mode = _OneRank(cp, rank, whole_flat)
        out = CausalBlocks.apply(q, k, v, torch.tensor([rank]), mode, scale)
        grad = torch.randn(out.shape, generator=g)
        (out * grad).sum().backward()
        ref_q, ref_k, ref_v = (t.clone().requires_grad_() for t in (q_all, k_all, v_all))
        ref = F.scaled_dot_product_attention(ref_q, ref_k, ref_v, is_causal=True, scale=scale, enable_gqa=True)
        (ref[:, :, pos] * grad).sum().backward()
        # the keys' and values' gradient at every position: the whole share passed to the
        # reduce_scatter (gathered order) plus the rank's own block's (k.grad less its rows of it)
        whole_k, whole_v = (x.reshape(seq, b, hk, e).movedim(0, 2)
                            for x in mode.scattered.split([b * hk * e] * 2, dim=1))
        mine_k, mine_v = (x.reshape(len(pos), b, hk, e).movedim(0, 2)
                          for x in mode.scatter(mode.scattered, "").split([b * hk * e] * 2, dim=1))
        for got_whole, mine, local, ref_grad in ((whole_k, mine_k, k, ref_k), (whole_v, mine_v, v, ref_v)):
            total = torch.zeros_like(ref_grad)
            total[:, :, keys] += got_whole
            total[:, :, pos] += local.grad - mine
            worst = max(worst, (total - ref_grad.grad).abs().max().item())
        worst = max(worst, (out - ref[:, :, pos]).abs().max().item(), (q.grad - ref_q.grad[:, :, pos]).abs().max().item())
    assert worst < 1e-5, worst


class _PlainAttention(nn.Module):
    """Attention written with plain ops: context parallel cannot see it."""

    def __init__(self):
        super().__init__()
        self.tok, self.head = nn.Embedding(VOCAB, D), nn.Linear(D, VOCAB)

    def forward(self, idx, pos):
        x = self.tok(idx)
        return self.head(torch.softmax(x @ x.transpose(1, 2), dim=-1) @ x)


class _PaddedLlama(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = _llama()

    def forward(self, idx, pos):
        mask = (idx != 0).long()  # a padding mask from the batch
        return self.inner(input_ids=idx, position_ids=pos, attention_mask=mask).logits


class _WindowNet(CPNet):
    def forward(self, idx, pos):
        x = self.tok(idx)
        t = x.shape[1]
        i = torch.arange(t)
        window = (i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] < 3)
        h = F.scaled_dot_product_attention(x[:, None], x[:, None], x[:, None], attn_mask=window)[:, 0]
        return self.head(h)


class _DropoutNet(CPNet):
    def forward(self, idx, pos):
        x = self.tok(idx)[:, None]
        return self.head(F.scaled_dot_product_attention(x, x, x, dropout_p=0.1, is_causal=True)[:, 0])


@pytest.mark.parametrize("model,batch,message", [
    (_PlainAttention, make_batch, "called no scaled_dot_product_attention"),
    (_DropoutNet, make_batch, "dropout_p=0.1"),
    (_PaddedLlama, make_batch, "computed from the step's inputs"),
    (_WindowNet, make_batch, "neither the causal nor the all-allowed mask"),
    (CPNet, lambda share=0, s=0: make_batch(share, s, seq=14), "multiple of 4"),
    (CPNet, lambda share=0, s=0: {**make_batch(share, s), "scale": torch.ones(2)}, "splits dim 1"),
], ids=["plain-attention", "dropout", "padding-mask", "sliding-window", "length", "no-sequence-dim"])
def test_what_context_parallel_cannot_split_is_refused_at_build(tmp_path, model, batch, message):
    def step(model, optim, batch):
        logits = model(batch["input_ids"], batch["position_ids"])
        loss = F.cross_entropy(logits.flatten(0, 1), batch["targets"].flatten())
        loss.backward()
        optim.step()
        optim.zero_grad()
        return loss

    job = spmd_aot.Job(step=step, model=model, optimizer=optimizer, batch=batch)
    with pytest.raises(spmd_aot.UnsupportedError, match=message):
        spmd_aot.build(job, world_size=2, cache_dir=str(tmp_path), context_parallel=True)


@pytest.mark.parametrize("buffers,message", [
    (("blocks.*.attn.table",), r"pattern\(s\) \['blocks.\*.attn.table'\] match no buffer"),
    (("blocks.*.attn.inv_freq",), "dim 0 must be the batch's sequence length 16"),
], ids=["no-such-buffer", "not-a-sequence"])
def test_sequence_buffers_that_cannot_be_cut_are_refused(tmp_path, buffers, message):
    job = spmd_aot.Job(step=own_step, model=lambda: CPNet(True, table=True), optimizer=optimizer, batch=make_batch)
    with pytest.raises(spmd_aot.UnsupportedError, match=message):
        spmd_aot.build(job, world_size=2, cache_dir=str(tmp_path), context_parallel=True,
                       context_parallel_buffers=buffers)


def test_plan_names_the_cp_dimension_and_keeps_other_plans_text():
    plan = spmd_aot.Plan(8, "shard", mesh_shape=(2, 2, 2), tp_plan=TP_PLAN, context_parallel=True)
    assert plan.mesh_roles == ("dp_shard", "cp", "tp") and plan.cp == 2 and "cp=2" in plan.describe()
    assert spmd_aot.Plan.from_dict(plan.to_dict()) == plan and plan.to_dict()["context_parallel"] is True
    assert "context_parallel" not in spmd_aot.Plan(4, "shard", mesh_shape=(2, 2)).to_dict()
    layout = plan.layout_for("blocks.0.up.weight", (64, 16))
    # sharded over dp_shard, whole over cp (its gradient averaged there), split over tp
    assert layout.shard_mesh_dim == 0 and layout.replica_mesh_dims == [1] and layout.placements[1] == "Replicate()"
    with pytest.raises(spmd_aot.SpmdAotError, match="with context_parallel"):
        spmd_aot.Plan(2, "shard", context_parallel=True)


def _peak(seq, cp, tmp_path):
    job = spmd_aot.Job(step=own_step, model=lambda: CPNet(True), optimizer=optimizer,
                       batch=lambda share=0, s=0: make_batch(share, s, seq=seq))
    options = {"context_parallel": True} if cp > 1 else {}
    return spmd_aot.build(job, world_size=cp, cache_dir=str(tmp_path / f"peak-{seq}-{cp}"), **options).stats["peak_bytes"]


def test_peak_bytes_of_attention_fall_with_cp_and_stay_below_the_unsplit_step(tmp_path):
    """At a sequence long enough for attention to dominate, the split step's peak is at most the
    unsplit one's from cp 2 on (causal attention is computed block by block: nothing of size
    ``S/cp x S`` exists) and what is above the state (parameters, AdamW state: the same at every
    cp) falls each time cp doubles (docs/context_parallel.md has the table)."""
    seq, base = 8192, _peak(8, 1, tmp_path)  # a short sequence: about the state alone
    peak = {cp: _peak(seq, cp, tmp_path) for cp in (1, 2, 4, 8)}
    above = {cp: p - base for cp, p in peak.items()}
    assert peak[2] <= peak[1], peak
    assert above[4] < 0.65 * above[2] and above[8] < 0.8 * above[4], above

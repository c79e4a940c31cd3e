"""Expert parallel (``ep`` mesh role): each MoE layer's experts split over ``ep`` ranks, tokens
exchanged with equal, static all-to-alls. Loaded on real gloo ranks, the step matches the unsplit
model under eager DDP (world 4: dp_shard 2 x ep 2, and DDP x ep; world 8: dp_shard 2 x ep 2 x tp 2
with TP on the dense parts) on transformers' Mixtral and Qwen2-MoE and on a MoE of our own; the
opt-in capacity factor drops pairs as Switch/GShard do, and what it returns is checked against a
plain implementation of that rule."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import spmd_aot
from spmd_aot.errors import SpmdAotError, UnsupportedError
from spmd_aot.examples.models import StackedExperts
from spmd_aot.parallel.expert_parallel import capacity, expert_modules, planned_experts
from spmd_aot.parallel.plan import Plan
from support import corpus
from support.multiproc import run_ranks

STEPS = 3
TOL = 1e-4  # the bar; measured differences are ~1e-8 (SGD-momentum, fp32)
VOCAB, D = 64, 16


# ---------------------------------------------------------------- a MoE of our own


class Block(nn.Module):
    def __init__(self, experts: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.norm1, self.norm2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.up, self.down = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)
        self.router = nn.Linear(D, experts, bias=False)
        self.experts = StackedExperts(experts, D, 2 * D)
        self.shared = nn.Sequential(nn.Linear(D, D), nn.SiLU(), nn.Linear(D, D))  # a shared expert

    def forward(self, x):
        x = x + self.down(F.gelu(self.up(self.norm1(x))))
        h = self.norm2(x).reshape(-1, D)
        weights, index = self.router(h).softmax(-1).topk(self.top_k, -1)
        weights = weights / weights.sum(-1, keepdim=True)
        return x + (self.experts(h, index, weights) + self.shared(h)).view_as(x)


class TinyMoE(nn.Module):
    def __init__(self, experts: int = 4, top_k: int = 2, layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList(Block(experts, top_k) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(D), nn.Linear(D, VOCAB)

    def forward(self, input_ids, labels):
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(self.norm(x)).view(-1, VOCAB), labels.view(-1))


def tiny_moe():
    torch.manual_seed(0)
    return TinyMoE()


def tiny_batch(rank: int = 0, step: int = 0) -> dict:
    g = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randint(0, VOCAB, (2, 8), generator=g)
    return {"input_ids": x, "labels": x.roll(-1, 1)}


def hf_model(name: str, dtype=torch.float32):
    def make():
        torch.manual_seed(0)
        return corpus.factory(name)().to(dtype)
    make.__qualname__ = f"hf_model_{name}_{str(dtype).removeprefix('torch.')}"
    return make


def step(model, optim, batch):
    out = model(**batch)
    loss = out if isinstance(out, torch.Tensor) else out.loss
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


HF_ATTENTION_TP = {"model.layers.*.self_attn.q_proj": "colwise", "model.layers.*.self_attn.k_proj": "colwise",
                   "model.layers.*.self_attn.v_proj": "colwise", "model.layers.*.self_attn.o_proj": "rowwise"}
OWN_TP = {"blocks.*.up": "colwise", "blocks.*.down": "rowwise"}
MODELS = {"own": (tiny_moe, tiny_batch, OWN_TP), "mixtral": (hf_model("mixtral"), corpus.lm_batch, HF_ATTENTION_TP),
          "qwen2_moe": (hf_model("qwen2_moe"), corpus.lm_batch, HF_ATTENTION_TP),
          "mixtral bf16": (hf_model("mixtral", torch.bfloat16), corpus.lm_batch, HF_ATTENTION_TP)}
# name -> (world, model, options); each loaded on real ranks against eager DDP of the unsplit model
CONFIGS = {
    "own shard x ep": (4, "own", dict(placement="shard", mesh_shape=(2, 2), expert_parallel="auto")),
    "own ddp x ep": (4, "own", dict(placement="replicate", mesh_shape=(2, 2), expert_parallel=("blocks.*.experts",))),
    "mixtral shard x ep": (4, "mixtral", dict(placement="shard", mesh_shape=(2, 2), expert_parallel="auto")),
    "qwen2_moe shard x ep": (4, "qwen2_moe", dict(placement="shard", mesh_shape=(2, 2), expert_parallel="auto")),
    # bf16: expert ids travel in a bf16 column (exact up to 256)
    "mixtral bf16 shard x ep": (4, "mixtral bf16", dict(placement="shard", mesh_shape=(2, 2), expert_parallel="auto")),
    # a factor large enough that no pair is dropped: still the unsplit model's result
    "own capacity 8": (4, "own", dict(placement="shard", mesh_shape=(2, 2), expert_parallel="auto",
                                      expert_capacity_factor=8.0)),
    "own shard x ep x tp": (8, "own", dict(placement="shard", mesh_shape=(2, 2, 2), expert_parallel="auto",
                                           tp_plan=OWN_TP)),
    "mixtral shard x ep x tp": (8, "mixtral", dict(placement="shard", mesh_shape=(2, 2, 2), expert_parallel="auto",
                                                   tp_plan=HF_ATTENTION_TP)),
}
LAYERS = 2  # every model here has two MoE layers
# bf16: the bar tests/tracing/test_moe.py holds eager DDP to (measured 4.9e-4, half a bf16 ulp at 1.0: the
# experts' and the exchange's sums add a token's pairs in another order)
TOLS = {"mixtral bf16 shard x ep": 4e-3}


# ---------------------------------------------------------------- no ranks: the plan and the rule
def test_capacity_is_every_pair_by_default_and_switch_capacity_when_asked():
    # default: the most pairs one rank can send to one rank's experts (distinct experts per token)
    assert capacity(tokens=16, top_k=2, experts=8, ep=2, factor=None) == (16 * 2, None)
    assert capacity(tokens=16, top_k=4, experts=4, ep=4, factor=None) == (16 * 1, None)  # one expert per rank
    # a factor: ceil(f * T * k / E) pairs per expert, E/ep experts per rank
    assert capacity(tokens=16, top_k=2, experts=8, ep=2, factor=1.0) == (4 * 4, 4)
    assert capacity(tokens=16, top_k=2, experts=8, ep=2, factor=1.25) == (4 * 5, 5)
    assert capacity(tokens=3, top_k=1, experts=8, ep=2, factor=0.1) == (4 * 1, 1)  # never below one


def test_expert_parameter_bytes_per_rank_fall_as_one_over_ep():
    """The table in docs/expert_parallel.md: parameter bytes per rank under dp_shard 2 x ep."""
    torch.manual_seed(0)
    model = TinyMoE(experts=8)
    table = {}
    for ep in (1, 2, 4):
        plan = Plan(2 * ep, "shard", mesh_shape=(2, ep), expert_parallel="auto").for_model(model) if ep > 1 else \
            Plan(2, "shard")
        experts = dense = 0
        for name, p in model.named_parameters():
            layout = plan.layout_for(name, p.shape)
            nbytes = math.prod(layout.local_shape) * p.element_size()
            if name.split(".")[-2] == "experts":
                experts += nbytes
            else:
                dense += nbytes
        table[ep] = experts, dense
    total = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".experts." in n)
    for ep, (experts, dense) in table.items():
        assert experts == total // (2 * ep), (ep, table)  # 1/ep of the experts, then a dp_shard half
        assert dense == table[1][1], (ep, table)  # the rest as data parallel lays it out


def test_plan_names_the_ep_dimension_and_lays_out_experts():
    plan = Plan(8, "shard", mesh_shape=(2, 2, 2), expert_parallel=("blocks.*.experts",), tp_plan=OWN_TP)
    assert plan.mesh_roles == ("dp_shard", "ep", "tp") and plan.ep == 2 and plan.dp_size == 4
    assert plan.batch_placements() == ["Shard(0)", "Shard(0)", "Replicate()"]  # ep ranks take their own tokens
    expert = plan.layout_for("blocks.0.experts.w_in", (4, 32, 16))
    assert expert.gathered_shape == (2, 32, 16) and expert.local_shape == (1, 32, 16)
    assert expert.placements == ["_StridedShard(0, sf=2)", "Shard(0)", "Replicate()"]
    assert expert.dp_mesh_dims == [0]  # averaged over dp_shard only: ep ranks hold other experts
    dense = plan.layout_for("blocks.0.router.weight", (4, 16))
    assert dense.placements == ["Shard(0)", "Replicate()", "Replicate()"] and dense.dp_mesh_dims == [0, 1]
    assert Plan.from_dict(plan.to_dict()) == plan
    # plans without expert parallel keep their text form (and keys)
    assert "expert_parallel" not in Plan(4, "shard").to_dict()
    with pytest.raises(SpmdAotError, match="must divide evenly"):
        Plan(8, "shard", mesh_shape=(2, 4), expert_parallel=("blocks.*.experts",)).layout_for(
            "blocks.0.experts.w_in", (6, 32, 16))
    with pytest.raises(SpmdAotError, match="expert_capacity_factor is set without expert_parallel"):
        Plan(4, "shard", expert_capacity_factor=1.0)


def test_auto_finds_the_experts_and_not_the_routers():
    corpus._quiet_transformers()
    assert expert_modules(tiny_moe()) == ["blocks.0.experts", "blocks.1.experts"]
    assert expert_modules(hf_model("mixtral")()) == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    with pytest.raises(UnsupportedError, match="found no expert module"):
        expert_modules(nn.Linear(4, 4))
    with pytest.raises(UnsupportedError, match="not an expert module"):
        planned_experts(tiny_moe(), ["blocks.0.router"])
    with pytest.raises(UnsupportedError, match=r"match no module"):
        planned_experts(tiny_moe(), ["blocks.*.moe"])


def test_experts_that_do_not_split_evenly_are_refused_at_build(tmp_path):
    job = spmd_aot.Job(step=step, model=lambda: TinyMoE(experts=3), optimizer=sgd, batch=tiny_batch)
    with pytest.raises((SpmdAotError, UnsupportedError), match="divide"):
        spmd_aot.build(job, world_size=4, cache_dir=tmp_path, placement="shard", mesh_shape=(2, 2),
                       expert_parallel="auto")


@pytest.mark.parametrize("args,why", [
    (([2, 6], [2, 6]), "must be equal"),
    (([4, 4], [2, 6]), "must equal input_split_sizes"),
    (([3, 3], [3, 3]), "must sum to dim 0"),
    (([], []), "must equal input_split_sizes"),
])
def test_a_stored_all_to_all_exchanges_equal_blocks_only(args, why):
    """The load's contract for ``all_to_all_single`` (format/contracts/all_to_all.py): a stored
    graph's split sizes are the writer's choice; expert parallel only ever exchanges equal blocks."""
    from spmd_aot.format.contracts import Broken, check_call

    op = torch.ops._c10d_functional.all_to_all_single.default
    x = torch.empty(8, 4, device="meta")
    check_call(op, (x, [4, 4], [4, 4], "0"), {})
    with pytest.raises(Broken, match=why):
        check_call(op, (x, *args, "0"), {})
    with pytest.raises(Broken, match="contiguous"):
        check_call(op, (x.t(), [2, 2], [2, 2], "0"), {})


# ---------------------------------------------------------------- built offline, loaded on ranks
@pytest.fixture(scope="module")
def built(tmp_path_factory):
    corpus._quiet_transformers()
    out = {}
    for name, (world, model, options) in CONFIGS.items():
        make, batch, _ = MODELS[model]
        cache = str(tmp_path_factory.mktemp(name.replace(" ", "-")))
        job = spmd_aot.Job(step=step, model=make, optimizer=sgd, batch=lambda batch=batch: batch(0, 0))
        out[name] = cache, spmd_aot.build(job, world_size=world, cache_dir=cache, **options)
    return out


def test_each_moe_layer_exchanges_tokens_with_four_all_to_alls(built):
    """Dispatch and combine in forward, their gradients' exchanges in backward: 4 per MoE layer,
    each labelled with its expert module; the expert gradients need no collective over ep."""
    for name, (_, result) in built.items():
        stats = result.stats
        assert stats["by_kind"]["all_to_all_single"] == 4 * LAYERS, (name, stats["by_kind"])
        labels = [c["label"] for c in stats["comm"] if c["kind"] == "all_to_all_single"]
        for layer in range(LAYERS):
            mine = [label for label in labels if f".{layer}." in label]
            assert sorted(label.split(" ", 2)[2] for label in mine) == \
                ["combine", "combine gradient", "dispatch", "dispatch gradient"], (name, mine)
        assert all(c["bytes"] > 0 for c in stats["comm"] if c["kind"] == "all_to_all_single")


def _parity_worker(rank, world, cases):
    from torch.distributed.tensor import DTensor
    from torch.nn.parallel import DistributedDataParallel

    corpus._quiet_transformers()
    out = {}
    for name, (cache, model_name, options) in cases.items():
        make, batch, _ = MODELS[model_name]
        tp = options["mesh_shape"][-1] if "tp_plan" in options else 1
        share = rank // tp  # TP ranks share a batch; every other rank takes its own
        ref = make()
        ddp = DistributedDataParallel(ref)
        ref_optim = sgd(ref)
        ref_losses = [step(ddp, ref_optim, batch(share, s)).item() for s in range(STEPS)]
        model = make()
        initial = {n: p.detach().clone() for n, p in model.named_parameters()}
        optim = sgd(model)
        compiled = spmd_aot.compile(step, cache_dir=cache, require_hit=True, **options)
        losses = [compiled(model, optim, batch(share, s)).item() for s in range(STEPS)]
        ours = {n: p.full_tensor() if isinstance(p, DTensor) else p for n, p in model.named_parameters()}
        out[name] = {
            "traces": compiled.cache_info.traces,
            "param": max((p.float() - ours[n].float()).abs().max().item() for n, p in ref.named_parameters()),
            "loss": max(abs(a - b) for a, b in zip(ref_losses, losses)),
            # the experts learned (a test of parity on parameters that never moved would prove nothing)
            "experts_moved": min((ours[n] - initial[n]).abs().max().item() for n in initial if ".experts." in n),
            "local_experts": {n: list(p.to_local().shape) for n, p in model.named_parameters()
                              if ".experts." in n and isinstance(p, DTensor)},
        }
    return out


@pytest.fixture(scope="module")
def parity(built):
    by_world = {}
    for name, (world, model, options) in CONFIGS.items():
        by_world.setdefault(world, {})[name] = (built[name][0], model, options)
    return {name: [per_rank[name] for per_rank in run_ranks(_parity_worker, world, cases, timeout=900)]
            for world, cases in by_world.items() for name in cases}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_expert_parallel_matches_the_unsplit_model_under_ddp(parity, name):
    for rank, r in enumerate(parity[name]):
        assert r["traces"] == 0, (name, rank, r)
        tol = TOLS.get(name, TOL)
        assert r["param"] <= tol and r["loss"] <= tol, (name, rank, r)
        assert r["experts_moved"] > 1e-4, (name, rank, r)
        # each rank holds E/ep experts (then its dp_shard half of them under shard)
        assert r["local_experts"] and all(shape[0] in (1, 2) for shape in r["local_experts"].values()), r


# ---------------------------------------------------------------- dropping, Switch/GShard style
def _switch_reference(x, index, weights, experts, factor):
    """One rank's output with each expert taking at most ceil(factor * T * k / E) of its pairs,
    choice-major (every token's first choice before any second), dropped pairs giving zero."""
    tokens, top_k = index.shape
    per_expert = max(1, math.ceil(factor * tokens * top_k / experts.num_experts))
    taken = [0] * experts.num_experts
    out = torch.zeros_like(x)
    dropped = 0
    for j in range(top_k):
        for t in range(tokens):
            e = int(index[t, j])
            if taken[e] >= per_expert:
                dropped += 1
                continue
            taken[e] += 1
            y = F.linear(F.silu(F.linear(x[t], experts.w_in[e])), experts.w_out[e])
            out[t] += weights[t, j] * y
    return out, dropped


def _dropping_worker(rank, world, factor):
    from spmd_aot.parallel.expert_parallel import ExpertParallel
    from spmd_aot.parallel.mesh import device_mesh

    torch.manual_seed(0)
    experts = StackedExperts(8, D, 2 * D)
    whole = {n: p.detach().clone() for n, p in experts.named_parameters()}
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(12, D, generator=g)
    skewed = torch.tensor([4.0, 3.0, 0, 0, 0, 0, 0, 0])  # most tokens prefer experts 0 and 1
    weights, index = (torch.randn(12, 8, generator=g) + skewed).softmax(-1).topk(2, -1)
    plan = Plan(world, "replicate", mesh_shape=(world,), expert_parallel=("experts",),
                expert_capacity_factor=factor)
    holder = nn.ModuleDict({"experts": experts})
    ep = ExpertParallel(holder, plan, device_mesh(plan))
    local = 8 // world
    for n, p in whole.items():  # this rank's experts, as the step's compute tensors would be
        setattr(experts, n, nn.Parameter(p[rank * local:(rank + 1) * local].clone()))
    with torch.no_grad(), ep:
        got = experts(x, index, weights)
    for n, p in whole.items():
        setattr(experts, n, nn.Parameter(p))
    with torch.no_grad():
        want, dropped = _switch_reference(x, index, weights, experts, factor) if factor else \
            (experts(x, index, weights), 0)
    return {"diff": (got - want).abs().max().item(), "dropped": dropped, "exchanges": ep.exchanges,
            "zero_rows": int((got.abs().sum(-1) == 0).sum())}


@pytest.mark.parametrize("factor", [None, 0.5])
def test_a_capacity_factor_drops_pairs_as_switch_and_gshard(factor):
    for rank, r in enumerate(run_ranks(_dropping_worker, 2, factor, timeout=300)):
        assert r["diff"] <= 1e-5, (rank, r)
        assert r["exchanges"] == 2, r  # dispatch and combine (no backward here)
        if factor is None:
            assert r["dropped"] == 0
        else:  # the skewed router overflows experts 0 and 1: pairs are dropped, and counted as zero
            assert r["dropped"] > 0, r

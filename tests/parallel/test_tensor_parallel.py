"""Tensor parallelism, alone (1-D mesh), with FSDP (a (dp_shard, tp) mesh), with HSDP (a
(dp_replicate, dp_shard, tp) mesh) and with DDP (a (dp_replicate, tp) mesh), without and with
sequence parallel: steps built offline, loaded and run on real gloo ranks match eager
``parallelize_module`` (+ ``fully_shard`` per block and on the root over the data-parallel
mesh, or DDP over the replicas) after 5 steps; the stored graphs hold exactly the collectives
TP, sequence parallel, FSDP/HSDP and DDP need."""

from __future__ import annotations

import fnmatch
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import spmd_aot
from spmd_aot.entries import read_artifact
from spmd_aot.examples.models import train_step as step  # the canonical step: token cross-entropy
from spmd_aot.store import LocalStore
from spmd_aot.parallel.tensor_parallel import TP_STYLES
from support.multiproc import run_ranks

STEPS = 5
TOL = 1e-5
VOCAB, D, HEAD_DIM = 32, 16, 4  # 4 heads: 2 per rank at tp=2, 1 at tp=4


# ---------------------------------------------------------------------------- the model
class Attention(nn.Module):
    """Heads from the local tensor (``q.shape[-1] // head_dim``), as TP needs: a rank holds
    ``n_heads / tp`` heads of ``q``, ``k``, ``v`` (colwise) and the matching rows of ``o``'s
    input (rowwise). The sequence length comes from ``q`` too: under sequence parallel the
    input is this rank's sequence shard and ``q`` the gathered sequence."""

    def __init__(self, d, head_dim):
        super().__init__()
        self.head_dim = head_dim
        self.q, self.v, self.o = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        # no key bias: softmax is shift invariant, so its gradient is rounding noise that Adam
        # would turn into lr-sized steps (as the example transformer, which has no qkv bias)
        self.k = nn.Linear(d, d, bias=False)

    def forward(self, x):
        q, k, v = self.q(x), self.k(x), self.v(x)
        b, t, _ = q.shape
        heads = q.shape[-1] // self.head_dim  # this rank's heads
        split = lambda z: z.view(b, t, heads, self.head_dim).transpose(1, 2)  # noqa: E731
        q, k, v = split(q), split(k), split(v)
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        out = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1) @ v
        return self.o(out.transpose(1, 2).reshape(b, t, heads * self.head_dim))


class Block(nn.Module):
    def __init__(self, d, head_dim):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.RMSNorm(d)  # both norms sequence parallel serves
        self.attn = Attention(d, head_dim)
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class TPNet(nn.Module):
    """Embedding, one pre-norm block, final norm, head; the block's linears are planned."""

    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList([Block(D, HEAD_DIM)])
        self.ln_f = nn.LayerNorm(D)
        self.head = nn.Linear(D, VOCAB)

    def forward(self, idx):
        x = self.tok(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


TP_PLAN = {"blocks.*.attn.q": "colwise", "blocks.*.attn.k": "colwise", "blocks.*.attn.v": "colwise",
           "blocks.*.attn.o": "rowwise", "blocks.*.up": "colwise", "blocks.*.down": "rowwise"}
# sequence parallel (torchtitan's plan): the residual stream split on the sequence from the
# embedding's output to the head's input, norms on sequence shards
SP_PLAN = {"tok": "seq_shard_output", "blocks.*.ln1": "sequence_parallel", "blocks.*.ln2": "sequence_parallel",
           **{k: v + "_seq" for k, v in TP_PLAN.items()}, "ln_f": "sequence_parallel", "head": "seq_gather_input"}

OPTIMIZERS = {
    "sgd": lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
    "adamw": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1),
}


def make_batch(dp_rank: int = 0, s: int = 0):
    """One data-parallel share's batch: the TP ranks of a share get the same one."""
    g = torch.Generator().manual_seed(1000 * dp_rank + s)
    return torch.randint(0, VOCAB, (2, 8), generator=g), torch.randint(0, VOCAB, (2, 8), generator=g)


# (placement, mesh shape) per configuration and world size
CONFIGS = {
    2: {"tp": ("replicate", (2,)), "fsdp_tp": ("shard", (1, 2)),  # FSDP over one rank: its code, not its savings
        "sp": ("replicate", (2,))},
    4: {"tp": ("replicate", (4,)), "fsdp_tp": ("shard", (2, 2)), "fsdp_sp": ("shard", (2, 2))},
    # 3-D and DDP x TP meshes (one optimizer: 8 ranks on a small box)
    8: {"hsdp_tp": ("shard", (2, 2, 2)), "ddp_tp": ("replicate", (4, 2))},
}
PLANS = {"tp": TP_PLAN, "fsdp_tp": TP_PLAN, "sp": SP_PLAN, "fsdp_sp": SP_PLAN, "hsdp_tp": TP_PLAN, "ddp_tp": TP_PLAN}
WORLD_OPTIMIZERS = {2: ("sgd", "adamw"), 4: ("sgd", "adamw"), 8: ("adamw",)}


def _options(config, world):
    placement, mesh = CONFIGS[world][config]
    return {"placement": placement, "mesh_shape": mesh if len(mesh) > 1 else None, "tp_plan": PLANS[config]}


def _torch_styles():
    """The torch style equivalent to each spmd-aot style (torchtitan's sequence-parallel plan)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleOutput,
                                                   RowwiseParallel, SequenceParallel)

    return {"colwise": ColwiseParallel, "rowwise": RowwiseParallel,
            "colwise_seq": lambda: ColwiseParallel(input_layouts=Shard(1)),
            "rowwise_seq": lambda: RowwiseParallel(output_layouts=Shard(1)),
            "sequence_parallel": lambda: SequenceParallel(use_local_output=True),
            "seq_shard_output": lambda: PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1),
                                                            use_local_output=True),
            "seq_gather_input": lambda: PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate(),
                                                           use_local_output=True)}


# ---------------------------------------------------------------------------- the ranks
def _roles(config, world):
    placement, shape = CONFIGS[world][config]
    return spmd_aot.Plan(world, placement, mesh_shape=shape, tp_plan=PLANS[config]).mesh_roles


def _eager(config, optim_name, rank, world):
    """The oracle: parallelize_module on the TP mesh, then fully_shard per block and on the root
    over the data-parallel mesh (1-D: FSDP, 2-D: HSDP), or DDP over the replicas (torchtitan's
    order: TP first)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    placement, shape = CONFIGS[world][config]
    roles = _roles(config, world)
    torch.manual_seed(0)
    model = TPNet()
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=roles)
    styles = _torch_styles()
    parallelize_module(model, mesh["tp"], {k: styles[v]() for k, v in PLANS[config].items()})
    dp = tuple(role for role in roles if role.startswith("dp_"))
    if placement == "shard":
        for block in model.blocks:
            fully_shard(block, mesh=mesh[dp])
        fully_shard(model, mesh=mesh[dp])
    elif dp:
        from torch.distributed.tensor.parallel.ddp import _pre_dp_module_transform
        from torch.nn.parallel import DistributedDataParallel

        _pre_dp_module_transform(model)  # DDP averages TP-local gradients over the replicas
        model = DistributedDataParallel(model, process_group=mesh["dp_replicate"].get_group())
    optim = OPTIMIZERS[optim_name](model)
    dp_rank = rank // shape[-1]
    losses = [step(model, optim, make_batch(dp_rank, s)).detach() for s in range(STEPS)]
    return model, optim, losses


def _compiled(config, optim_name, rank, world, cache_dir):
    _, shape = CONFIGS[world][config]
    torch.manual_seed(0)
    model = TPNet()
    optim = OPTIMIZERS[optim_name](model)
    fn = spmd_aot.compile(step, cache_dir=cache_dir, require_hit=True, **_options(config, world))
    dp_rank = rank // shape[-1]
    losses = [fn(model, optim, make_batch(dp_rank, s)).detach() for s in range(STEPS)]
    return model, optim, losses, fn.cache_info


def _local_diffs(ref_model, ref_optim, model, optim, ref_losses, losses) -> dict:
    local = lambda t: (t.to_local() if hasattr(t, "to_local") else t).float()  # noqa: E731
    ours = dict(model.named_parameters())  # by name: localizing re-registers eager's parameters
    params = max((local(a) - local(ours[name])).abs().max().item() for name, a in ref_model.module.named_parameters())
    state = max((local(t) - local(optim.state[ours[name]][k])).abs().max().item()
                for name, a in ref_model.module.named_parameters() for k, t in ref_optim.state[a].items()
                if isinstance(t, torch.Tensor))
    return {"param": params, "state": state, "loss": max((a - b).abs().item() for a, b in zip(ref_losses, losses))}


def _parity_worker(rank, world, cache_dirs):
    from torch.distributed.tensor import DTensor

    from support import features

    out = {}
    for (config, optim_name), cache_dir in cache_dirs.items():
        ref_model, ref_optim, ref_losses = _eager(config, optim_name, rank, world)
        model, optim, losses, info = _compiled(config, optim_name, rank, world, cache_dir)
        q = model.blocks[0].attn.q.weight
        if isinstance(ref_model, torch.nn.parallel.DistributedDataParallel):
            # DDP x TP: eager keeps TP-local plain tensors; compare this rank's TP-local values
            diffs = _local_diffs(ref_model, ref_optim, model, optim, ref_losses, losses)
        else:
            diffs = features.max_diffs(ref_model, ref_optim, model, optim, ref_losses, losses)
        out[config, optim_name] = {
            **diffs,
            "hit": info.hit,
            # after the first call parameters are DTensors placed as the eager oracle's
            "placements": {name: [str(x) for x in p.placements] for name, p in model.named_parameters()
                           if isinstance(p, DTensor)},
            "eager_placements": {name: [str(x) for x in p.placements]  # plain where TP alone leaves them
                                 for name, p in ref_model.named_parameters() if isinstance(p, DTensor)},
            "q_local": tuple(q.to_local().shape),
        }
    return out


# ---------------------------------------------------------------------------- the tests
@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Every configuration built offline once: world -> {(config, optimizer): (cache dir, result)}."""
    out = {}
    for world, configs in CONFIGS.items():
        out[world] = {}
        for config in configs:
            for optim_name in WORLD_OPTIMIZERS[world]:
                cache = str(tmp_path_factory.mktemp(f"tp-{world}-{config}-{optim_name}"))
                job = spmd_aot.Job(step=step, model=TPNet, optimizer=OPTIMIZERS[optim_name], batch=make_batch)
                out[world][config, optim_name] = cache, spmd_aot.build(job, world_size=world, cache_dir=cache,
                                                                       **_options(config, world))
    return out


@pytest.fixture(scope="module")
def parity(built):
    """One launch per world size runs every configuration and optimizer on its ranks."""
    return {world: run_ranks(_parity_worker, world, {k: v[0] for k, v in cases.items()}, timeout=600)
            for world, cases in built.items()}


CASES = [(w, c, o) for w, configs in CONFIGS.items() for c in configs for o in WORLD_OPTIMIZERS[w]]


@pytest.mark.parametrize("world,config,optim_name", CASES)
def test_tp_matches_eager_parallelize_module(parity, built, world, config, optim_name):
    for rank, per_rank in enumerate(parity[world]):
        r = per_rank[config, optim_name]
        assert r["hit"], r
        assert r["param"] <= TOL and r["state"] <= TOL and r["loss"] <= TOL, f"rank {rank}: {r}"
        # planned parameters are placed as eager places them (under FSDP x TP colwise ones are
        # _StridedShard over dp); the others are whole over TP: eager leaves them plain (TP
        # alone) or puts them on the dp mesh only (FSDP x TP)
        ndim = len(CONFIGS[world][config][1])
        for name, placements in r["placements"].items():
            eager = r["eager_placements"].get(name, [])
            owner, _, attr = name.rpartition(".")
            style = next((s for p, s in PLANS[config].items() if fnmatch.fnmatchcase(owner, p)), None)
            if CONFIGS[world][config][0] == "replicate" and ndim == 2:  # DDP x TP: eager's are plain
                dim = TP_STYLES[style].param_dims.get(attr) if style else None
                assert placements == ["R", "R" if dim is None else f"S({dim})"], (name, placements)
            elif len(eager) == ndim:
                assert placements == eager, (name, placements, eager)
            else:
                split = any(fnmatch.fnmatchcase(name.rpartition(".")[0], p) for p, style in PLANS[config].items()
                            if any(d is not None for d in TP_STYLES[style].param_dims.values()))
                assert placements == eager + ["R"] and not split, (name, placements, eager)
        plan = spmd_aot.Plan(world, CONFIGS[world][config][0], mesh_shape=CONFIGS[world][config][1], tp_plan=TP_PLAN)
        assert r["q_local"] == (D // (plan.size("tp") * plan.size("dp_shard")), D)  # split over TP and dp_shard


def _collectives(cache, result):
    art = read_artifact(LocalStore(cache), result.digest)
    return [(e["collective"], e["group"], e["label"]) for e in art.schema["nodes"].values() if "collective" in e]


# per block, TP alone: attention input (q, k, v share one copy) and mlp input gradients in
# backward, attention and mlp outputs in forward: 4 all_reduces over the TP dimension
TP_COLLECTIVES = [("all_reduce", "tp blocks.0.attn.q input gradient"), ("all_reduce", "tp blocks.0.attn.o output"),
                  ("all_reduce", "tp blocks.0.up input gradient"), ("all_reduce", "tp blocks.0.down output")]
# sequence parallel: each of those all_reduces becomes a reduce_scatter and an all_gather
# (q, k, v share one gather); one all_reduce per norm for its parameters' gradients; the
# entry (tok) and exit (head) cut and gather the sequence
SP_COLLECTIVES = [
    ("reduce_scatter_tensor", "tp tok output"), ("all_gather_into_tensor", "tp tok output gradient"),
    ("all_gather_into_tensor", "tp blocks.0.attn.q input"), ("reduce_scatter_tensor", "tp blocks.0.attn.q input gradient"),
    ("reduce_scatter_tensor", "tp blocks.0.attn.o output"), ("all_gather_into_tensor", "tp blocks.0.attn.o output gradient"),
    ("all_gather_into_tensor", "tp blocks.0.up input"), ("reduce_scatter_tensor", "tp blocks.0.up input gradient"),
    ("reduce_scatter_tensor", "tp blocks.0.down output"), ("all_gather_into_tensor", "tp blocks.0.down output gradient"),
    ("all_gather_into_tensor", "tp head input"), ("reduce_scatter_tensor", "tp head input gradient"),
    ("all_reduce", "tp blocks.0.ln1 parameter gradients"), ("all_reduce", "tp blocks.0.ln2 parameter gradients"),
    ("all_reduce", "tp ln_f parameter gradients")]


@pytest.mark.parametrize("world,config", [(w, c) for w, configs in CONFIGS.items() for c in configs])
def test_stored_graph_has_exactly_the_collectives_tp_and_fsdp_need(built, world, config):
    cache, result = built[world][config, "adamw"]
    by_kind = result.stats["by_kind"]
    found = _collectives(cache, result)
    roles = _roles(config, world)
    tp = [c for c in found if (c[2] or "").startswith("tp ")]
    assert {group for _, group, _ in tp} == {roles.index("tp")}
    assert sorted((kind, label) for kind, _, label in tp) == sorted(
        SP_COLLECTIVES if config.endswith("sp") else TP_COLLECTIVES)
    dp = sorted((kind, group) for kind, group, label in found if not (label or "").startswith("tp "))
    if "dp_shard" in roles:
        # FSDP over dp_shard: the block gathered in forward and again in backward, the root
        # once; one reduce_scatter each, and under HSDP one all_reduce of each over the replicas;
        # no gradient averaging over TP
        shard, replicas = roles.index("dp_shard"), [("all_reduce", 0)] * 2 if "dp_replicate" in roles else []
        assert dp == sorted(replicas + [("all_gather_into_tensor", shard)] * 3 + [("reduce_scatter_tensor", shard)] * 2)
    elif "dp_replicate" in roles:
        # DDP x TP: the gradients' all_reduces over the replicas packed into DDP's buckets (fewer
        # collectives than gradients), none over TP
        grads = sum(1 for _ in TPNet().parameters())
        assert set(dp) == {("all_reduce", roles.index("dp_replicate"))} and 0 < len(dp) < grads, (dp, grads)
    else:
        assert dp == []
    assert sum(by_kind.values()) == len(found)


def test_show_prints_the_tp_plan_and_the_tp_collectives(built, capsys):
    from spmd_aot.cli.app import main

    cache, result = built[4]["fsdp_tp", "adamw"]
    assert main(["show", result.digest, "--cache-dir", cache]) == 0
    out = capsys.readouterr().out
    assert "world=4 mesh=2x2 shard tp=2 cpu" in out and "['blocks.*.attn.q', 'colwise']" in out
    # the shared copy of the attention input serves q, k and v: one all_reduce names all three
    row = next(line for line in out.splitlines() if "tp blocks.0.attn.q input gradient" in line)
    assert "3: blocks.0.attn.q.weight, blocks.0.attn.k.weight, blocks.0.attn.v.weight" in row


def test_plans_tp_cannot_serve_are_refused():
    """What a build refuses before tracing: patterns naming no module, a style on a module it
    cannot split, a split dimension that does not divide by the TP size."""
    from spmd_aot.parallel.tensor_parallel import planned_modules

    with pytest.raises(spmd_aot.UnsupportedError, match="match no module"):
        planned_modules(TPNet(), (("blocks.*.attn.query", "colwise"),))
    with pytest.raises(spmd_aot.UnsupportedError, match="nn.Linear modules"):
        planned_modules(TPNet(), (("blocks.*.ln1", "colwise"),))
    tied = TPNet()
    tied.head.weight = tied.tok.weight
    with pytest.raises(spmd_aot.UnsupportedError, match="tied to tok.weight"):
        planned_modules(tied, (("head", "colwise"),))
    with pytest.raises(spmd_aot.SpmdAotError, match=r"head.weight of shape \[32, 16\] cannot be split colwise over 3"):
        spmd_aot.Plan(3, tp_plan={"head": "colwise"}).layout_for("head.weight", (32, 16))
    with pytest.raises(spmd_aot.UnsupportedError, match="nn.LayerNorm and nn.RMSNorm"):
        planned_modules(TPNet(), (("head", "sequence_parallel"),))


@pytest.mark.parametrize("world,plan,message", [
    # a norm on sequence shards needs the entry that cuts the sequence
    (2, {k: v for k, v in SP_PLAN.items() if k != "tok"}, "no module planned seq_shard_output ran before it"),
    # a norm left out: its gradients would be partial over TP
    (2, {k: v for k, v in SP_PLAN.items() if k != "blocks.*.ln2"}, "blocks.0.ln2 .RMSNorm. has parameters and runs"),
    # plain TP styles on sequence shards would add up different ranks' tokens
    (2, {**SP_PLAN, "blocks.*.up": "colwise", "blocks.*.down": "rowwise"}, "plan it colwise_seq"),
    (3, {"tok": "seq_shard_output", "ln_f": "sequence_parallel", "head": "seq_gather_input"},
     r"dim 1 \(the sequence\) divides by the TP size 3"),
], ids=["no-entry", "norm-left-out", "plain-styles-on-shards", "sequence-not-divisible"])
def test_sequence_parallel_plans_that_cannot_hold_are_refused_at_build(tmp_path, world, plan, message):
    job = spmd_aot.Job(step=step, model=TPNet, optimizer=OPTIMIZERS["sgd"], batch=make_batch)
    with pytest.raises(spmd_aot.UnsupportedError, match=message):
        spmd_aot.build(job, world_size=world, cache_dir=str(tmp_path), tp_plan=plan)

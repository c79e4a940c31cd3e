"""transformers' tensor-parallel plans as they are: their style names mapped to ours or refused by
name, base-model-relative patterns resolved, ``tp_plan="hf"``; and the styles those plans need
beyond colwise/rowwise (gathered outputs, split inputs, a column-split embedding, per-head norms
whose gradients are summed over TP) trained at world 2 against plain eager on the same batch
(TP alone: every rank sees the whole batch, so the unsplit model is the oracle)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import spmd_aot
from support.multiproc import run_ranks
from spmd_aot.errors import SpmdAotError, UnsupportedError
from spmd_aot.parallel.plan import Plan
from spmd_aot.parallel.tp_plan import HF_REFUSED_STYLES, resolve_tp_plan

STEPS = 3
TOL = 1e-5
HEAD = 4


class HeadNorm(nn.Module):
    """RMS norm over each head's features with one weight per feature (Qwen3's q_norm)."""

    def __init__(self, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class Net(nn.Module):
    def __init__(self, vocab=32, d=16):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.qkv = nn.Linear(d, 3 * d)
        self.q = nn.Linear(d, d)
        self.q_norm = HeadNorm(HEAD)
        self.o = nn.Linear(d, d)
        self.up = nn.Linear(d, 2 * d)
        self.down = nn.Linear(2 * d, d)
        self.head = nn.Linear(d, vocab)

    def forward(self, x):
        h = self.emb(x)
        q, k, v = self.qkv(h).chunk(3, dim=-1)  # a packed projection: needs its whole output
        # sigmoid, not softmax: softmax makes k's bias gradient zero up to rounding, which AdamW
        # turns into lr-sized steps (the parity floor), and this test compares parameters
        h = h + torch.sigmoid(q @ k.transpose(-1, -2)) @ v
        local = self.q(h)  # this rank's heads
        b, t, _ = local.shape
        h = h + self.o(self.q_norm(local.view(b, t, -1, HEAD)).view(b, t, -1))
        h = h + self.down(F.gelu(self.up(h)))
        return self.head(h)


PLAN = {"emb": "embedding_colwise", "qkv": "colwise_gather_output", "q": "colwise",
        "q_norm": "replicated_with_grad_allreduce", "o": "rowwise", "up": "colwise_rep",
        "down": "rowwise_rep"}


def step(model, optim, batch):
    x, y = batch
    loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def make_model():
    torch.manual_seed(0)
    return Net()


OPTIMS = {"sgd": lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
          "adamw": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2)}


def make_batch(s=0):
    g = torch.Generator().manual_seed(s)
    return torch.randint(0, 32, (2, 8), generator=g), torch.randint(0, 32, (2, 8), generator=g)


def _worker(rank, world, cache, optim_name):
    ref = make_model()
    ref_optim = OPTIMS[optim_name](ref)
    ref_losses = [step(ref, ref_optim, make_batch(s)).item() for s in range(STEPS)]
    model = make_model()
    optim = OPTIMS[optim_name](model)
    compiled = spmd_aot.compile(step, cache_dir=cache, tp_plan=PLAN, require_hit=True)
    losses = [compiled(model, optim, make_batch(s)).item() for s in range(STEPS)]
    full = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in model.state_dict().items()}
    return {"traces": compiled.cache_info.traces,
            "param": max((full[k] - v).abs().max().item() for k, v in ref.state_dict().items()),
            "per": {k: (full[k] - v).abs().max().item() for k, v in ref.state_dict().items()},
            "qkvb": (full["qkv.bias"] - ref.qkv.bias).abs().view(3, -1).max(1).values.tolist(),
            "loss": max(abs(a - b) for a, b in zip(ref_losses, losses))}


@pytest.mark.parametrize("optim_name", ["sgd", "adamw"])
def test_hf_styles_match_the_unsplit_model(tmp_path, optim_name):
    job = spmd_aot.Job(step=step, model=make_model, optimizer=OPTIMS[optim_name], batch=make_batch)
    built = spmd_aot.build(job, world_size=2, tp_plan=PLAN, cache_dir=tmp_path)
    by_kind = built.stats["by_kind"]
    # per call: qkv, up: copy-in all_reduce + gather + cut; q: copy-in; q_norm: gradient sum;
    # o, down: output all_reduce (down also cuts its input and gathers the gradient); emb: gather + cut
    assert by_kind == {"all_reduce": 6, "all_gather_into_tensor": 4, "reduce_scatter_tensor": 4}, by_kind
    for r in run_ranks(_worker, 2, str(tmp_path), optim_name):
        assert r["traces"] == 0, r
        assert r["param"] <= TOL and r["loss"] <= TOL, ({k: v for k, v in r["per"].items() if v > TOL}, r["qkvb"])


def test_hf_style_names_map_to_ours_and_keep_the_key():
    ours = Plan(2, tp_plan={"up": "colwise_gather_output", "down": "rowwise_split_input"})
    theirs = Plan(2, tp_plan={"up": "colwise_rep", "down": "rowwise_rep"})
    assert ours.to_dict() == theirs.to_dict()


@pytest.mark.parametrize("style", sorted(HF_REFUSED_STYLES))
def test_refused_hf_styles_say_why_and_what_to_use(style):
    with pytest.raises(SpmdAotError, match=f"transformers' style '{style}'.*refuses"):
        Plan(2, tp_plan={"layers.*.mlp": style})


def test_base_model_relative_patterns_and_the_models_own_plan():
    class Inner(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 4)) for _ in range(2)])

    class Config:
        base_model_tp_plan = {"layers.*.0": "colwise", "layers.*.1": "rowwise"}

    class ForLM(nn.Module):
        base_model_prefix = "model"

        def __init__(self):
            super().__init__()
            self.model, self.config, self.lm_head = Inner(), Config(), nn.Linear(4, 4)

    model = ForLM()
    expected = (("model.layers.*.0", "colwise"), ("model.layers.*.1", "rowwise"))
    assert resolve_tp_plan(tuple(Config.base_model_tp_plan.items()), model) == expected
    assert Plan(2, tp_plan="hf").for_model(model).tp_plan == expected
    assert Plan(2, tp_plan="auto").for_model(model).tp_plan == expected
    # a pattern already written from the root stays as it is
    assert resolve_tp_plan((("lm_head", "colwise"),), model) == (("lm_head", "colwise"),)
    with pytest.raises(UnsupportedError, match="has none"):
        Plan(2, tp_plan="hf").for_model(nn.Linear(2, 2))


# ---------------------------------------------------------------- embedding_rowwise
class EmbNet(nn.Module):
    """An embedding split on the vocabulary, a padding id among the inputs, a whole head."""

    def __init__(self, vocab=32, d=16):
        super().__init__()
        self.emb = nn.Embedding(vocab, d, padding_idx=3)
        self.head = nn.Linear(d, vocab)

    def forward(self, x):
        return self.head(torch.tanh(self.emb(x)))


def make_emb_model():
    torch.manual_seed(0)
    model = EmbNet()
    with torch.no_grad():
        model.emb.weight[3] = 0.5  # a non-zero padding row: its value is read, it gets no gradient
    return model


def make_emb_batch(s=0):
    x, y = make_batch(s)
    x[:, 0] = 3  # the padding id, on the first rank's share of the vocabulary
    return x, y


EMB_PLAN = {"emb": "embedding_rowwise"}


def _rowwise_worker(rank, world, cache):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module

    # as torchtitan plans its token embedding: the ids whole on every rank
    ref = parallelize_module(make_emb_model(), init_device_mesh("cpu", (world,)),
                             {"emb": RowwiseParallel(input_layouts=Replicate())})
    ref_optim = OPTIMS["adamw"](ref)
    ref_losses = [step(ref, ref_optim, make_emb_batch(s)).item() for s in range(STEPS)]
    model = make_emb_model()
    optim = OPTIMS["adamw"](model)
    compiled = spmd_aot.compile(step, cache_dir=cache, tp_plan=EMB_PLAN, require_hit=True)
    losses = [compiled(model, optim, make_emb_batch(s)).item() for s in range(STEPS)]

    def whole(t):
        return t.full_tensor() if hasattr(t, "full_tensor") else t

    plain = make_emb_model()  # the unsplit model on the same batches (TP ranks share theirs)
    plain_optim = OPTIMS["adamw"](plain)
    for s in range(STEPS):
        step(plain, plain_optim, make_emb_batch(s))
    ours, theirs = model.state_dict(), ref.state_dict()
    return {"local_rows": model.emb.weight.to_local().shape[0], "traces": compiled.cache_info.traces,
            "param": max((whole(ours[k]) - whole(v)).abs().max().item() for k, v in theirs.items()),
            "plain": max((whole(ours[k]) - v).abs().max().item() for k, v in plain.state_dict().items()),
            "pad_row": (whole(ours["emb.weight"])[3] - 0.5 * (1 - 1e-2 * 1e-2) ** STEPS).abs().max().item(),
            "loss": max(abs(a - b) for a, b in zip(ref_losses, losses))}


def test_embedding_rowwise_matches_parallelize_module_rowwise(tmp_path):
    job = spmd_aot.Job(step=step, model=make_emb_model, optimizer=OPTIMS["adamw"], batch=make_emb_batch)
    built = spmd_aot.build(job, world_size=2, tp_plan=EMB_PLAN, cache_dir=tmp_path)
    # the partial lookups all_reduced; this rank's TP index cut from arange(tp) once
    assert built.stats["by_kind"] == {"all_reduce": 1, "reduce_scatter_tensor": 1}, built.stats["by_kind"]
    for r in run_ranks(_rowwise_worker, 2, str(tmp_path)):
        assert r["traces"] == 0 and r["local_rows"] == 16, r
        assert r["param"] <= TOL and r["loss"] <= TOL and r["plain"] <= TOL, r
        assert r["pad_row"] <= 1e-7, r  # the padding row got no gradient (AdamW's decay only)


@pytest.mark.parametrize("option", [{"max_norm": 1.0}, {"scale_grad_by_freq": True}, {"sparse": True}])
def test_embedding_rowwise_refuses_what_a_vocabulary_shard_cannot_do(tmp_path, option):
    def model():
        torch.manual_seed(0)
        net = EmbNet()
        net.emb = nn.Embedding(32, 16, **option)
        return net

    job = spmd_aot.Job(step=step, model=model, optimizer=OPTIMS["sgd"], batch=make_batch)
    name = next(iter(option))
    with pytest.raises(UnsupportedError, match=f"emb .*{name}=.*embedding_rowwise.*'embedding_colwise'"):
        spmd_aot.build(job, world_size=2, tp_plan=EMB_PLAN, cache_dir=tmp_path)


# ---------------------------------------------------------------- transformers models' own plans
def _sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _hf_job(name):
    from support import corpus

    return spmd_aot.Job(step=corpus.hf_step, model=corpus.factory(name), optimizer=_sgd,
                        batch=lambda: corpus.lm_batch(0, 0))


def corpus_model(name):
    from support import corpus

    return corpus.factory(name)()


def _hf_worker(rank, world, cache, name):
    from support import corpus

    corpus._quiet_transformers()
    ref = corpus.factory(name)()
    ref_optim = _sgd(ref)
    ref_losses = [corpus.hf_step(ref, ref_optim, corpus.lm_batch(0, s)).item() for s in range(STEPS)]
    model = corpus.factory(name)()
    optim = _sgd(model)
    compiled = spmd_aot.compile(corpus.hf_step, cache_dir=cache, tp_plan="hf", require_hit=True)
    losses = [compiled(model, optim, corpus.lm_batch(0, s)).item() for s in range(STEPS)]
    full = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in model.state_dict().items()}
    return {"traces": compiled.cache_info.traces,
            "param": max((full[k] - v).abs().max().item() for k, v in ref.state_dict().items()),
            "loss": max(abs(a - b) for a, b in zip(ref_losses, losses))}


# GPT-NeoX: its plan splits the input embedding on the vocabulary (embedding_rowwise).
# Qwen2-MoE: its plan names the dense MLP's projections, which its sparse blocks do not have
# (skipped, as transformers skips them); its experts run transformers' default grouped_mm.
HF_MODELS = {"gpt_neox": ({"all_reduce": 9, "reduce_scatter_tensor": 1}, None),
             "qwen2_moe": ({"all_reduce": 4}, ["layers.*.mlp.gate_proj", "layers.*.mlp.up_proj",
                                               "layers.*.mlp.down_proj"])}


@pytest.mark.parametrize("name", sorted(HF_MODELS))
def test_a_transformers_models_own_plan_matches_the_unsplit_model(tmp_path, caplog, monkeypatch, name):
    from spmd_aot.parallel import tp_plan

    by_kind, skipped = HF_MODELS[name]
    monkeypatch.setattr(tp_plan, "_WARNED", set())  # the warning is logged once per process
    with caplog.at_level("WARNING", logger="spmd_aot.parallel.tp_plan"):
        built = spmd_aot.build(_hf_job(name), world_size=2, tp_plan="hf", cache_dir=tmp_path)
    assert built.stats["by_kind"] == by_kind
    assert built.stats.get("tp_plan_skipped") == skipped
    warned = [r.getMessage() for r in caplog.records if "does not have, skipped" in r.getMessage()]
    assert (warned and all(p in warned[0] for p in skipped)) if skipped else not warned, warned
    for r in run_ranks(_hf_worker, 2, str(tmp_path), name):
        assert r["traces"] == 0, r
        assert r["param"] <= TOL and r["loss"] <= TOL, r
    caplog.clear()
    with caplog.at_level("WARNING", logger="spmd_aot.parallel.tp_plan"):
        Plan(2, tp_plan="hf").for_model(corpus_model(name))  # a job binding the plan again: no repeat
    assert not caplog.records


def test_a_written_plan_naming_a_missing_module_is_refused_pointing_at_hf(tmp_path):
    """A plan the user wrote keeps every pattern: one that matches nothing is a typo until
    shown otherwise. When the patterns are the model's own plan's, the error says so."""
    from support import corpus

    own = corpus.tp_plan("qwen2_moe")
    with pytest.raises(UnsupportedError, match=r"layers\.\*\.mlp\.gate_proj.*match no module.*tp_plan='hf'"):
        spmd_aot.build(_hf_job("qwen2_moe"), world_size=2, tp_plan=own, cache_dir=tmp_path)
    with pytest.raises(UnsupportedError, match="match no module") as typo:
        spmd_aot.build(_hf_job("qwen2_moe"), world_size=2, tp_plan={"layers.*.self_attn.q_prj": "colwise"},
                       cache_dir=tmp_path)
    assert "'hf'" not in str(typo.value)


def test_a_models_own_plan_matching_nothing_is_refused():
    class Config:
        base_model_tp_plan = {"layers.*.missing": "colwise"}

    model = nn.Linear(2, 2)
    model.config = Config()
    with pytest.raises(UnsupportedError, match=r"none of the patterns.*layers\.\*\.missing"):
        Plan(2, tp_plan="hf").for_model(model)


def _fsdp_tp_worker(rank, world, cache):
    from support import corpus

    corpus._quiet_transformers()
    dp = rank // 2  # mesh (dp_shard 2, tp 2): TP ranks of one share see the same batch
    ref = corpus.factory("gpt_neox")()
    ref_optim = _sgd(ref)
    ref_losses = []
    for s in range(STEPS):  # the unsplit model on both shares' batches, gradients averaged (as DDP)
        losses = [ref(**corpus.lm_batch(d, s)).loss for d in range(2)]
        (sum(losses) / 2).backward()
        ref_optim.step()
        ref_optim.zero_grad()
        ref_losses.append(losses[dp].item())
    model = corpus.factory("gpt_neox")()
    optim = _sgd(model)
    compiled = spmd_aot.compile(corpus.hf_step, cache_dir=cache, placement="shard", mesh_shape=(2, 2), tp_plan="hf",
                                require_hit=True)
    losses = [compiled(model, optim, corpus.lm_batch(dp, s)).item() for s in range(STEPS)]
    full = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in model.state_dict().items()}
    return {"traces": compiled.cache_info.traces,
            "param": max((full[k] - v).abs().max().item() for k, v in ref.state_dict().items()),
            "loss": max(abs(a - b) for a, b in zip(ref_losses, losses))}


def test_embedding_rowwise_under_fsdp_x_tp_matches_the_unsplit_model(tmp_path):
    """GPT-NeoX's own plan on a (dp_shard 2, tp 2) mesh: the vocabulary split over TP, that
    split sharded again over dp_shard."""
    built = spmd_aot.build(_hf_job("gpt_neox"), world_size=4, placement="shard", mesh_shape=(2, 2), tp_plan="hf",
                           cache_dir=tmp_path)
    assert built.stats["by_kind"]["reduce_scatter_tensor"] >= 1
    for r in run_ranks(_fsdp_tp_worker, 4, str(tmp_path), timeout=400):
        assert r["traces"] == 0, r
        assert r["param"] <= TOL and r["loss"] <= TOL, r

"""Forward-only steps (evaluation, inference) and the ``SPMD`` module wrapper: built offline,
loaded with ``require_hit=True`` on real gloo ranks, matching eager DDP / FSDP2 outputs."""

from __future__ import annotations

import io
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Partial, Replicate, Shard

import spmd_aot
from spmd_aot.building.builder import job_key
from spmd_aot.cli.app import main
from spmd_aot.examples.models import train_step
from support.multiproc import run_ranks

TOL = 1e-5


def make_model():
    """Blocks of a Sequential: under shard each is a group, so eval gathers once per group."""
    return nn.Sequential(nn.Linear(12, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 5))


def make_optim(model):
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def eval_step(model, batch):
    x, y = batch
    logits = model(x)
    return F.cross_entropy(logits, y), logits


def batch(rank=0, step=0):
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(4, 12, generator=g), torch.randint(0, 5, (4,), generator=g)


EVAL_JOB = spmd_aot.Job(step=eval_step, model=lambda: make_model().eval(), optimizer=None, batch=batch)
TRAIN_JOB = spmd_aot.Job(step=train_step, model=make_model, optimizer=make_optim, batch=batch)


class TokenNet(nn.Module):
    """For the SPMD wrapper: tokens (batch, seq, 12) and a context vector added to every token."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(12, 16)
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, 5)

    def forward(self, tokens, context):
        return self.head(self.norm(torch.relu(self.fc(tokens))) + context)


def global_inputs():
    g = torch.Generator().manual_seed(7)
    return torch.randn(4, 12, 12, generator=g), torch.randn(16, generator=g)


SPMD_PLACEMENTS = (Shard(1), Replicate())  # tokens split along the sequence, context whole
SPMD_JOB = spmd_aot.SPMD.job(model=lambda: TokenNet().eval(), inputs=global_inputs,
                             input_placements=SPMD_PLACEMENTS)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """One cache: eval and train jobs via spmd_aot.build, the SPMD job via the CLI."""
    cache = str(tmp_path_factory.mktemp("forward-only"))
    stats = {}
    for world, placement in [(1, "replicate"), (2, "replicate"), (2, "shard")]:
        stats["eval", world, placement] = spmd_aot.build(EVAL_JOB, world_size=world, placement=placement,
                                                         cache_dir=cache).stats["by_kind"]
    for placement in ("replicate", "shard"):
        stats["train", 2, placement] = spmd_aot.build(TRAIN_JOB, world_size=2, placement=placement,
                                                      cache_dir=cache).stats["by_kind"]
    stats["eval", 4, "hsdp"] = spmd_aot.build(EVAL_JOB, world_size=4, placement="shard", mesh_shape=(2, 2),
                                              cache_dir=cache).stats["by_kind"]
    out = io.StringIO()
    saved, sys.stdout = sys.stdout, out
    try:
        rc = main(["build", "test_forward_only:SPMD_JOB", "-w", "1", "-w", "2", "-p", "replicate",
                   "-p", "shard", "--cache-dir", cache])
    finally:
        sys.stdout = saved
    assert rc == 0, out.getvalue()
    return cache, stats


def test_forward_only_graphs_have_no_reductions(built):
    _, stats = built
    assert stats["eval", 1, "replicate"] == {}
    # replicate: DDP's broadcast_buffers (BatchNorm's three buffers), nothing else
    assert stats["eval", 2, "replicate"] == {"broadcast": 3}
    # shard: one all_gather per group (two Linears and the BatchNorm), no re-gather, no reduce_scatter
    assert stats["eval", 2, "shard"] == {"all_gather_into_tensor": 3}
    assert stats["eval", 4, "hsdp"] == {"all_gather_into_tensor": 3}  # nothing over the replica dim
    assert stats["train", 2, "shard"]["reduce_scatter_tensor"] == 3  # the train step reduces


def test_key_ignores_callers_grad_mode_only_for_forward_only_steps():
    plan = spmd_aot.Plan(2, "replicate")
    eval_key, train_key = job_key(EVAL_JOB, plan).key, job_key(TRAIN_JOB, plan).key
    with torch.no_grad():
        assert job_key(EVAL_JOB, plan).key == eval_key  # traced under no_grad either way
        assert job_key(TRAIN_JOB, plan).key != train_key
    with torch.inference_mode():
        assert job_key(EVAL_JOB, plan).key == eval_key
    assert eval_key != train_key


def test_world1_eval_step_and_spmd_wrapper_hit_and_match_eager(built):
    cache, _ = built
    torch.manual_seed(0)
    model = make_model().eval()
    params = [p.detach().clone() for p in model.state_dict().values()]
    step = spmd_aot.compile(eval_step, cache_dir=cache, require_hit=True)
    b = batch()
    with torch.inference_mode():  # any caller mode: the step runs without autograd
        loss, logits = step(model, b)
    ref_loss, ref_logits = eval_step(model, b)
    assert step.cache_info.hit and step.cache_info.source == "cache"
    assert (loss - ref_loss).abs().item() <= TOL and (logits - ref_logits).abs().max().item() <= TOL
    assert all(torch.equal(a, b) for a, b in zip(params, model.state_dict().values()))
    assert not step(model, b)[0].requires_grad

    module = TokenNet().eval()
    wrapper = spmd_aot.SPMD(module, input_placements=SPMD_PLACEMENTS, cache_dir=cache, require_hit=True)
    with torch.no_grad():
        out = wrapper(*global_inputs())
    assert wrapper.cache_info.hit
    assert (out - module(*global_inputs())).abs().max().item() <= TOL


def test_forward_only_misuse_is_refused_with_clear_errors(built, tmp_path):
    cache, _ = built

    def backward_step(model, batch):
        loss = model(batch[0]).sum()
        loss.backward()
        return loss

    with pytest.raises(spmd_aot.UnsupportedError, match="forward-only"):
        spmd_aot.build(spmd_aot.Job(step=backward_step, model=make_model, optimizer=None, batch=batch),
                       world_size=1, cache_dir=tmp_path)

    def norm_step(model, batch):  # the parameters' norms need all_reduces: no forward-only budget has them
        return model(batch[0]).sum() + sum(p.norm() for p in model.parameters())

    with pytest.raises(spmd_aot.UnsupportedError, match="all_reduce collectives where a forward-only step"):
        spmd_aot.build(spmd_aot.Job(step=norm_step, model=lambda: make_model().eval(), optimizer=None, batch=batch),
                       world_size=2, placement="shard", cache_dir=tmp_path)
    step = spmd_aot.compile(eval_step, cache_dir=cache)
    with pytest.raises(TypeError, match="step\\(model, batch\\)"):
        step(make_model(), None, batch())
    with pytest.raises(spmd_aot.SpmdAotError, match="Replicate"):
        spmd_aot.SPMD(TokenNet(), input_placements=(Partial(),))
    with pytest.raises(spmd_aot.SpmdAotError, match="not both"):
        spmd_aot.Job(step=eval_step, model=make_model, optimizer=None, batch=batch, global_batch=True,
                     batch_placements=(Shard(0), Shard(0)))
    wrapper = spmd_aot.SPMD(TokenNet().eval(), input_placements=SPMD_PLACEMENTS, cache_dir=cache)
    with pytest.raises(TypeError, match="one placement per positional input"):
        wrapper(global_inputs()[0])
    with pytest.raises(spmd_aot.UnsupportedError, match="torch.no_grad"):
        wrapper(*global_inputs())  # autograd on: the wrapper would return a detached output


# ---------------------------------------------------------------------------- world 2
def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _eager(placement, world, model):
    if placement == "replicate":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    return model


def _eval_and_train(rank, world, cache, placement):
    """Eval first (before any training: under shard it shards the model the train step then
    uses), then train and eval alternating on one model, against eager DDP / FSDP2; the last
    eval is a second compiled eval step, which must not take rank 0's values again (under
    shard each rank keeps its own BatchNorm statistics, as FSDP2 does)."""
    torch.manual_seed(0)
    ref = make_model()
    wrapped = _eager(placement, world, ref)
    ref_optim = make_optim(ref)
    torch.manual_seed(0)
    model = make_model()
    optim = make_optim(model)
    train = spmd_aot.compile(train_step, placement=placement, cache_dir=cache, require_hit=True)
    evaluate = spmd_aot.compile(eval_step, placement=placement, cache_dir=cache, require_hit=True)
    out = {"eval": 0.0, "train": 0.0, "buffers": 0.0, "params_kept": True}
    for s in range(3):
        b = batch(rank, s)
        if s:
            wrapped.train()
            model.train()
            out["train"] = max(out["train"], (train_step(wrapped, ref_optim, b) - train(model, optim, b)).abs().item())
        wrapped.eval()
        model.eval()
        with torch.no_grad():
            ref_out = eval_step(wrapped, b)
        if s == 2:
            evaluate = spmd_aot.compile(eval_step, placement=placement, cache_dir=cache, require_hit=True)
        before = [_full(p).detach().clone() for p in model.parameters()]
        got = evaluate(model, b)
        after = [_full(p) for p in model.parameters()]  # every rank gathers, whatever it finds
        out["params_kept"] &= all(torch.equal(a, b) for a, b in zip(before, after))
        out["eval"] = max([out["eval"]] + [(a - g).abs().max().item() for a, g in zip(ref_out, got)])
        # BatchNorm statistics: rank 0's under replicate (DDP syncs them), each rank's own under shard
        out["buffers"] = max(out["buffers"], max((a - b).abs().max().item()
                                                 for a, b in zip(ref.buffers(), model.buffers())))
    out["hits"] = [train.cache_info.hit, evaluate.cache_info.hit]
    return out


def _spmd(rank, world, cache, placement):
    torch.manual_seed(0)
    wrapped = _eager(placement, world, TokenNet().eval())
    torch.manual_seed(0)
    wrapper = spmd_aot.SPMD(TokenNet().eval(), schema=spmd_aot.Schema(placement),
                            input_placements=SPMD_PLACEMENTS, cache_dir=cache, require_hit=True)
    tokens, context = global_inputs()
    local = (tokens.chunk(world, dim=1)[rank], context)
    with torch.no_grad():
        diff = (wrapped(*local) - wrapper(*local)).abs().max().item()
    return {"diff": diff, "hit": wrapper.cache_info.hit,
            "sharded": type(wrapper.module.fc.weight).__name__ == "DTensor"}


def _world2_worker(rank, world, cache):
    return {placement: {"step": _eval_and_train(rank, world, cache, placement),
                        "spmd": _spmd(rank, world, cache, placement)}
            for placement in ("replicate", "shard")}


def test_world2_eval_steps_and_spmd_wrapper_match_eager_ddp_and_fsdp2(built):
    cache, _ = built
    for per_rank in run_ranks(_world2_worker, 2, cache):
        for placement, r in per_rank.items():
            step, spmd = r["step"], r["spmd"]
            assert step["hits"] == [True, True], (placement, step)
            assert step["eval"] <= TOL and step["train"] <= TOL and step["buffers"] <= TOL, (placement, step)
            assert step["params_kept"], (placement, step)
            assert spmd["hit"] and spmd["diff"] <= TOL, (placement, spmd)
            assert spmd["sharded"] == (placement == "shard")

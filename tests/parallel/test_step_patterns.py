"""Optimizer patterns users bring, compiled and run on 2 real gloo ranks against eager DDP
(``replicate``) and FSDP2 ``fully_shard`` (``shard``), same seeds and batches:

* frozen parameters (``requires_grad=False``) inside the optimizer's param groups get no state,
  as in eager, so ``optim.state_dict()`` has eager's keys and checkpoints interchange;
* schedulers that move hyperparameters other than the learning rate (OneCycleLR cycles AdamW's
  betas and SGD's momentum) run from one stored step: a fresh start hits, traces nothing, and
  every step uses the moved value;
* ``torch.optim.Adafactor``: built, hit and run like AdamW (its update runs on tensors while
  tracing), or refused in one line where it cannot be;
* the rest of torch's optimizers and step shapes users write (``ZOO``, one build per placement
  in the same launch): NAdam, ASGD and Rprop (state that starts at other values than zero),
  Adamax and centered-momentum RMSprop (their updates' ops), plain SGD (no state, as in eager),
  ``clip_grad_value_``, ``clip_grad_norm_`` with ``norm_type=inf`` returned from the step, and
  parameters unfrozen between steps (the step resolves again and trains them).
"""

from __future__ import annotations

import re

import pytest
import torch

import spmd_aot
from support import train_steps
from support.multiproc import run_ranks

STEPS = 5
TOLERANCE = 1e-5


# ---------------------------------------------------------------------------- jobs
class FrozenTower(torch.nn.Module):
    """A frozen embedding and encoder layer (as a pretrained tower or all-but-adapters), a
    trainable adapter and head; the optimizer is given every parameter, frozen ones included."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(32, 16)
        self.encoder = torch.nn.Linear(16, 16)
        self.adapter = torch.nn.Linear(16, 16)
        self.head = torch.nn.Linear(16, 5)
        self.embed.requires_grad_(False)
        self.encoder.requires_grad_(False)

    def forward(self, x):
        h = torch.tanh(self.encoder(self.embed(x).mean(dim=1)))
        return self.head(h + self.adapter(h))


class UnusedBranch(torch.nn.Module):
    """A trainable branch the loss does not reach (requires_grad, never a gradient): eager's
    optimizer skips it (p.grad is None) and makes no state for it."""

    def __init__(self):
        super().__init__()
        self.body = torch.nn.Linear(12, 24)
        self.aux = torch.nn.Linear(24, 3)  # an auxiliary head this step does not use
        self.head = torch.nn.Linear(24, 5)

    def forward(self, x):
        return self.head(torch.tanh(self.body(x)))


def token_batch(rank, step):
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randint(0, 32, (8, 4), generator=g), torch.randint(0, 5, (8,), generator=g)


def adamw_all_params(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def sgd_all_params(model):
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def one_cycle(optim):
    """OneCycleLR's default cycle_momentum=True: it moves lr and beta1 (AdamW) or momentum (SGD)."""
    return torch.optim.lr_scheduler.OneCycleLR(optim, max_lr=0.05, total_steps=STEPS + 1)


def adamw_moved(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def sgd_moved(model):
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3)


def adafactor(model):
    return torch.optim.Adafactor(model.parameters(), lr=1e-2)


def adafactor_wd(model):
    return torch.optim.Adafactor(model.parameters(), lr=1e-2, weight_decay=0.1, beta2_decay=-0.7, d=1.5)


# name -> (model, optimizer, scheduler or None, batch)
CASES = {
    "frozen_adamw": (FrozenTower, adamw_all_params, None, token_batch),
    "frozen_sgd": (FrozenTower, sgd_all_params, None, token_batch),
    "one_cycle_adamw": (train_steps.mlp, adamw_moved, one_cycle, train_steps.class_batch),
    "one_cycle_sgd": (train_steps.mlp, sgd_moved, one_cycle, train_steps.class_batch),
    "unused_adamw": (UnusedBranch, adamw_all_params, None, train_steps.class_batch),
    "unused_sgd": (UnusedBranch, sgd_all_params, None, train_steps.class_batch),
    "adafactor": (train_steps.mlp, adafactor, None, train_steps.class_batch),
    "adafactor_frozen_wd": (FrozenTower, adafactor_wd, None, token_batch),
}


def _run(case, placement, rank, world, fn=None):
    """STEPS steps, eager (``fn=None``: DDP or fully_shard) or with ``fn``; model, optimizer, losses."""
    make_model, make_optim, make_scheduler, batch = CASES[case]
    torch.manual_seed(0)
    model = make_model()
    stepped = _eager_model(model, placement, world) if fn is None else model
    optim = make_optim(model)
    scheduler = make_scheduler(optim) if make_scheduler else None
    step = fn or train_steps.plain_step
    losses, moved = [], []
    for s in range(STEPS):
        group = optim.param_groups[0]
        moved.append((group["lr"], group["betas"][0] if "betas" in group else group.get("momentum")))
        losses.append(step(stepped, optim, batch(rank, s)).detach())
        if scheduler is not None:
            scheduler.step()
    return model, optim, losses, moved


def _eager_model(model, placement, world):
    if placement == "replicate" and isinstance(model, UnusedBranch):  # DDP must be told of unused ones
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model, find_unused_parameters=True)
    return train_steps._eager_model(model, placement, world)


def _state_keys(optim) -> dict:
    return {i: sorted(entry) for i, entry in optim.state_dict()["state"].items()}


def _diffs(ref, got) -> dict:
    (m1, o1, l1, _), (m2, o2, l2, _) = ref, got
    full = train_steps.full
    s1, s2 = o1.state_dict()["state"], o2.state_dict()["state"]
    return {"param": max((full(a).float() - full(b).float()).abs().max().item()
                         for a, b in zip(m1.state_dict().values(), m2.state_dict().values())),
            "state": max([(full(s1[i][k]).float() - full(s2[i][k]).float()).abs().max().item()
                          for i in s1 if i in s2 for k in s1[i] if k in s2[i]] or [0.0]),
            "loss": max(float((a - b).abs()) for a, b in zip(l1, l2))}


# ---------------------------------------------------------------------------- the optimizer zoo
class NormMLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(12, 24)
        self.ln = torch.nn.LayerNorm(24)
        self.fc2 = torch.nn.Linear(24, 24)
        self.head = torch.nn.Linear(24, 5)

    def forward(self, x):
        """The logits and an L2 penalty of the weights, read as attributes (what works under shard)."""
        penalty = sum(m.weight.pow(2).sum() for m in (self.fc1, self.fc2, self.head))
        return self.head(torch.tanh(self.fc2(self.ln(torch.relu(self.fc1(x)))))), penalty


def zoo_replicate(model):
    """One optimizer per parameter set; torch's defaults otherwise (what eager runs on CPU)."""
    m = getattr(model, "module", model)
    return [torch.optim.NAdam(m.fc1.parameters(), lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True),
            torch.optim.ASGD(m.ln.parameters(), lr=1e-2),
            torch.optim.Rprop([m.fc2.weight], lr=1e-2),
            torch.optim.Adamax([m.fc2.bias], lr=torch.tensor(1e-2), weight_decay=0.01),
            torch.optim.RMSprop([m.head.weight], lr=1e-3, centered=True, momentum=0.9),
            torch.optim.SGD([m.head.bias], lr=0.05)]


def zoo_shard(model):
    """Rprop and ASGD are left out: eager fully_shard fails on Rprop's update (index_put_ on a
    Shard(0) DTensor)."""
    m = getattr(model, "module", model)
    return [torch.optim.NAdam([m.fc1.weight, m.fc2.weight], lr=1e-2),
            torch.optim.RMSprop([m.head.weight], lr=1e-3, momentum=0.9, weight_decay=1e-3),
            torch.optim.Adamax([m.fc1.bias, m.ln.weight, m.ln.bias, m.fc2.bias, m.head.bias], lr=torch.tensor(1e-2))]


def zoo_step(model, optims, batch):
    """An L2 penalty from the forward, clip_grad_value_, then clip_grad_norm_ by the largest
    element (returned, as users log it)."""
    x, y = batch
    logits, penalty = model(x)
    loss = torch.nn.functional.cross_entropy(logits, y) + 1e-3 * penalty
    loss.backward()
    torch.nn.utils.clip_grad_value_(model.parameters(), clip_value=0.05)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.02, norm_type=float("inf"))
    for o in optims:
        o.step()
        o.zero_grad()
    return loss, norm


ZOO = {"replicate": zoo_replicate, "shard": zoo_shard}
ZOO_STEPS = 4
UNFREEZE_AT = 2  # fc1 trains from this step on


def _zoo_run(placement, rank, world, fn=None):
    torch.manual_seed(0)
    model = NormMLP()
    model.fc1.requires_grad_(False)
    stepped = train_steps._eager_model(model, placement, world) if fn is None else model
    optims = ZOO[placement](stepped)
    # OneCycleLR moves RMSprop's lr and momentum and NAdam's lr and beta1 every step: step inputs, no rebuild
    schedulers = [torch.optim.lr_scheduler.OneCycleLR(o, max_lr=o.param_groups[0]["lr"], total_steps=ZOO_STEPS + 1)
                  for o in optims if isinstance(o, (torch.optim.RMSprop, torch.optim.NAdam))]
    # Adamax's learning rate is a 0-dim tensor, which ExponentialLR moves in place
    schedulers += [torch.optim.lr_scheduler.ExponentialLR(o, 0.8) for o in optims if isinstance(o, torch.optim.Adamax)]
    outs = []
    for s in range(ZOO_STEPS):
        if s == UNFREEZE_AT:
            model.fc1.requires_grad_(True)
            if fn is None and placement == "replicate":  # DDP registers the parameters it reduces once
                stepped = train_steps._eager_model(model, placement, world)
        loss, norm = (fn or zoo_step)(stepped, optims, train_steps.class_batch(rank, s))
        outs.append((loss.detach(), train_steps.full(norm).detach()))
        for scheduler in schedulers:
            scheduler.step()
    return model, optims, outs


def _zoo(placement, rank, world, cache_dir):
    ref = _zoo_run(placement, rank, world)
    fn = spmd_aot.compile(zoo_step, placement=placement, cache_dir=f"{cache_dir}/zoo-{placement}")
    got = _zoo_run(placement, rank, world, fn)
    (m1, o1, l1), (m2, o2, l2) = ref, got
    full = train_steps.full
    state = []
    for a, b in zip(o1, o2):
        s1, s2 = a.state_dict()["state"], b.state_dict()["state"]
        for i in s1:
            for k, v in s1[i].items():
                if isinstance(v, torch.Tensor) and i in s2 and k in s2[i]:
                    x, y = full(v).float(), full(s2[i][k]).float()
                    state.append((x - y).abs().max().item() / max(1.0, x.abs().max().item()))
    return {"param": max((full(a).float() - full(b).float()).abs().max().item()
                         for a, b in zip(m1.state_dict().values(), m2.state_dict().values())),
            "state_relative": max(state),
            "loss": max(float((a - b).abs()) for (a, _), (b, _) in zip(l1, l2)),
            "norm": max(float((a - b).abs()) for (_, a), (_, b) in zip(l1, l2)),
            "norms": [float(n) for _, n in l2],
            "keys": [[{i: sorted(e) for i, e in o.state_dict()["state"].items()} for o in opts] for opts in (o1, o2)],
            "traces": fn.cache_info.traces}


def _worker(rank, world, cases, cache_dir):
    out = {("zoo", p): _zoo(p, rank, world, cache_dir) for p in ZOO}
    for case in cases:
        for placement in placements_of(case):
            cache = f"{cache_dir}/{case}-{placement}"
            ref = _run(case, placement, rank, world)
            first = spmd_aot.compile(train_steps.plain_step, placement=placement, cache_dir=cache)
            got = _run(case, placement, rank, world, first)
            again = spmd_aot.compile(train_steps.plain_step, placement=placement, cache_dir=cache)
            rerun = _run(case, placement, rank, world, again)  # a fresh start: every step from the cache
            out[case, placement] = {
                "diffs": _diffs(ref, got), "diffs_again": _diffs(ref, rerun),
                "first_traces": first.cache_info.traces, "hit": again.cache_info.hit,
                "traces": again.cache_info.traces,
                "keys": (_state_keys(ref[1]), _state_keys(got[1]), _state_keys(rerun[1])),
                "groups": [{k: v for k, v in g.items() if k != "params"} for g in ref[1].param_groups],
                "groups_compiled": [{k: v for k, v in g.items() if k != "params"} for g in got[1].param_groups],
                "moved": ref[3],
            }
    for placement in PLACEMENTS:  # after the cases: their caches hold plain_step
        out["zero_grad_first", placement] = _zero_grad_first(placement, rank, world, cache_dir)
    return out


# ---------------------------------------------------------------------------- zero_grad first
def zero_grad_first(model, optim, batch):
    """PyTorch's tutorial order: gradients cleared first, this step's left on the parameters
    (after clipping, as users clip)."""
    x, y = batch
    optim.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5)
    optim.step()
    return loss


def zero_grad_kept(model, optim, batch):
    """The model's zero_grad, keeping the .grad tensors (eager writes into the same ones)."""
    x, y = batch
    model.zero_grad(set_to_none=False)
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    optim.step()
    return loss


def accumulating(model, optim, batch):
    """Gradients never cleared: they accumulate across steps."""
    x, y = batch
    torch.nn.functional.cross_entropy(model(x), y).backward()
    optim.step()


# name -> (case of CASES whose model, optimizer and batch it runs, step); its cache is the case's,
# where plain_step (zero_grad last) is stored: the step's own source must make it miss
ZERO_GRAD_FIRST = {"zero_grad_first": ("frozen_adamw", zero_grad_first),
                   "zero_grad_kept": ("frozen_sgd", zero_grad_kept)}
ZERO_GRAD_STEPS = 3


def _grads(model) -> dict:
    """Each parameter's .grad: whole value, placements under shard, global and local shapes (an
    uneven shard: 5 rows on 2 ranks), and the tensor's identity."""
    out = {}
    for name, p in model.named_parameters():
        g = p.grad
        out[name] = None if g is None else (train_steps.full(g).detach().clone(), str(getattr(g, "placements", None)),
                                            (tuple(g.shape), tuple(getattr(g, "_local_tensor", g).shape)), id(g))
    return out


def _zero_grad_run(case, step, placement, rank, world, fn=None):
    make_model, make_optim, _, batch = CASES[case]
    torch.manual_seed(0)
    model = make_model()
    stepped = _eager_model(model, placement, world) if fn is None else model
    optim = make_optim(model)
    losses, grads = [], []
    for s in range(ZERO_GRAD_STEPS):
        losses.append((fn or step)(stepped, optim, batch(rank, s)).detach())
        grads.append(_grads(model))
    return model, optim, losses, grads


def _zero_grad_first(placement, rank, world, cache_dir):
    out = {}
    for name, (case, step) in ZERO_GRAD_FIRST.items():
        ref = _zero_grad_run(case, step, placement, rank, world)
        fn = spmd_aot.compile(step, placement=placement, cache_dir=f"{cache_dir}/{case}-{placement}")
        got = _zero_grad_run(case, step, placement, rank, world, fn)
        grad_diff, described = 0.0, []
        for g1, g2 in zip(ref[3], got[3]):
            for k in g1:
                if g1[k] is not None and g2[k] is not None:
                    grad_diff = max(grad_diff, (g1[k][0].float() - g2[k][0].float()).abs().max().item())
            described.append({k: v and v[1:3] for k, v in g1.items()} == {k: v and v[1:3] for k, v in g2.items()})
        same_tensor = [[g[k] is not None and g[k][3] == steps[0][k][3] for k in g] for steps in (ref[3], got[3])
                       for g in steps[1:]]
        out[name] = {"diffs": _diffs(ref[:3] + (None,), got[:3] + (None,)), "grad": grad_diff,
                     "described": described, "hit": fn.cache_info.hit,
                     "frozen_none": [[v is None for k, v in g.items() if k.startswith(("embed", "encoder"))]
                                     for g in got[3]],
                     "same_tensor": same_tensor[:ZERO_GRAD_STEPS - 1], "same_tensor_got": same_tensor[ZERO_GRAD_STEPS - 1:],
                     "placements": sorted({v[1] for v in got[3][-1].values() if v is not None})}
    return out


PLACEMENTS = ("replicate", "shard")


def placements_of(case):
    """Adafactor: replicate only (sharded parameters are refused, as fully_shard fails on it)."""
    return ("replicate",) if case.startswith("adafactor") else PLACEMENTS


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_ranks(_worker, 2, list(CASES), str(tmp_path_factory.mktemp("step-patterns")), timeout=600)


def _report(results, case, placement):
    for rank, per_rank in enumerate(results):
        r = per_rank[case, placement]
        print(f"{case} {placement} rank {rank}: {r['diffs']} again {r['diffs_again']}")


@pytest.mark.parametrize("case,placement", [(c, p) for c in CASES for p in placements_of(c)])
def test_pattern_hits_traces_nothing_and_matches_eager(results, case, placement):
    _report(results, case, placement)
    for rank, per_rank in enumerate(results):
        r = per_rank[case, placement]
        assert max(r["diffs"].values()) <= TOLERANCE, f"rank {rank}: {r['diffs']}"
        assert max(r["diffs_again"].values()) <= TOLERANCE, f"rank {rank}: {r['diffs_again']}"
        assert r["hit"] and r["traces"] == 0, f"rank {rank}: {r}"
        # the first start traced once (rank 0) and never again while the scheduler moved numbers
        assert r["first_traces"] == (1 if rank == 0 else 0), f"rank {rank}: {r['first_traces']} traces"
        eager, compiled, again = r["keys"]
        assert compiled == eager and again == eager, f"rank {rank}: state keys {compiled} vs eager {eager}"
        assert r["groups_compiled"] == r["groups"]


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_frozen_parameters_have_no_optimizer_state(results, placement):
    """FrozenTower: embed (1 tensor) and encoder (2) frozen of 7 parameters: 4 have state."""
    for case in ("frozen_adamw", "frozen_sgd", "adafactor_frozen_wd"):
        if placement not in placements_of(case):
            continue
        for per_rank in results:
            eager, compiled, _ = per_rank[case, placement]["keys"]
            assert sorted(compiled) == [3, 4, 5, 6] and compiled == eager


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_parameters_no_gradient_reaches_have_no_optimizer_state(results, placement):
    """UnusedBranch: aux (parameters 2 and 3) never gets a gradient: no state, as in eager, on
    the first start (traced) and on a fresh start (hit)."""
    for case in ("unused_adamw", "unused_sgd"):
        for per_rank in results:
            eager, compiled, again = per_rank[case, placement]["keys"]
            assert sorted(compiled) == [0, 1, 4, 5] and compiled == eager == again


@pytest.mark.parametrize("case", ["one_cycle_adamw", "one_cycle_sgd"])
def test_the_scheduler_moved_the_numbers(results, case):
    """The parity above means something: OneCycleLR gave every step its own learning rate and
    its own beta1 (AdamW) or momentum (SGD), which the compiled steps used."""
    moved = results[0][case, "replicate"]["moved"]
    assert len({lr for lr, _ in moved}) == STEPS and len({m for _, m in moved}) == STEPS, moved
    assert max(m for _, m in moved) - min(m for _, m in moved) > 0.05, moved


@pytest.mark.parametrize("placement", list(ZOO))
def test_optimizer_zoo_and_step_shapes_match_eager(results, placement):
    """An L2 penalty computed in forward; NAdam, ASGD, Rprop (nonzero initial state), Adamax,
    RMSprop (centered, momentum), with
    OneCycleLR moving RMSprop's momentum and NAdam's beta1 every step and ExponentialLR Adamax's
    tensor learning rate, plain SGD, clip_grad_value_ and an inf-norm clip_grad_norm_
    against eager DDP / fully_shard; fc1 is frozen for two steps, then unfrozen: the compiled step
    resolves again (rank 0 traces twice, once per set of trainable parameters, never for the
    scheduler) and trains it, with optimizer state for it from then on, as eager."""
    for rank, per_rank in enumerate(results):
        r = per_rank["zoo", placement]
        print(f"zoo {placement} rank {rank}: {r}")
        # state relative to its magnitude: RMSprop's centered momentum buffer reaches ~30 here
        assert max(r["param"], r["state_relative"], r["loss"]) <= TOLERANCE, f"rank {rank}: {r}"
        # the returned inf norm is the largest gradient element over every rank's shard, not this rank's
        assert r["norm"] <= TOLERANCE, f"rank {rank}: {r}"
        eager, compiled = r["keys"]
        assert compiled == eager, f"rank {rank}: state keys {compiled} vs eager {eager}"
        if placement == "replicate":  # every optimizer has state but plain SGD, which has none at all
            assert all(eager[:-1]) and eager[-1] == {}, eager
        assert r["traces"] == (2 if rank == 0 else 0), f"rank {rank}: {r['traces']} traces"
    assert results[0]["zoo", placement]["norms"] == results[1]["zoo", placement]["norms"]


def eval_after_step(model, optim, batch):
    """The model's eval forward after optim.step() in the same step."""
    x, y = batch
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    optim.step()
    optim.zero_grad()
    with torch.no_grad():
        return loss, torch.nn.functional.cross_entropy(model(x), y)


def test_a_forward_after_the_update_under_shard_is_refused_at_build(tmp_path):
    """Under shard the group was gathered before AdamW updated it through its local shards: the
    forward would read the old values, so the build refuses it (it used to return them)."""
    job = spmd_aot.Job(step=eval_after_step, model=train_steps.mlp, optimizer=adamw_all_params,
                       batch=lambda: train_steps.class_batch(0, 0))
    with pytest.raises(spmd_aot.UnsupportedError, match=r"read by a module's forward after it was updated"):
        spmd_aot.build(job, world_size=2, placement="shard", cache_dir=tmp_path)


def nonfinite_clip_step(model, optim, batch):
    x, y = batch
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5, error_if_nonfinite=True)
    optim.step()
    optim.zero_grad()
    return loss


class WithAverage(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = train_steps.mlp()
        self.avg = torch.optim.swa_utils.AveragedModel(
            self.net, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9))

    def forward(self, x):
        return self.net(x)


def averaged_model_step(model, optim, batch):
    loss = train_steps.plain_step(model, optim, batch)
    model.avg.update_parameters(model.net)
    return loss


@pytest.mark.parametrize("step,model,named,fix", [
    (nonfinite_clip_step, train_steps.mlp, r"clip_grad_norm_\(\.\.\., error_if_nonfinite=True\)",
     r"drop `error_if_nonfinite`"),
    (averaged_model_step, WithAverage, r"AveragedModel.update_parameters", r"call `update_parameters` after"),
])
def test_library_host_reads_are_refused_naming_the_construct_and_a_fix(tmp_path, step, model, named, fix):
    job = spmd_aot.Job(step=step, model=model, optimizer=lambda m: torch.optim.AdamW(m.net.parameters() if
                       hasattr(m, "net") else m.parameters(), lr=1e-2), batch=lambda: train_steps.class_batch(0, 0))
    with pytest.raises(spmd_aot.UnsupportedError, match=named) as info:
        spmd_aot.build(job, world_size=1, cache_dir=tmp_path)
    assert "test_step_patterns.py:" in str(info.value) and re.search(fix, str(info.value)), info.value


def l2_in_step(model, optim, batch):
    """An L2 penalty over model.parameters() added to the loss in the step."""
    x, y = batch
    loss = torch.nn.functional.cross_entropy(model(x), y) + 1e-3 * sum(p.pow(2).sum() for p in model.parameters())
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def test_an_l2_penalty_over_sharded_parameters_in_the_step_is_refused_naming_what_works(tmp_path):
    """Under shard model.parameters() yields shards; the refusal says what works instead (the zoo's
    model computes its penalty in forward from attributes, and matches fully_shard)."""
    job = spmd_aot.Job(step=l2_in_step, model=train_steps.mlp, optimizer=adamw_all_params,
                       batch=lambda: train_steps.class_batch(0, 0))
    with pytest.raises(spmd_aot.UnsupportedError, match=r"an L2 penalty added to the loss.*read as attributes.*"
                                                        r"weight_decay"):
        spmd_aot.build(job, world_size=2, placement="shard", cache_dir=tmp_path)


SCHEDULERS: dict = {}


def adamw_scheduled(model):
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    SCHEDULERS["lr"] = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: 1 / (1 + s))
    return optim


def scheduler_inside_step(model, optim, batch):
    """Python on param_groups inside the step: the stored step would never run it."""
    loss = train_steps.plain_step(model, optim, batch)
    SCHEDULERS["lr"].step()
    return loss


def test_a_scheduler_stepped_inside_the_step_is_refused_naming_the_line(tmp_path):
    job = spmd_aot.Job(step=scheduler_inside_step, model=train_steps.mlp, optimizer=adamw_scheduled,
                       batch=lambda: train_steps.class_batch(0, 0))
    with pytest.raises(spmd_aot.UnsupportedError, match=r"calls LambdaLR.step\(\) at .*test_step_patterns.py:\d+ "
                                                        r"`SCHEDULERS\[\"lr\"\].step\(\)`.*after the compiled step"):
        spmd_aot.build(job, world_size=1, cache_dir=tmp_path)


def test_adafactor_on_sharded_parameters_is_refused_at_build(tmp_path):
    job = spmd_aot.Job(step=train_steps.plain_step, model=train_steps.mlp, optimizer=adafactor,
                       batch=lambda: train_steps.class_batch(0, 0))
    with pytest.raises(spmd_aot.UnsupportedError, match=r"Adafactor cannot update parameters sharded .* "
                                                        r"use placement='replicate' with Adafactor"):
        spmd_aot.build(job, world_size=2, placement="shard", cache_dir=tmp_path)


def test_lbfgs_is_refused_by_name(tmp_path):
    model = train_steps.mlp()
    step = spmd_aot.compile(train_steps.plain_step, cache_dir=tmp_path)
    with pytest.raises(spmd_aot.UnsupportedError, match=r"torch.optim.LBFGS cannot be compiled: its step "
                                                        r"re-evaluates a closure.*use torch.optim.AdamW"):
        step(model, torch.optim.LBFGS(model.parameters()), train_steps.class_batch(0, 0))


_KEY_PROGRAM = """
import sys
import torch
from spmd_aot.keying.key import compute_key
from spmd_aot.parallel.plan import Plan
from spmd_aot.state import TrainState, initialize_optimizer_state
from support import train_steps

torch.manual_seed(0)
model = train_steps.mlp()
optims = [torch.optim.AdamW(model.fc1.parameters(), lr=1e-2, weight_decay=0.1),
          torch.optim.SGD(model.head.parameters(), lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3)]
schedulers = [torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.05, total_steps=10) for o in optims]
for _ in range(int(sys.argv[1])):  # the scheduler moves lr, beta1 and momentum
    for s in schedulers:
        s.step()
optim = __import__("spmd_aot.tracing.optimizers", fromlist=["as_optimizer"]).as_optimizer(optims)
initialize_optimizer_state(optim)
state = TrainState(model, optim, train_steps.class_batch(0, 0), Plan(2))
print("KEY", compute_key(train_steps.plain_step, state, Plan(2)).key, [g["betas"][0] if "betas" in g else
      g["momentum"] for g in optim.param_groups])
"""


def test_keys_are_equal_across_processes_and_scheduler_steps():
    """Hyperparameter inputs leave the key alone: the same key in processes with different
    PYTHONHASHSEED, before and after OneCycleLR moved lr, beta1 and momentum."""
    import os
    import pathlib
    import subprocess
    import sys
    import warnings

    tests = pathlib.Path(__file__).parents[1]  # the tests root: support/ is under it
    env = {**os.environ, "PYTHONPATH": f"{tests}{os.pathsep}{tests.parent}"}
    procs = [subprocess.Popen([sys.executable, "-W", "ignore", "-c", _KEY_PROGRAM, str(steps)], cwd=tests,
                              env={**env, "PYTHONHASHSEED": seed}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for seed, steps in (("1", 0), ("2", 3))]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=180)
        assert p.returncode == 0, err
        outs.append(next(line for line in out.splitlines() if line.startswith("KEY ")).split(" ", 2))
    warnings.filterwarnings("ignore")
    (_, key_a, moved_a), (_, key_b, moved_b) = outs
    assert moved_a != moved_b  # the numbers did move
    assert key_a == key_b


def test_a_moved_constant_is_named_when_the_step_is_looked_up_again(tmp_path, caplog):
    """fused=True keeps torch's fused kernel, which takes betas as Python numbers: OneCycleLR
    moving beta1 then rebuilds, and the log says which number and why."""
    import logging

    torch.manual_seed(0)
    model = train_steps.mlp()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    scheduler = one_cycle(optim)
    fn = spmd_aot.compile(train_steps.plain_step, cache_dir=tmp_path)
    with caplog.at_level(logging.WARNING, logger="spmd_aot.runtime.step"):
        for s in range(2):
            fn(model, optim, train_steps.class_batch(0, s))
            scheduler.step()
        fn(model, optim, train_steps.class_batch(0, 2))
    moved = [r.getMessage() for r in caplog.records if "changed from" in r.getMessage()]
    assert len(moved) == 2 and all("param_groups[0]['betas']" in m and "fused and foreach unset" in m
                                   for m in moved), moved
    assert fn.cache_info.traces == 3


def rmsprop_moved(model):
    return torch.optim.RMSprop(model.parameters(), lr=1e-3, momentum=0.9, weight_decay=1e-3, centered=True)


@pytest.mark.parametrize("make_optim,fed", [
    (adamw_moved, {"lr", "betas[0]", "betas[1]", "eps", "weight_decay"}),
    (rmsprop_moved, {"lr", "alpha", "eps", "momentum", "weight_decay"}),
    (lambda m: torch.optim.NAdam(m.parameters(), lr=1e-2, weight_decay=0.1), {"lr", "betas[0]", "betas[1]", "eps",
                                                                              "weight_decay"}),
    (lambda m: torch.optim.RAdam(m.parameters(), lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True),
     {"lr", "betas[0]", "betas[1]", "eps", "weight_decay"}),
    (lambda m: torch.optim.Adamax(m.parameters(), lr=1e-2, weight_decay=0.1), {"lr", "betas[0]", "betas[1]", "eps",
                                                                               "weight_decay"}),
    (sgd_moved, {"lr", "momentum", "weight_decay"}),
    (adafactor_wd, {"lr", "beta2_decay", "d", "weight_decay"}),
])
def test_the_stored_graph_reads_every_hyperparameter_input(tmp_path, make_optim, fed):
    """No number a scheduler may move is baked into the graph: each hyperparameter input of the
    stored step has readers (its value is used, not a constant taken at trace time)."""
    from spmd_aot.entries import read_artifact
    from spmd_aot.store import open_store

    model = FrozenTower if make_optim is adafactor_wd else train_steps.mlp
    batch = token_batch if make_optim is adafactor_wd else train_steps.class_batch
    job = spmd_aot.Job(step=train_steps.plain_step, model=model, optimizer=make_optim, batch=lambda: batch(0, 0))
    built = spmd_aot.build(job, world_size=2, cache_dir=tmp_path)
    artifact = read_artifact(open_store(tmp_path), built.digest)
    nodes = artifact.check()
    placeholders = [i for i, n in enumerate(nodes) if n.op == "placeholder"]
    read = set().union(*(n.refs for n in nodes))
    hyper = {s["fqn"]: i for s, i in zip(artifact.layout["inputs"], placeholders) if s["kind"] == "hyper"}
    assert {fqn.removeprefix("param_groups[0].") for fqn in hyper} == fed
    assert all(i in read for i in hyper.values()), [f for f, i in hyper.items() if i not in read]


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_zero_grad_first_matches_eager_and_leaves_its_gradients(results, placement):
    """optim.zero_grad() first (AdamW, clipped) and model.zero_grad(set_to_none=False) first
    (SGD momentum): parameters, optimizer state, losses and every parameter's .grad after each
    step as eager DDP / fully_shard leave them (DTensor shards with the parameter's placement
    under shard), frozen ones None; set_to_none=False keeps each .grad tensor, as eager; the
    stored zero_grad-last step of the same job does not serve them."""
    for per_rank in results:
        for name, r in per_rank["zero_grad_first", placement].items():
            print(name, placement, r)
            assert not r["hit"], name
            assert max(r["diffs"].values()) < TOLERANCE and r["grad"] < TOLERANCE, (name, r)
            assert all(r["described"]), (name, r)
            assert all(all(step) for step in r["frozen_none"]), (name, r)
            assert r["placements"] == (["(Shard(dim=0),)"] if placement == "shard" else ["None"]), r
            if name == "zero_grad_kept":  # the 4 trained parameters' .grad: the same tensors every step
                assert all(sum(step) == 4 for steps in (r["same_tensor"], r["same_tensor_got"]) for step in steps), r


def test_gradients_left_without_clearing_first_are_refused(tmp_path):
    job = spmd_aot.Job(step=accumulating, model=train_steps.mlp, optimizer=train_steps.sgd,
                       batch=lambda: train_steps.class_batch(0, 0))
    with pytest.raises(spmd_aot.UnsupportedError, match=r"did not clear before their first backward\(\)") as info:
        spmd_aot.build(job, world_size=1, cache_dir=tmp_path)
    assert "test_step_patterns.py:" in str(info.value) and "optim.zero_grad() at the start" in str(info.value)

"""Which optimizer implementation a traced step runs: where the user left the choice to torch,
the fused kernel when torch has one for the parameters and the group's only number that is a
step input is its learning rate (plain SGD), else the multi-tensor update on tensors (SGD with
momentum, Adam, AdamW: their betas, eps, momentum are step inputs, which fused kernels take as
Python numbers); the user's own choice always; and the flags are left as the user set them."""

import pytest
import torch

import spmd_aot
from support.jobs import make_batch, make_job
from spmd_aot.entries import read_artifact
from spmd_aot.examples.models import MLP, train_step
from spmd_aot.store import open_store


def _optimizer_ops(cache, built) -> set[str]:
    nodes = read_artifact(open_store(cache), built.digest).check()
    names = {str(n.target) for n in nodes if n.op == "call_function"}
    return {n for n in names if "_fused_" in n or "_foreach_" in n}


def _job(optimizer):
    job = make_job("mlp", "sgd")
    job.optimizer = optimizer
    return job


@pytest.mark.parametrize("world, placement, optimizer, expected", [
    (1, "replicate", lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2), "foreach"),
    (2, "shard", lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2), "foreach"),
    (2, "replicate", lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), "foreach"),
    (2, "replicate", lambda m: torch.optim.SGD(m.parameters(), lr=0.1), "fused"),
    # DTensor has no sharding rule for the fused SGD kernel: its multi-tensor path instead
    (2, "shard", lambda m: torch.optim.SGD(m.parameters(), lr=0.1), "foreach"),
    (1, "replicate", lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True), "fused"),
    (2, "shard", lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True), "fused"),
    (1, "replicate", lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, foreach=True), "foreach"),
    # the user asked for the per-tensor loop: no multi-tensor or fused op at all
    (1, "replicate", lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, foreach=False), None),
], ids=["adamw-default", "adamw-default-shard", "sgd-momentum-default", "sgd-default", "sgd-default-shard",
        "adamw-fused", "adamw-fused-shard", "adamw-foreach", "adamw-per-tensor"])
def test_implementation_chosen_for_the_step(tmp_path, monkeypatch, world, placement, optimizer, expected):
    def real_kernel_on_fake_tensors(mode, func, *args):
        raise AssertionError(f"tracing ran {func} for real: a fake tensor op without a meta kernel "
                             "allocates its real bytes (a 70B model's, for a fused AdamW step)")

    import torch._subclasses.fake_tensor as fake_tensor
    monkeypatch.setattr(fake_tensor, "run_fallback_kernel", real_kernel_on_fake_tensors)
    built = spmd_aot.build(_job(optimizer), world_size=world, placement=placement, cache_dir=tmp_path)
    ops = _optimizer_ops(tmp_path, built)
    fused = {n for n in ops if "_fused_" in n}
    foreach_updates = {n for n in ops if "_foreach_" in n and not n.startswith("aten._foreach_add_")}
    if expected == "fused":
        assert fused and not foreach_updates, ops
    elif expected == "foreach":
        assert foreach_updates and not fused, ops
    else:
        assert not fused and not foreach_updates, ops


def test_default_implementation_matches_eager_and_leaves_the_flags_alone(tmp_path):
    def fresh():
        torch.manual_seed(0)
        model = MLP(32, 64, 10)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)

    model, optim = fresh()
    ref_model, ref_optim = fresh()
    step = spmd_aot.compile(train_step, cache_dir=tmp_path)
    for s in range(3):
        loss = step(model, optim, make_batch("mlp", 0, s))
        ref_loss = train_step(ref_model, ref_optim, make_batch("mlp", 0, s))
        assert abs(loss.item() - ref_loss.item()) < 1e-5
    assert step.cache_info.source == "trace"
    for p, q in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(optim.state[p][key], ref_optim.state[q][key], rtol=1e-5, atol=1e-7)
    group = optim.param_groups[0]
    assert group["foreach"] is None and group["fused"] is None and group["capturable"] is False

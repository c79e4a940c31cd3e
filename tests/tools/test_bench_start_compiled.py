"""tools/bench/bench_start_compiled.py: the steps of bench_start's aot_compile and AOTInductor rows
compute what eager ``train_step`` does.

Fast stand-ins for the Inductor compiles the tool runs (tens of seconds each): the whole step
goes through the same ``aot_compile``, save and load with the ``aot_eager`` backend; the
exported loss-and-gradients program runs as its ``module()`` instead of an AOTInductor package.
The tool's own run checks the Inductor artifacts the same way (its parity lines).
"""

import torch

import bench_start_compiled
from spmd_aot.examples.models import Transformer, train_step

STEPS = 3


def _objects():
    torch.manual_seed(0)
    model = Transformer(vocab=64, d_model=16, n_heads=4, n_layers=1, max_len=8)
    g = torch.Generator().manual_seed(1)
    batch = (torch.randint(0, 64, (2, 8), generator=g), torch.randint(0, 64, (2, 8), generator=g))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1), batch


def _eager_params():
    model, optim, batch = _objects()
    losses = [train_step(model, optim, batch).item() for _ in range(STEPS)]
    return list(model.parameters()), losses


def _assert_matches_eager(step):
    model, optim, batch = _objects()
    losses = [float(step(model, optim, batch)) for _ in range(STEPS)]
    eager, eager_losses = _eager_params()
    torch.testing.assert_close(losses, eager_losses, rtol=0, atol=1e-5)
    assert losses[-1] < losses[0]  # it trained
    for p, e in zip(model.parameters(), eager):
        torch.testing.assert_close(p.detach(), e.detach(), rtol=0, atol=1e-4)
    assert all(p.grad is None for p in model.parameters())  # gradients cleared, as train_step does
    assert {float(s["step"]) for s in optim.state.values()} == {float(STEPS)}


def test_whole_step_saved_by_aot_compile_and_loaded_trains_as_eager(tmp_path):
    model, optim, batch = _objects()
    path = str(tmp_path / "whole_step.aot")
    bench_start_compiled.save_aot_compile(model, optim, batch, path, backend="aot_eager")
    _assert_matches_eager(bench_start_compiled.load_aot_compile(path))


def test_exported_loss_and_grads_with_eager_adamw_trains_as_eager():
    model, _, batch = _objects()
    program = bench_start_compiled.export_loss_and_grads(model, batch)
    _assert_matches_eager(bench_start_compiled.adamw_on(program.module()))

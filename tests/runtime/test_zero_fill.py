"""runtime/zero_fill.py: a hit's fresh optimizer state is zero-filled on a second thread, and
no caller ever sees it unfilled (after a hit, after a miss, after a failed first call)."""

from __future__ import annotations

import pytest
import torch

import spmd_aot
from spmd_aot.examples.models import train_step
from spmd_aot.runtime import zero_fill
from spmd_aot.runtime.zero_fill import ZeroFill
from support.jobs import fresh_objects, make_batch


def _garbage_made(fill: ZeroFill, shape, dtype=torch.float32) -> torch.Tensor:
    t = fill.make(None, torch.Size(shape), dtype, torch.device("cpu"))
    t.fill_(7.0)  # what fresh memory may hold: the fill must overwrite it
    return t


def test_large_tensors_are_filled_on_a_thread_small_ones_at_once():
    fill = ZeroFill()
    small = fill.make(None, torch.Size([3]), torch.float32, torch.device("cpu"))
    large = [_garbage_made(fill, (512, 64)), _garbage_made(fill, (300, 100), torch.float64)]
    assert torch.count_nonzero(small) == 0  # below the hand-off size: zeros right away
    fill.start()
    fill.wait()
    assert all(torch.count_nonzero(t) == 0 for t in large)
    fill.wait()  # idempotent


def test_wait_without_start_fills_in_the_caller():
    fill = ZeroFill()
    t = _garbage_made(fill, (256, 256))
    fill.wait()
    assert torch.count_nonzero(t) == 0
    ZeroFill().wait()  # nothing made, nothing to fill


def test_an_error_on_the_thread_is_raised_by_wait(monkeypatch):
    fill = ZeroFill()
    _garbage_made(fill, (256, 256))

    def broken(tensors):
        raise RuntimeError("fill failed")
    monkeypatch.setattr(zero_fill.torch, "_foreach_zero_", broken)
    fill.start()
    with pytest.raises(RuntimeError, match="fill failed"):
        fill.wait()


def test_state_is_zero_after_a_first_call_that_fails(tmp_path, monkeypatch):
    """require_hit on an empty cache raises after the state was made: it is zero all the same."""
    monkeypatch.setattr(zero_fill, "_MIN_BYTES", 0)  # every state tensor goes through the thread
    model, optim = fresh_objects("transformer", "adamw")
    step = spmd_aot.compile(train_step, cache_dir=tmp_path, require_hit=True)
    with pytest.raises(spmd_aot.CacheMissError):
        step(model, optim, make_batch("transformer"))
    state = [v for s in optim.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    assert state and all(torch.count_nonzero(v) == 0 for v in state)


def test_a_hit_with_state_filled_on_the_thread_matches_eager(tmp_path, monkeypatch):
    monkeypatch.setattr(zero_fill, "_MIN_BYTES", 0)
    batches = [make_batch("transformer", step=s) for s in range(3)]
    for _ in range(2):  # a miss that traces, then a hit in a fresh compile
        model, optim = fresh_objects("transformer", "adamw")
        step = spmd_aot.compile(train_step, cache_dir=tmp_path)
        losses = [step(model, optim, b).item() for b in batches]
    assert step.cache_info.hit
    ref_model, ref_optim = fresh_objects("transformer", "adamw")
    ref = [train_step(ref_model, ref_optim, b).item() for b in batches]
    assert losses == pytest.approx(ref, abs=1e-5)
    for p, q in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(p, q, atol=1e-5, rtol=1e-5)

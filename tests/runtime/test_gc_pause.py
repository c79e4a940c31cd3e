"""The cyclic garbage collector is paused while a hit loads (``entries/gc_pause.py``), and
only then: a trace runs with it on, and the caller's setting is back afterwards."""

import gc

import torch

import spmd_aot
import spmd_aot.runtime.step as step_module
from spmd_aot.building import pipeline
from spmd_aot.examples.models import train_step
from spmd_aot.entries import gc_pause
from support.jobs import fresh_objects, make_batch, make_job


def _recording(monkeypatch, name: str, module=step_module) -> list[bool]:
    """Wrap ``module.<name>`` to record whether the collector was on at each call."""
    seen, real = [], getattr(module, name)

    def wrapper(*args, **kwargs):
        seen.append(gc.isenabled())
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, wrapper)
    return seen


def test_a_hit_loads_with_the_collector_paused_and_restores_it(tmp_path, monkeypatch):
    spmd_aot.build(make_job("transformer", "adamw"), world_size=1, cache_dir=tmp_path)
    model, optim = fresh_objects("transformer", "adamw")
    step = spmd_aot.compile(train_step, cache_dir=tmp_path, require_hit=True)
    keyed, read = _recording(monkeypatch, "compute_key"), _recording(monkeypatch, "read_artifact")
    assert gc.isenabled()
    loss = step(model, optim, make_batch("transformer"))
    assert step.cache_info.hit and torch.isfinite(loss)
    assert keyed == [False] and read == [False], "the key and the load must run with the collector paused"
    assert gc.isenabled(), "the collector must be on again after the load"


def test_a_miss_traces_with_the_collector_on(tmp_path, monkeypatch):
    model, optim = fresh_objects("mlp", "sgd")
    step = spmd_aot.compile(train_step, cache_dir=tmp_path)
    traced = _recording(monkeypatch, "trace_and_store", pipeline)
    step(model, optim, make_batch("mlp"))
    assert not step.cache_info.hit
    assert traced == [True], "a trace builds cyclic garbage; the collector must be on during it"
    assert gc.isenabled()


def test_paused_keeps_a_callers_disabled_collector_off():
    gc.disable()
    try:
        with gc_pause.paused():
            assert not gc.isenabled()
            with gc_pause.resumed():
                assert gc.isenabled()
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()
    with gc_pause.paused():
        assert not gc.isenabled()
    assert gc.isenabled()


def test_set_aside_freezes_for_its_block_only_and_leaves_a_process_freeze_alone():
    import gc

    assert gc.get_freeze_count() == 0
    gc_pause.keep()  # outside a build: nothing is set aside
    assert gc.get_freeze_count() == 0
    with gc_pause.set_aside():
        frozen = gc.get_freeze_count()
        assert frozen > 0
        made = [[] for _ in range(1000)]
        gc_pause.keep()
        assert gc.get_freeze_count() >= frozen + 1000
        with gc_pause.set_aside():  # nested: the outer block keeps what it holds
            pass
        assert gc.get_freeze_count() >= frozen + 1000
        del made
    assert gc.get_freeze_count() == 0, "the build's objects must go back to the collector"
    gc.freeze()  # a process that froze its own objects (a pre-fork server) keeps them frozen
    try:
        held = gc.get_freeze_count()
        with gc_pause.set_aside():
            gc_pause.keep()
        assert gc.get_freeze_count() == held
    finally:
        gc.unfreeze()

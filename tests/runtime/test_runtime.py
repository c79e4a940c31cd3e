"""Job-start behaviour on real processes: hits, misses, agreement, bit-exactness, errors."""

import pathlib

import pytest
import torch

import spmd_aot
from support.jobs import compiled_run, eager_ddp, fresh_objects, make_batch, make_job
from support.multiproc import run_ranks
from spmd_aot.examples.models import train_step


# ---------------------------------------------------------------- loaded == fresh trace, bit for bit
def _fresh_vs_loaded_worker(rank, world, cache_dir):
    from spmd_aot.parallel.plan import Plan
    from spmd_aot.state import TrainState, initialize_optimizer_state
    from spmd_aot.parallel.mesh import device_mesh
    from spmd_aot.tracing.trace import trace_step

    # fresh: the traced GraphModule itself, never serialized
    model, optim = fresh_objects("transformer", "adamw")
    initialize_optimizer_state(optim)
    plan = Plan(world)
    state = TrainState(model, optim, make_batch("transformer", rank, 0), plan)
    traced = trace_step(train_step, state, plan, device_mesh(plan), state.graph_inputs())
    fresh_losses = []
    for s in range(3):
        leaves = list(make_batch("transformer", rank, s))
        with torch.no_grad():
            fresh_losses.append(traced.gm(*state.graph_inputs(batch_leaves=leaves))[0])
    # loaded: the stored artifact, rebuilt from msgpack
    model2, optim2, losses, info = compiled_run("transformer", "adamw", rank, world, 3, cache_dir,
                                                require_hit=True)
    same_params = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), model2.state_dict().values()))
    s1, s2 = optim.state_dict()["state"], optim2.state_dict()["state"]
    same_state = all(torch.equal(s1[i][k], s2[i][k]) for i in s1 for k in s1[i])
    same_losses = all(torch.equal(a, b) for a, b in zip(fresh_losses, losses))
    return same_params, same_state, same_losses, info.hit


def test_loaded_artifact_equals_fresh_trace_bit_for_bit(tmp_path):
    spmd_aot.build(make_job("transformer", "adamw"), world_size=2, cache_dir=tmp_path)
    for result in run_ranks(_fresh_vs_loaded_worker, 2, str(tmp_path)):
        assert result == (True, True, True, True)


# ---------------------------------------------------------------- return value contract
def _loss_contract_worker(rank, world, cache_dir):
    _, _, ref_losses = eager_ddp("mlp", "sgd", rank, world, 3)
    _, _, losses, _ = compiled_run("mlp", "sgd", rank, world, 3, cache_dir)
    return [loss.item() for loss in ref_losses], [loss.item() for loss in losses]


def test_step_returns_the_rank_local_loss_like_ddp(tmp_path):
    """Contract: the compiled step returns what the step returns on this rank (the local loss)."""
    (ref0, got0), (ref1, got1) = run_ranks(_loss_contract_worker, 2, str(tmp_path))
    assert got0 == pytest.approx(ref0, abs=1e-6) and got1 == pytest.approx(ref1, abs=1e-6)
    assert got0[0] != pytest.approx(got1[0], abs=1e-4), "ranks must see their own batch's loss"


# ---------------------------------------------------------------- second start hits, never traces
def _start_job_worker(rank, world, cache_dir, forbid_trace):
    if forbid_trace:
        import spmd_aot.building.pipeline
        import spmd_aot.tracing.trace

        def refuse(*args, **kwargs):
            raise AssertionError("the tracer was called on a cache hit")

        spmd_aot.building.pipeline.trace_step = refuse
        spmd_aot.tracing.trace.make_fx = refuse
    _, _, losses, info = compiled_run("transformer", "sgd", rank, world, 2, cache_dir)
    return info.hit, info.source, info.digest, [loss.item() for loss in losses]


def _start_job_twice_worker(rank, world, cache_dir):
    """Two job starts in the same ranks (the second a fresh compile, model and optimizer, as a
    new job's), so the ranks pay torch's start-up once."""
    return _start_job_worker(rank, world, cache_dir, False), _start_job_worker(rank, world, cache_dir, True)


def test_second_job_start_is_a_hit_and_does_not_trace(tmp_path):
    results = run_ranks(_start_job_twice_worker, 2, str(tmp_path))
    first, second = [r[0] for r in results], [r[1] for r in results]
    assert [r[:2] for r in first] == [(False, "trace")] * 2
    assert [r[:2] for r in second] == [(True, "cache")] * 2
    assert {r[2] for r in first + second} == {first[0][2]}
    assert [r[3] for r in first] == [r[3] for r in second]


# ---------------------------------------------------------------- clear errors
def _require_hit_worker(rank, world, cache_dir, batch_size):
    try:
        compiled_run("mlp", "sgd", rank, max(world, 1), 1, cache_dir, batch_size=batch_size, require_hit=True)
    except spmd_aot.SpmdAotError as exc:
        return type(exc).__name__, str(exc)
    return "ok", ""


def test_require_hit_with_other_batch_shape_names_expected_and_actual(tmp_path):
    spmd_aot.build(make_job("mlp", "sgd", batch_size=4), world_size=1, cache_dir=tmp_path)
    kind, msg = _require_hit_worker(0, 0, str(tmp_path), 3)  # world 1: a job start in this process
    assert kind == "CacheMissError"
    assert "batch" in msg and "[4,32]" in msg and "[3,32]" in msg, msg


def test_artifact_for_another_world_size_is_named(tmp_path):
    spmd_aot.build(make_job("mlp", "sgd"), world_size=4, cache_dir=tmp_path)
    results = run_ranks(_require_hit_worker, 2, str(tmp_path), 4)
    for kind, msg in results:
        assert kind == "CacheMissError", msg
        assert "world_size" in msg and "stored 4, live 2" in msg, msg


def test_global_batch_not_divisible_by_world_size(tmp_path):
    job = make_job("mlp", "sgd", batch_size=10)
    job.global_batch = True
    with pytest.raises(spmd_aot.SpmdAotError, match=r"10 samples.*not divisible by world size 4"):
        spmd_aot.build(job, world_size=4, cache_dir=tmp_path)
    built = spmd_aot.build(job, world_size=2, cache_dir=tmp_path)
    assert built.key  # 10 / 2 = 5 per rank works


def _corrupt_worker(rank, world, cache_dir, require_hit):
    try:
        _, _, _, info = compiled_run("mlp", "sgd", rank, max(world, 1), 1, cache_dir, require_hit=require_hit)
    except spmd_aot.SpmdAotError as exc:
        return type(exc).__name__, str(exc)
    return "ok", info.source


def _flip_graph_blob(cache: pathlib.Path, digest: str) -> pathlib.Path:
    from spmd_aot.entries import read_manifest
    from spmd_aot.store import LocalStore

    store = LocalStore(cache)
    path = store.blob_path(read_manifest(store, digest)["blobs"]["graph"])
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.chmod(0o644)
    path.write_bytes(bytes(data))
    return path


def test_corrupted_blob_is_refused_then_rebuilt(tmp_path):
    built = spmd_aot.build(make_job("mlp", "sgd"), world_size=1, cache_dir=tmp_path)
    bad = _flip_graph_blob(tmp_path, built.digest)
    # three job starts at world 1, each in this process (no process group, as a plain job)
    kind, msg = _corrupt_worker(0, 0, str(tmp_path), True)
    assert kind == "CorruptArtifactError" and bad.name in msg, msg
    assert any((tmp_path / "quarantine").iterdir()), "the corrupt blob is moved aside"
    kind, source = _corrupt_worker(0, 0, str(tmp_path), False)
    assert (kind, source) == ("ok", "trace")  # rebuilt
    kind, source = _corrupt_worker(0, 0, str(tmp_path), True)
    assert (kind, source) == ("ok", "cache")


def _disagree_worker(rank, world, cache_dir):
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4 if rank == 0 else 5)  # rank 1 has another model
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    step = spmd_aot.compile(lambda m, o, b: _linear_step(m, o, b), cache_dir=cache_dir)
    try:
        step(model, optim, torch.randn(2, 8))
    except spmd_aot.SpmdAotError as exc:
        return type(exc).__name__, str(exc)
    return "ok", ""


def _linear_step(model, optim, x):
    loss = model(x).square().mean()
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def test_ranks_that_disagree_on_the_key_fail_together_without_hanging(tmp_path):
    results = run_ranks(_disagree_worker, 2, str(tmp_path), timeout=120)
    for kind, msg in results:
        assert kind == "ArtifactMismatchError", msg
        assert "parameters" in msg, msg


def _untraceable_step(model, optim, x):
    loss = model(x).square().mean()
    if loss.item() > 0:  # data-dependent Python control flow cannot be traced
        loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def _trace_failure_worker(rank, world, cache_dir):
    model = torch.nn.Linear(8, 4)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    step = spmd_aot.compile(_untraceable_step, cache_dir=cache_dir)
    try:
        step(model, optim, torch.randn(2, 8))
    except spmd_aot.SpmdAotError as exc:
        return type(exc).__name__, str(exc)
    return "ok", ""


def test_trace_failure_on_rank0_reaches_every_rank(tmp_path):
    results = run_ranks(_trace_failure_worker, 2, str(tmp_path), timeout=120)
    for kind, msg in results:
        assert kind == "UnsupportedError", msg
        # rank 0's message, with the user's line that branched on a value (data_dependent.py)
        assert "branches on a tensor's value" in msg and "test_runtime.py" in msg, msg


# ---------------------------------------------------------------- ranks without cache access
def _no_access_worker(rank, world, shared_cache, private_cache):
    cache = shared_cache if rank == 0 else private_cache
    _, _, losses, info = compiled_run("mlp", "adamw", rank, world, 3, cache, require_hit=True)
    ref_model, _, ref_losses = eager_ddp("mlp", "adamw", rank, world, 3)
    return info.hit, info.digest, max(abs(a.item() - b.item()) for a, b in zip(losses, ref_losses))


def _no_access_both_worker(rank, world, shared_cache, private_caches):
    return {name: _no_access_worker(rank, world, shared_cache, path) for name, path in private_caches.items()}


@pytest.fixture(scope="module")
def no_access(tmp_path_factory):
    """Both kinds of inaccessible rank-1 cache, one after the other in the same two ranks."""
    root = tmp_path_factory.mktemp("no-access")
    built = spmd_aot.build(make_job("mlp", "adamw"), world_size=2, cache_dir=root / "shared")
    (root / "file").write_text("not a directory")
    private = {"empty-dir": str(root / "elsewhere"),
               # a cache path below a regular file: nothing can be created or read there
               "unwritable": str(root / "file" / "cache")}
    return root, built, run_ranks(_no_access_both_worker, 2, str(root / "shared"), private)


@pytest.mark.parametrize("private", ["empty-dir", "unwritable"])
def test_ranks_without_cache_access_get_the_artifact_from_rank0(no_access, private):
    root, built, results = no_access
    for per_rank in results:
        hit, digest, loss_diff = per_rank[private]
        assert hit and digest == built.digest and loss_diff <= 1e-5
    if private == "empty-dir":
        assert not any((root / "elsewhere").rglob("*.tmp"))

"""A step built offline, loaded from the cache and run on real gloo ranks matches eager DDP."""

import pytest

import spmd_aot
from support.jobs import compiled_run, ddp_bucket_count, eager_ddp, make_job, max_diffs
from support.multiproc import start_ranks

STEPS = 5
TOL = 1e-5


def _parity_worker(rank, world, model_name, optim_name, cache_dir):
    ref_model, ref_optim, ref_losses = eager_ddp(model_name, optim_name, rank, world, STEPS)
    model, optim, losses, info = compiled_run(model_name, optim_name, rank, world, STEPS, cache_dir,
                                              require_hit=True)
    return {**max_diffs(ref_model, ref_optim, ref_losses, model, optim, losses), "hit": info.hit,
            "source": info.source, "digest": info.digest}


CASES = [("mlp", "sgd"), ("mlp", "adamw"), ("transformer", "sgd"), ("transformer", "adamw")]


def _all_cases_worker(rank, world, cache_dirs):
    """Every case in one process per rank (torch starts once per rank, not once per case)."""
    return {case: _parity_worker(rank, world, *case, cache_dirs[case]) for case in CASES}


@pytest.fixture(scope="module")
def parity(tmp_path_factory):
    """world -> ({case: build result}, per-rank {case: diffs}); each case has its own cache.

    One world's ranks run while this process builds the next world's artifacts."""
    builds, launches = {}, {}
    for world in (4, 2, 1):  # the longest launch first
        dirs = {case: str(tmp_path_factory.mktemp(f"parity-{world}-{'-'.join(case)}")) for case in CASES}
        builds[world] = {case: spmd_aot.build(make_job(*case), world_size=world, cache_dir=dirs[case])
                         for case in CASES}
        # world 1 runs with no process group at all, as a plain single-process job does
        launches[world] = start_ranks(_all_cases_worker, world if world > 1 else 0, dirs)
    return {world: (builds[world], launches[world].result()) for world in (1, 2, 4)}


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("model_name,optim_name", CASES)
def test_offline_build_matches_eager_ddp(parity, world, model_name, optim_name):
    builds, results = parity[world]
    built = builds[model_name, optim_name]
    assert built.traced
    if world > 1:
        # gradients travel in buckets, never more of them than DDP makes for the same caps
        buckets = built.stats["by_kind"]["all_reduce"]
        assert set(built.stats["by_kind"]) == {"all_reduce"}
        assert 1 <= buckets <= ddp_bucket_count(make_job(model_name, optim_name).model())
    for per_rank in results:
        r = per_rank[model_name, optim_name]
        assert r["hit"] and r["source"] == "cache" and r["digest"] == built.digest
        assert r["param"] <= TOL, r
        assert r["state"] <= TOL, r
        assert r["loss"] <= TOL, r

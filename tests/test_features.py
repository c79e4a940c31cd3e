"""Every training feature x placement traces, stores, loads and matches eager PyTorch
(DDP for replicate, FSDP2 fully_shard for shard and HSDP) after 5 steps, on real gloo ranks."""

import pytest

from support.features import FEATURES
from support.multiproc import run_launches

STEPS = 5


def _all_features_worker(rank, world, variants, cache_dir):
    import traceback

    from support import features

    out = {}
    for feature in features.FEATURES:
        for variant in variants:
            try:
                ref = features.reference(feature, variant, rank, world, STEPS)
                got = features.compiled(feature, variant, rank, world, STEPS, f"{cache_dir}/{feature}-{variant}")
                out[feature, variant] = features.max_diffs(ref[0], ref[1], got[0], got[1], ref[2], got[2])
            except Exception as exc:
                out[feature, variant] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-1500:]}"
    return out


WORLD_VARIANTS = {2: ["replicate", "shard", "shard_keep_1d_whole"],
                  4: ["replicate", "shard", "hsdp", "hsdp_keep_1d_whole"]}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """One launch per world size (each rank starts once), both at the same time: while one
    launch's rank 0 traces, the other's ranks use the other CPU. Checked feature by feature below."""
    cache = tmp_path_factory.mktemp("features")
    launches = [(_all_features_worker, world, variants, str(cache / f"w{world}"))
                for world, variants in WORLD_VARIANTS.items()]
    return dict(zip(WORLD_VARIANTS, run_launches(*launches, timeout=600)))


CASES = [(w, f, v) for w, vs in WORLD_VARIANTS.items() for f in FEATURES for v in vs]


@pytest.mark.parametrize("world,feature,variant", CASES)
def test_feature_matches_eager(results, world, feature, variant):
    tolerance = FEATURES[feature][4]
    for rank, per_rank in enumerate(results[world]):
        diffs = per_rank[feature, variant]
        assert isinstance(diffs, dict), f"rank {rank}: {diffs}"
        assert diffs["param"] <= tolerance and diffs["state"] <= tolerance and diffs["loss"] <= tolerance, \
            f"rank {rank}: {diffs}"

"""Train steps as users write them (issue 21): each pattern builds, hits on every rank and
matches eager DDP / FSDP2 at world 2, on real gloo ranks; the stored graphs hold the
collectives the README promises."""

import pytest

import spmd_aot
import train_steps
from multiproc import run_ranks

STEPS = 3
TOLERANCE = 1e-5


def _parity_worker(rank, world, names, cache_dir):
    out = {}
    for name in names:
        for placement in train_steps.PLACEMENTS:
            cache = f"{cache_dir}/{name}-{placement}"
            diffs, _ = train_steps.run(name, placement, rank, world, STEPS, cache)
            out[name, placement] = diffs, train_steps.compiled_again(name, placement, rank, cache)
    return out


@pytest.fixture(scope="module")
def parity(tmp_path_factory):
    names = list(train_steps.JOBS)
    return names, run_ranks(_parity_worker, 2, names, str(tmp_path_factory.mktemp("train-steps")), timeout=600)


@pytest.mark.parametrize("name", list(train_steps.JOBS))
@pytest.mark.parametrize("placement", list(train_steps.PLACEMENTS))
def test_pattern_matches_eager_and_hits_on_every_rank(parity, name, placement):
    _, results = parity
    for rank, per_rank in enumerate(results):
        diffs, hit = per_rank[name, placement]
        assert max(diffs.values()) <= TOLERANCE, f"rank {rank}: {diffs}"
        assert hit, f"rank {rank} missed the cache a first call filled"


# ---------------------------------------------------------------------------- accumulation
@pytest.mark.parametrize("placement", ["replicate", "shard"])
def test_accumulation_stores_one_micro_batch_of_reductions(tmp_path, placement):
    """Two micro-batches reduce once: the same all_reduces (replicate, bucketed) or
    reduce_scatters (shard) as one plain step of the same model."""
    accumulated = spmd_aot.build(train_steps.job("accumulation_adamw"), world_size=2, placement=placement,
                                 cache_dir=tmp_path).stats
    plain = spmd_aot.build(spmd_aot.Job(step=train_steps.plain_step, model=train_steps.mlp,
                                        optimizer=train_steps.adamw, batch=lambda: train_steps.class_batch(0, 0)),
                           world_size=2, placement=placement, cache_dir=tmp_path).stats
    assert accumulated["micro_batches"] == 2 and "micro_batches" not in plain
    assert accumulated["by_kind"] == plain["by_kind"], (accumulated["by_kind"], plain["by_kind"])
    assert accumulated["by_kind"].get("all_reduce" if placement == "replicate" else "reduce_scatter_tensor")


def test_accumulation_under_shard_regathers_resharded_groups_per_micro_batch(tmp_path):
    """The bar under shard is FSDP2's with reshard_after_forward=True: a resharded group is
    gathered in each micro-batch's forward and backward, the root once; one reduce_scatter per
    group per optimizer step."""
    stats = spmd_aot.build(train_steps.job("accumulation_adamw", model=train_steps.Blocks), world_size=2,
                           placement="shard", cache_dir=tmp_path).stats
    gathers, reductions = {}, {}
    for entry in stats["comm"]:
        count = gathers if entry["kind"] == "all_gather_into_tensor" else reductions
        count[entry["label"]] = count.get(entry["label"], 0) + 1
    assert reductions == {"blocks.0": 1, "blocks.2": 1, "root": 1}
    # blocks.2 re-gathers for backward in each micro-batch; blocks.0's backward (the first layer)
    # needs no weight, so its one gather serves both forwards; the root stays gathered
    assert gathers == {"blocks.0": 1, "blocks.2": 2 * train_steps.MICRO, "root": 1}


# ---------------------------------------------------------------------------- data-dependent code
REFUSED = {  # step, model, what the message quotes, advice it gives
    "grad_scaler": (train_steps.scaler_step, train_steps.mlp, "scaler.step(optim)", "GradScaler"),
    "item": (train_steps.item_step, train_steps.mlp, "if loss.item() > 100.0:", "torch.where"),
    "bool_tensor": (train_steps.bool_step, train_steps.mlp, "if torch.isfinite(loss):", "torch.where"),
    "nonzero_in_module": (train_steps.plain_step, train_steps.Routed, ".nonzero()", "in module <root> (Routed)"),
}


@pytest.mark.parametrize("case", list(REFUSED))
@pytest.mark.parametrize("placement", ["replicate", "shard"])
def test_data_dependent_code_is_refused_naming_the_users_line(tmp_path, case, placement):
    """Not torch's `aten._local_scalar_dense`: the user's file, line and code, and what to do."""
    step, model, quoted, advice = REFUSED[case]
    job = spmd_aot.Job(step=step, model=model, optimizer=train_steps.sgd, batch=lambda: train_steps.class_batch(0, 0))
    with pytest.raises(spmd_aot.UnsupportedError) as info:
        spmd_aot.build(job, world_size=2, placement=placement, cache_dir=tmp_path)
    message = str(info.value)
    assert "train_steps.py:" in message and quoted in message and advice in message, message
    assert "without host synchronisation" in message

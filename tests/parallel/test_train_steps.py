"""Train steps as users write them: each pattern builds, hits on every rank and
matches eager DDP / FSDP2 at world 2, on real gloo ranks; the stored graphs hold the
collectives the README promises."""

import pytest

import spmd_aot
from support import train_steps
from support.multiproc import run_ranks

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


# ---------------------------------------------------------------------------- several optimizers
def test_several_optimizers_follow_their_schedulers_without_a_rebuild(tmp_path):
    """Each group's learning rate is a graph input: schedulers on each optimizer of a list
    change the compiled step's update as eager's, with one trace."""
    import torch

    def make():
        torch.manual_seed(0)
        model = train_steps.mlp()
        optims = train_steps.matrices_and_vectors(model)
        scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=g) for o, g in zip(optims, (0.5, 3.0))]
        return model, optims, scheds

    ref, ref_optims, ref_scheds = make()
    model, optims, scheds = make()
    fn = spmd_aot.compile(train_steps.several_optimizers_step, cache_dir=tmp_path)
    for s in range(3):
        batch = train_steps.class_batch(0, s)
        train_steps.several_optimizers_step(ref, ref_optims, batch)
        fn(model, optims, batch)
        for sched in ref_scheds + scheds:
            sched.step()
    assert optims[1].param_groups[0]["lr"] == pytest.approx(1e-2 * 27)
    diff = max((a - b).abs().max().item() for a, b in zip(ref.parameters(), model.parameters()))
    assert diff <= TOLERANCE
    assert fn.cache_info.traces == 1, fn.cache_info


def test_several_optimizers_key_holds_the_container(tmp_path):
    """The step is called with the user's container: a list and a dict of the same optimizers
    are different steps; a container holding something else is refused saying what to pass."""
    import torch

    def job(optimizer):
        return spmd_aot.Job(step=train_steps.several_optimizers_step, model=train_steps.mlp,
                            optimizer=optimizer, batch=lambda: train_steps.class_batch(0, 0))

    as_list = spmd_aot.build(job(train_steps.matrices_and_vectors), world_size=2, cache_dir=tmp_path)
    as_dict = spmd_aot.build(job(lambda m: dict(enumerate(train_steps.matrices_and_vectors(m)))),
                             world_size=2, cache_dir=tmp_path)
    assert as_list.key != as_dict.key
    with pytest.raises(spmd_aot.UnsupportedError, match="must hold torch.optim.Optimizer"):
        spmd_aot.build(job(lambda m: [torch.optim.SGD(m.parameters(), lr=0.1), "adamw"]),
                       world_size=2, cache_dir=tmp_path)


# ---------------------------------------------------------------------------- module copies
@pytest.mark.parametrize("placement", ["replicate", "shard"])
def test_ema_copy_made_by_deepcopy_in_the_factory_builds(tmp_path, placement):
    """The deep-copied fake parameters share the factory's FakeTensorMode (they used to get a
    second one: "fake mode ... doesn't match mode"); under shard the copy is sharded and
    updated shard by shard: no collective beyond the plain step's."""
    built = spmd_aot.build(train_steps.job("ema_copy"), world_size=2, placement=placement, cache_dir=tmp_path)
    plain = spmd_aot.build(spmd_aot.Job(step=train_steps.plain_step, model=train_steps.mlp,
                                        optimizer=train_steps.adamw, batch=lambda: train_steps.class_batch(0, 0)),
                           world_size=2, placement=placement, cache_dir=tmp_path)
    assert built.stats["by_kind"] == plain.stats["by_kind"]


def test_reading_a_sharded_parameter_after_its_in_place_update_is_refused(tmp_path):
    """Under shard the group was gathered before the update: the forward would read old
    values silently, so it is refused saying what to do; replicate reads the leaf and builds."""
    job = spmd_aot.Job(step=train_steps.ema_read_after_update_step, model=train_steps.WithEMA,
                       optimizer=train_steps.ema_adamw, batch=lambda: train_steps.class_batch(0, 0))
    spmd_aot.build(job, world_size=2, placement="replicate", cache_dir=tmp_path)
    with pytest.raises(spmd_aot.UnsupportedError, match="updated in place in the same step"):
        spmd_aot.build(job, world_size=2, placement="shard", cache_dir=tmp_path)

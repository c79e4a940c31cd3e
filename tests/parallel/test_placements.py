"""Placements beyond replicate: what the stored graphs contain, what the model looks like after
the first call, learning-rate schedules without retracing, override hooks, build-time errors."""

import pytest
import torch
from torch import nn

import spmd_aot
from spmd_aot.entries import read_artifact
from spmd_aot.store import LocalStore
from support.features import FEATURES
from support.multiproc import run_ranks


def _job(feature="sgd_nesterov_wd"):
    make_model, make_optim, step, batch, _ = FEATURES[feature]
    return spmd_aot.Job(step=step, model=make_model, optimizer=make_optim, batch=lambda: batch(0, 0))


def _artifact(tmp_path, built):
    return read_artifact(LocalStore(tmp_path), built.digest)


# ---------------------------------------------------------------- graph checks
def test_shard_graph_gathers_and_scatters_once_per_group_with_uneven_shards(tmp_path):
    # MLP(12, 24, 5): the head has 5 rows over 4 shards -> shards of 2, 2, 1, 0 rows (padded to 2).
    # No ModuleList/Sequential: all 6 parameters form the root group (never resharded)
    built = spmd_aot.build(_job(), world_size=4, placement="shard", cache_dir=tmp_path)
    assert built.stats["by_kind"] == {"all_gather_into_tensor": 1, "reduce_scatter_tensor": 1}
    art = _artifact(tmp_path, built)
    params = {s["fqn"]: s for s in art.layout["inputs"] if s["kind"] == "param"}
    head = params["head.weight"]
    assert head["global_shape"] == [5, 24] and head["local_shape"] == [2, 24]
    assert head["shard_rows"] == [[2, 2], [1, 1], [0, 1]] and head["placement"] == ["Shard(0)"]
    state = {s["fqn"]: s for s in art.layout["inputs"] if s["kind"] == "optim_state"}
    assert state["head.weight.momentum_buffer"]["local_shape"] == [2, 24]
    placeholders = [n for n, e in art.schema["nodes"].items() if "fqn" in e]
    assert len(placeholders) == len(art.layout["inputs"])  # the schema map records every input
    assert all(art.schema["nodes"][n]["placements"] for n in placeholders)


def test_hsdp_graph_reduces_over_both_mesh_dimensions(tmp_path):
    built = spmd_aot.build(_job(), world_size=4, placement="shard", mesh_shape=(2, 2), cache_dir=tmp_path)
    assert built.stats["by_kind"] == {"all_gather_into_tensor": 1, "reduce_scatter_tensor": 1, "all_reduce": 1}
    art = _artifact(tmp_path, built)
    head = next(s for s in art.layout["inputs"] if s["fqn"] == "head.weight")
    assert head["placement"] == ["Replicate()", "Shard(0)"] and head["shard_rows"] == [[3, 1], [2, 1]]
    groups = {e["group"] for e in art.schema["nodes"].values() if "collective" in e}
    assert groups == {0, 1}


def test_param_placements_keep_matching_parameters_whole(tmp_path):
    built = spmd_aot.build(_job(), world_size=2, placement="shard", cache_dir=tmp_path,
                           param_placements={"*.bias": "replicate"})
    assert built.stats["by_kind"] == {"all_gather_into_tensor": 1, "reduce_scatter_tensor": 1, "all_reduce": 3}
    art = _artifact(tmp_path, built)
    bias = next(s for s in art.layout["inputs"] if s["fqn"] == "head.bias")
    assert bias["placement"] == ["Replicate()"] and bias["local_shape"] == [5]


def test_replicate_graph_has_one_all_reduce_per_bucket_even_with_adamw(tmp_path):
    # caps so small that every gradient closes its own bucket: one all_reduce per gradient
    built = spmd_aot.build(_job("param_groups"), world_size=4, cache_dir=tmp_path,
                           bucket_cap_mb=1e-6, first_bucket_cap_mb=1e-6)
    assert built.stats["by_kind"] == {"all_reduce": 6}
    whole = spmd_aot.build(_job("param_groups"), world_size=4, cache_dir=tmp_path)
    assert whole.stats["by_kind"] == {"all_reduce": 1}  # 6 small gradients: one bucket, as DDP


# ---------------------------------------------------------------- the model after the first call
def _sharded_model_worker(rank, world, cache_dir):
    from torch.distributed.tensor import DTensor

    from support import features

    model, optim, _, fn = features.compiled("sgd_nesterov_wd", "shard", rank, world, 2, cache_dir)
    ref, ref_optim, _ = features.reference("sgd_nesterov_wd", "shard", rank, world, 2)
    head = model.head.weight
    return {
        "all_dtensor": all(isinstance(p, DTensor) and isinstance(p, nn.Parameter) for p in model.parameters()),
        "placements": [str(p) for p in head.placements],
        "local_rows": head.to_local().shape[0],
        "full_equal": all(torch.allclose(a.full_tensor(), b.full_tensor(), atol=1e-6)
                          for a, b in zip(model.parameters(), ref.parameters())),
        "optimizer_holds_model_params": all(a is b for a, b in zip(optim.param_groups[0]["params"],
                                                                     model.parameters())),
        "state_is_dtensor": isinstance(optim.state[head]["momentum_buffer"], DTensor),
        "state_dict_keys": sorted(model.state_dict()) == sorted(ref.state_dict()),
    }


def test_after_the_first_call_parameters_are_sharded_dtensors_like_fsdp2(tmp_path):
    results = run_ranks(_sharded_model_worker, 4, str(tmp_path))
    assert [r["local_rows"] for r in results] == [2, 2, 1, 0]
    for r in results:
        assert r["all_dtensor"] and r["placements"] == ["S(0)"] and r["full_equal"]
        assert r["optimizer_holds_model_params"] and r["state_is_dtensor"] and r["state_dict_keys"]


# ---------------------------------------------------------------- learning-rate schedules
def _scheduler_worker(rank, world, cache_dir, placement):
    import spmd_aot.building.pipeline
    from support.features import FEATURES

    traces = []
    original = spmd_aot.building.pipeline.trace_to_blobs
    spmd_aot.building.pipeline.trace_to_blobs = lambda *a, **k: traces.append(1) or original(*a, **k)
    make_model, make_optim, step, batch, _ = FEATURES["adam"]

    def run(compiled):
        torch.manual_seed(0)
        model = make_model()
        if not compiled and world > 1:
            from torch.nn.parallel import DistributedDataParallel
            wrapped = DistributedDataParallel(model) if placement == "replicate" else model
            if placement == "shard":
                from torch.distributed.fsdp import fully_shard
                fully_shard(model)
        else:
            wrapped = model
        optim = make_optim(model)
        sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: 1.0 / (1 + s))
        fn = spmd_aot.compile(step, placement=placement, cache_dir=cache_dir) if compiled else step
        for s in range(5):
            fn(wrapped, optim, batch(rank, s))
            sched.step()
        return model, fn

    ref, _ = run(False)
    got, fn = run(True)
    diff = max((a.full_tensor() if hasattr(a, "full_tensor") else a).sub(
        b.full_tensor() if hasattr(b, "full_tensor") else b).abs().max().item()
        for a, b in zip(ref.parameters(), got.parameters()))
    return len(traces), diff


def _schedulers_worker(rank, world, cache_dir):
    """Both placements, each started twice (the second start a fresh ``compile``, as a new
    job's), in one process per rank: torch starts once per rank, not once per start."""
    out = {}
    for placement in ("replicate", "shard"):
        first = _scheduler_worker(rank, world, f"{cache_dir}/{placement}", placement)
        second = _scheduler_worker(rank, world, f"{cache_dir}/{placement}", placement)
        out[placement] = first, second
    return out


@pytest.fixture(scope="module")
def schedulers(tmp_path_factory):
    return run_ranks(_schedulers_worker, 2, str(tmp_path_factory.mktemp("schedulers")))


@pytest.mark.parametrize("placement", ["replicate", "shard"])
def test_lr_scheduler_changes_lr_without_retracing(schedulers, placement):
    for per_rank in schedulers:
        (traces, diff), (traces_again, diff_again) = per_rank[placement]
        assert diff <= 1e-5 and diff_again <= 1e-5
        assert traces_again == 0  # 2nd start: hit


# ---------------------------------------------------------------- override hooks
class DataDependentNorm(nn.Module):
    """Rescales only when the activation is large: Python control flow on a tensor value."""

    def __init__(self, d):
        super().__init__()
        self.gain = nn.Parameter(torch.ones(d))

    def forward(self, x):
        if x.abs().max() > 1.0:
            x = x / x.abs().max()
        return x * self.gain


class TraceableNorm(nn.Module):
    def __init__(self, original):
        super().__init__()
        self.gain = original.gain

    def forward(self, x):
        peak = x.abs().max()
        return torch.where(peak > 1.0, x / peak, x) * self.gain


class OverrideNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(12, 16)
        self.norm = DataDependentNorm(16)
        self.head = nn.Linear(16, 5)

    def forward(self, x):
        return self.head(torch.relu(self.norm(self.fc(x) * 3)))


class SwapNorm(spmd_aot.Override):
    def replacement(self, fqn, submodule):
        return TraceableNorm(submodule) if isinstance(submodule, DataDependentNorm) else submodule

    def transform(self, gm, layout):
        """Rewrite relu as clamp_min(x, 0): a stored graph rewrite the tests can see."""
        for node in gm.graph.nodes:
            if node.target is torch.ops.aten.relu.default:
                node.target = torch.ops.aten.clamp_min.default
                node.args = (node.args[0], 0.0)
        return gm


def _override_step(model, optim, batch):
    x, y = batch
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def _override_job():
    from support.features import _class_batch

    return spmd_aot.Job(step=_override_step, model=OverrideNet,
                        optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
                        batch=lambda: _class_batch(0, 0))


def test_untraceable_module_fails_at_build_naming_the_module(tmp_path):
    with pytest.raises(spmd_aot.UnsupportedError, match=r"norm \(DataDependentNorm\)"):
        spmd_aot.build(_override_job(), world_size=2, cache_dir=tmp_path)


def _override_worker(rank, world, cache_dir):
    from support.features import _class_batch

    torch.manual_seed(0)
    ref = OverrideNet()
    from torch.nn.parallel import DistributedDataParallel
    ddp = DistributedDataParallel(ref)
    ref_optim = torch.optim.SGD(ref.parameters(), lr=0.1)
    torch.manual_seed(0)
    model = OverrideNet()
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    fn = spmd_aot.compile(_override_step, cache_dir=cache_dir, module_override=[SwapNorm()], require_hit=True)
    for s in range(5):
        _override_step(ddp, ref_optim, _class_batch(rank, s))
        fn(model, optim, _class_batch(rank, s))
    diff = max((a - b).abs().max().item() for a, b in zip(ref.parameters(), model.parameters()))
    return diff, type(model.norm).__name__


def test_override_replacement_and_transform_are_built_stored_and_match_eager(tmp_path):
    built = spmd_aot.build(_override_job(), world_size=2, cache_dir=tmp_path, module_override=[SwapNorm()])
    code = _artifact(tmp_path, built).code
    assert "clamp_min" in code and "aten.relu" not in code
    for diff, norm_type in run_ranks(_override_worker, 2, str(tmp_path)):
        assert diff <= 1e-5
        assert norm_type == "DataDependentNorm"  # the user's model is left as it was


def test_gm_transformation_is_applied_keyed_and_guarded(tmp_path, monkeypatch):
    import importlib

    from spmd_aot.entries import read_manifest
    from spmd_aot.store import open_store

    # a helper only the transformation runs (not the trace): its file must be guarded all the same
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "node_counter.py").write_text("def count(gm, seen):\n    seen.append(len(gm.graph.nodes))\n")
    monkeypatch.syspath_prepend(str(tmp_path / "lib"))
    counter = importlib.import_module("node_counter")
    seen = []

    def count_nodes(gm):
        counter.count(gm, seen)

    plain = spmd_aot.build(_job(), world_size=2, cache_dir=tmp_path / "cache")
    hooked = spmd_aot.build(_job(), world_size=2, cache_dir=tmp_path / "cache", gm_transformation=count_nodes)
    assert seen and seen[0] > 0 and hooked.traced and hooked.key != plain.key
    guarded = {path for path, *_ in read_manifest(open_store(tmp_path / "cache"), hooked.digest)["guards"]["files"]}
    assert "node_counter.py" in guarded, guarded


def test_override_changing_parameters_is_refused(tmp_path):
    class Bad(spmd_aot.Override):
        def replacement(self, fqn, submodule):
            return nn.Linear(16, 16) if isinstance(submodule, DataDependentNorm) else submodule

    with pytest.raises(spmd_aot.UnsupportedError, match="must keep the same parameters"):
        spmd_aot.build(_override_job(), world_size=2, cache_dir=tmp_path, module_override=[Bad()])


def test_shard_under_replicate_override_is_refused():
    with pytest.raises(spmd_aot.SpmdAotError, match="use placement='shard'"):
        spmd_aot.Plan(2, "replicate", param_placements={"*": "shard"})


def test_building_for_cuda_on_a_cpu_only_torch_says_what_to_install(tmp_path):
    if torch.backends.cuda.is_built():
        pytest.skip("this torch has CUDA support; the refusal applies to CPU-only builds")
    with pytest.raises(spmd_aot.SpmdAotError, match="CUDA-enabled torch build"):
        spmd_aot.build(_job(), world_size=2, device="cuda", cache_dir=tmp_path)


def test_builds_in_one_process_leave_no_process_group_residue(tmp_path):
    """The CLI builds many configurations in one process: each fake process group must go
    without leaving hooks or cached groups behind (DTensor caches decisions per mesh)."""
    import sys

    import torch.distributed as dist

    hook = sys.excepthook
    digests = []
    for i, (world, placement, mesh) in enumerate([(2, "shard", None), (2, "replicate", None),
                                                  (4, "shard", (2, 2)), (2, "shard", None)]):
        built = spmd_aot.build(_job("grad_clipping"), world_size=world, placement=placement,
                               mesh_shape=mesh, cache_dir=tmp_path / str(i))
        assert built.traced
        digests.append(_artifact(tmp_path / str(i), built).manifest["blobs"]["graph"])
    assert digests[0] == digests[3]  # the same configuration traced again stores the same graph
    assert sys.excepthook is hook and not dist.is_initialized()


def test_hsdp_reduces_whole_parameters_with_one_all_reduce_over_the_world(tmp_path):
    built = spmd_aot.build(_job(), world_size=4, placement="shard", mesh_shape=(2, 2), cache_dir=tmp_path,
                           param_placements={"*.bias": "replicate"})
    # 3 sharded weights in one group: gather + scatter + replica all_reduce; 3 whole biases: one
    # all_reduce each
    assert built.stats["by_kind"] == {"all_gather_into_tensor": 1, "reduce_scatter_tensor": 1, "all_reduce": 4}
    groups = [e["group"] for e in _artifact(tmp_path, built).schema["nodes"].values()
              if e.get("collective") == "all_reduce"]
    assert sorted(groups, key=str) == [0, "world", "world", "world"]

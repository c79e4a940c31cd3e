"""Gradient buckets under replicate: counts against DDP's, overlap on the stored graph, parity
with eager DDP using the same caps, options in the key, and what `spmd-aot show` lists."""

import pytest
import torch

import spmd_aot
from support.jobs import ddp_bucket_count, fresh_objects, make_batch, make_job, max_diffs, MODELS, OPTIMIZERS
from support.multiproc import run_ranks
from spmd_aot.examples.models import train_step
from spmd_aot.passes.buckets import assign_buckets
from spmd_aot.store import open_store

SMALL = {"bucket_cap_mb": 8 / 1024, "first_bucket_cap_mb": 2 / 1024}  # 8 KiB buckets, 2 KiB first


@pytest.fixture(scope="module")
def small_buckets(tmp_path_factory):
    cache = tmp_path_factory.mktemp("buckets")
    built = spmd_aot.build(make_job("transformer", "adamw"), world_size=2, cache_dir=cache, **SMALL)
    return cache, built


def _artifact(cache, built):
    from spmd_aot.entries import read_artifact

    return read_artifact(open_store(cache), built.digest)


def test_assignment_closes_a_bucket_once_it_reaches_its_cap():
    assert assign_buckets([4, 4, 4, 4, 4], cap_bytes=8, first_cap_bytes=4) == [[0], [1, 2], [3, 4]]
    assert assign_buckets([100], cap_bytes=8, first_cap_bytes=4) == [[0]]
    assert assign_buckets([], cap_bytes=8, first_cap_bytes=4) == []


def test_no_more_all_reduces_than_ddp_buckets_for_the_same_caps(small_buckets):
    cache, built = small_buckets
    ours = built.stats["by_kind"]["all_reduce"]
    theirs = ddp_bucket_count(MODELS["transformer"](), SMALL["bucket_cap_mb"], SMALL["first_bucket_cap_mb"])
    assert set(built.stats["by_kind"]) == {"all_reduce"}
    assert 3 <= ours <= theirs, (ours, theirs)
    n_params = len(list(MODELS["transformer"]().parameters()))
    listed = [p for entry in built.stats["comm"] for p in entry["params"]]
    assert sorted(listed) == sorted(n for n, _ in MODELS["transformer"]().named_parameters())
    assert len(listed) == n_params


def test_bucket_all_reduce_is_issued_before_backward_ends_and_waited_at_first_reader(small_buckets):
    cache, built = small_buckets
    nodes = list(_artifact(cache, built).graph_module(["g0"], torch.device("cpu")).graph.nodes)
    names = [getattr(n.target, "__name__", str(n.target)) for n in nodes]
    first = names.index("all_reduce_.default")
    wait = next(i for i in range(first, len(nodes)) if names[i] == "wait_tensor.default"
                and nodes[i].args[0] is nodes[first])
    between = names[first + 1: wait]
    # backward keeps computing gradients (matmuls of earlier layers) while the bucket is reduced
    assert "mm.default" in between, between[:20]
    # and the wait sits right before the first op that reads the reduced bucket
    assert min(list(nodes[wait].users), key=nodes.index) is nodes[wait + 1]


def _parity_worker(rank, world, cache_dir):
    from torch.nn.parallel import DistributedDataParallel

    steps = 4
    model, _ = fresh_objects("transformer", "adamw")
    ddp = DistributedDataParallel(model, bucket_cap_mb=SMALL["bucket_cap_mb"])
    ref_optim = OPTIMIZERS["adamw"](ddp)
    ref_losses = [train_step(ddp, ref_optim, make_batch("transformer", rank, s)).detach() for s in range(steps)]
    m2, o2 = fresh_objects("transformer", "adamw")
    step = spmd_aot.compile(train_step, cache_dir=cache_dir, require_hit=True, **SMALL)
    losses = [step(m2, o2, make_batch("transformer", rank, s)).detach() for s in range(steps)]
    diffs = max_diffs(model, ref_optim, ref_losses, m2, o2, losses)
    return diffs["param"], diffs["state"], diffs["loss"], step.cache_info.hit


def test_small_buckets_match_eager_ddp_with_the_same_caps(small_buckets):
    cache, built = small_buckets
    for param, opt, loss, hit in run_ranks(_parity_worker, 2, str(cache)):
        assert hit
        assert param <= 1e-5 and opt <= 1e-5 and loss <= 1e-5, (param, opt, loss)


def test_bucket_caps_are_part_of_the_key(tmp_path):
    job = make_job("mlp", "sgd")
    from spmd_aot.building.builder import job_key
    from spmd_aot.parallel.plan import Plan

    base = job_key(job, Plan(2)).key
    assert job_key(job, Plan(2)).key == base
    assert job_key(job, Plan(2, bucket_cap_mb=1.0)).key != base
    assert job_key(job, Plan(2, first_bucket_cap_mb=2.0)).key != base


def test_show_lists_buckets_with_bytes_and_parameters(small_buckets, capsys):
    from spmd_aot.cli.app import main

    cache, built = small_buckets
    assert main(["show", built.key[:12], "--cache-dir", str(cache)]) == 0
    out = capsys.readouterr().out
    assert "bucket_cap_mb:" in out and "first_bucket_cap_mb:" in out
    section = out.split("communication per step", 1)[1].split("blobs:", 1)[0]
    assert "bucket 0" in section and "head.bias" in section and "KiB" in section
    assert section.count("all_reduce") == built.stats["by_kind"]["all_reduce"]


def test_invalid_bucket_caps_are_refused():
    from spmd_aot.errors import SpmdAotError
    from spmd_aot.parallel.plan import Plan

    for bad in (0, -1, "25", True):
        with pytest.raises(SpmdAotError, match="bucket_cap_mb"):
            Plan(2, bucket_cap_mb=bad)
    with pytest.raises(TypeError):
        spmd_aot.compile(train_step, bucket_capmb=3)


def _two_gradient_graph(read_first_early: bool) -> torch.fx.GraphModule:
    """x and y reduced separately; the first result read before or after the second reduce."""
    ops = torch.ops._c10d_functional
    g = torch.fx.Graph()
    x, y = g.placeholder("x"), g.placeholder("y")
    for p in (x, y):
        p.meta["val"] = torch.empty(4, device="meta")
    ar1 = g.call_function(ops.all_reduce.default, (x, "avg", "0"))
    w1 = g.call_function(ops.wait_tensor.default, (ar1,))
    early = g.call_function(torch.ops.aten.add.Tensor, (w1, 1)) if read_first_early else None
    ar2 = g.call_function(ops.all_reduce.default, (y, "avg", "0"))
    w2 = g.call_function(ops.wait_tensor.default, (ar2,))
    late = g.call_function(torch.ops.aten.add.Tensor, (w1 if early is None else early, w2))
    g.output((late,))
    return torch.fx.GraphModule(torch.nn.Module(), g)


def test_a_gradient_read_before_its_bucket_is_complete_keeps_its_own_all_reduce():
    from spmd_aot.passes.buckets import bucket_gradient_all_reduces

    kinds = lambda gm: [n.target for n in gm.graph.nodes if n.op == "call_function"]  # noqa: E731
    together = _two_gradient_graph(read_first_early=False)
    bucket_gradient_all_reduces(together, 25.0, 25.0)
    assert kinds(together).count(torch.ops._c10d_functional.all_reduce_.default) == 1
    apart = _two_gradient_graph(read_first_early=True)
    bucket_gradient_all_reduces(apart, 25.0, 25.0)
    assert kinds(apart).count(torch.ops._c10d_functional.all_reduce.default) == 2
    apart.graph.lint()


def test_weight_gradients_are_written_straight_into_their_bucket(small_buckets):
    """Every weight gradient (a matmul's output) is computed into its slice of the bucket, so no
    bucket is copied in whole; the other gradients (biases, norms, embeddings) are copied in."""
    cache, built = small_buckets
    nodes = _artifact(cache, built).check()
    by_target = {}
    for n in nodes:
        if n.op == "call_function":
            by_target.setdefault(str(n.target), []).append(n)
    weights = [p for name, p in MODELS["transformer"]().named_parameters()
               if p.ndim == 2 and not name.startswith(("tok", "pos"))]
    written = by_target.get("aten.mm.out", [])
    assert len(written) == len(weights)
    index = {n.name: i for i, n in enumerate(nodes)}
    for n in written:  # out= is a view of a slice of a fresh flat buffer that an all_reduce_ reduces
        view = nodes[n.kwargs["out"].index]
        sliced = nodes[view.args[0].index]
        flat = nodes[sliced.args[0].index]
        assert (str(view.target), str(sliced.target), str(flat.target)) == (
            "aten.view.default", "aten.slice.Tensor", "aten.empty.memory_format")
        reducers = [m for m in by_target["_c10d_functional.all_reduce_.default"] if m.args[0].index == index[flat.name]]
        assert len(reducers) == 1 and index[reducers[0].name] > index[n.name]


def test_a_view_of_a_reduced_gradient_read_late_does_not_split_its_bucket():
    """torch 2.14's tracer puts the optimizer's ``alias`` of a reduced gradient right after its
    wait, before the next gradient exists; the pass moves such views down and still buckets."""
    from spmd_aot.passes.buckets import bucket_gradient_all_reduces

    c10d, aten = torch.ops._c10d_functional, torch.ops.aten
    graph = torch.fx.Graph()
    grads = [graph.placeholder(f"g{i}") for i in range(2)]
    for g in grads:
        g.meta["val"] = torch.empty(4, device="meta")
    aliases = []
    for g in grads:
        reduced = graph.call_function(c10d.all_reduce.default, (g, "avg", "0"))
        waited = graph.call_function(c10d.wait_tensor.default, (reduced,))
        aliases.append(graph.call_function(aten.alias.default, (waited,)))
        for n in (reduced, waited, aliases[-1]):
            n.meta["val"] = torch.empty(4, device="meta")
    graph.output(graph.call_function(aten.add.Tensor, tuple(aliases)))
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    buckets = bucket_gradient_all_reduces(gm, cap_mb=1.0, first_cap_mb=1.0)
    assert len(buckets) == 1
    targets = [n.target for n in gm.graph.nodes]
    assert targets.count(c10d.all_reduce_.default) == 1 and c10d.all_reduce.default not in targets
    graph.lint()

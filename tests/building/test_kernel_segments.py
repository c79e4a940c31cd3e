"""The stored graph cut into segments (``kernel_segments``, ``kernel_list_ops``): run call by call as
a load runs the kernels blob, the segments compute what the whole graph computes, and a deeper
model adds calls, not libraries. Eager and on CPU: no Inductor compile, seconds."""

import pytest
import torch

import spmd_aot
from spmd_aot.building import kernels
from spmd_aot.entries import read_manifest
from spmd_aot.examples.models import Transformer
from spmd_aot.store import open_store

VOCAB, SEQ = 64, 16


def clipped_step(model, optim, batch):
    """The canonical step with foreach gradient clipping: a global norm read by every block's update."""
    x, y = batch
    loss = torch.nn.functional.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5, foreach=True)
    optim.step()
    optim.zero_grad()
    return loss


def _job(layers: int) -> spmd_aot.Job:
    def batch():
        g = torch.Generator().manual_seed(0)
        return (torch.randint(0, VOCAB, (2, SEQ), generator=g), torch.randint(0, VOCAB, (2, SEQ), generator=g))

    return spmd_aot.Job(step=clipped_step,
                        model=lambda: Transformer(vocab=VOCAB, d_model=32, n_heads=2, n_layers=layers, max_len=SEQ),
                        optimizer=lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, foreach=True),
                        batch=batch)


def _blobs(cache, digest: str) -> dict[str, bytes]:
    store = open_store(cache)
    return {name: store.get(blob) for name, blob in read_manifest(store, digest)["blobs"].items()}


def _run_segments(parts, values: list) -> list:
    """The blob's calls, as a load runs them, with each segment run eagerly."""
    for call in parts.calls:
        values.extend(parts.modules[call.library](*[values[r] for r in call.inputs]))
    return [values[r] for r in parts.outputs]


def _inputs(slots) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.rand(s["local_shape"], generator=g).to(getattr(torch, s["dtype"]))
            if getattr(torch, s["dtype"]).is_floating_point
            else torch.randint(0, SEQ, s["local_shape"], generator=g) for s in slots]


@pytest.fixture(scope="module")
def depths(tmp_path_factory):
    cpu = torch.device("cpu")
    out = {}
    for layers in (3, 4):
        cache = tmp_path_factory.mktemp(f"segments{layers}")
        blobs = _blobs(cache, spmd_aot.build(_job(layers), world_size=1, cache_dir=cache).digest)
        whole = kernels.compilable_graph(blobs["graph"], blobs["constants"], [], None, cpu)
        cut = kernels.compilable_graph(blobs["graph"], blobs["constants"], [], None, cpu)
        parts, _ = kernels.segmented(cut, blobs["layout"], cpu)
        out[layers] = (whole, parts, kernels.slots_of(blobs["layout"]))
    return out


def test_segments_called_in_order_compute_the_whole_step(depths):
    for layers, (whole, parts, slots) in depths.items():
        expected_inputs = _inputs(slots)
        expected = whole(*expected_inputs)
        inputs = _inputs(slots)
        got = _run_segments(parts, list(inputs))
        assert len(got) == len(expected) and all(torch.equal(a, b) for a, b in zip(got, expected)), layers
        # parameters and optimizer state, updated in place by the segments as by the whole graph
        assert all(torch.allclose(a, b, rtol=0, atol=1e-6) for a, b in zip(inputs, expected_inputs)), layers
        assert any(not torch.equal(a, b) for a, b in zip(inputs, _inputs(slots))), "the step updated nothing"


def test_a_deeper_model_adds_calls_not_libraries(depths):
    import collections

    (_, shallow, _), (_, deep, _) = depths[3], depths[4]
    assert len(deep.modules) == len(shallow.modules) < len(shallow.calls), (shallow.describe(), deep.describe())
    # one more layer: one more call of each library a block repeats (forward, backward, the update's
    # phases before and after the clipping norm), nothing else
    repeated = [lib for lib, n in collections.Counter(c.library for c in deep.calls).items() if n > 1]
    assert len(repeated) >= 3 and len(deep.calls) - len(shallow.calls) == len(repeated), \
        (shallow.describe(), deep.describe())


def _sharded_worker(rank, world, cache, digest):
    """On a live gloo group: the shard step's segments (all-gathers, reduce-scatters and their waits
    inside them) called in order, against the whole graph."""
    import torch.distributed as dist

    from spmd_aot.format.kernels_blob import group_name
    from spmd_aot.runtime.kernel_load import _register_groups

    blobs = _blobs(cache, digest)
    cpu = torch.device("cpu")
    groups = [group_name(0)]
    _register_groups(groups, [dist.group.WORLD.group_name], None)
    whole = kernels.compilable_graph(blobs["graph"], blobs["constants"], groups, None, cpu)
    cut = kernels.compilable_graph(blobs["graph"], blobs["constants"], groups, None, cpu)
    parts, _ = kernels.segmented(cut, blobs["layout"], cpu)
    slots = kernels.slots_of(blobs["layout"])
    expected_inputs = _inputs(slots)
    expected = whole(*expected_inputs)
    inputs = _inputs(slots)
    got = _run_segments(parts, list(inputs))
    outputs = max((a - b).abs().max().item() for a, b in zip(got, expected))
    state = max((a.float() - b.float()).abs().max().item() for a, b in zip(inputs, expected_inputs))
    collectives = sum(1 for m in parts.modules for n in m.graph.nodes
                      if "spmd_aot.all_gather" in str(n.target) or "all_reduce" in str(n.target))
    return outputs, state, collectives, len(parts.modules), len(parts.calls)


@pytest.mark.parametrize("placement", ["shard", "replicate"])
def test_segments_with_their_collectives_compute_the_whole_step(tmp_path, placement):
    """Shard: all-gathers and reduce-scatters inside the blocks; replicate: gradient buckets
    all-reduced, the update reading its gradients as views of the buckets."""
    from support.multiproc import run_ranks

    digest = spmd_aot.build(_job(3), world_size=2, cache_dir=tmp_path, placement=placement).digest
    for outputs, state, collectives, libraries, calls in run_ranks(_sharded_worker, 2, str(tmp_path), digest):
        assert outputs == 0 and state < 1e-6, (outputs, state)
        assert collectives > 0 and calls > libraries, (collectives, libraries, calls)


def test_a_graph_that_cannot_be_cut_keeps_the_entry_interpreted(monkeypatch, tmp_path):
    """Kernels are an extra: a failure to cut the graph (as of Inductor's compile) stores the entry
    with its interpreted graph and the reason, never fails the build."""
    from spmd_aot.building import kernel_segments

    def broken(gm, whole=False):
        raise RuntimeError("no period today")

    monkeypatch.setattr(kernel_segments, "partition", broken)
    result = spmd_aot.build(_job(3), world_size=1, cache_dir=tmp_path, kernels=True)
    assert result.stats["kernels"].startswith("none: the graph could not be cut into segments: RuntimeError"), \
        result.stats["kernels"]

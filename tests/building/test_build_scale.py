"""Builds of large models: what the stored layout costs does not grow with the world size, and a
deep stack of identical blocks is stamped from three, node for node the full trace's graph.

A sharded input's real rows per rank are stored as ``[rows, ranks]`` runs; one number per rank
made an 80-layer AdamW step's layout at world 1024 decode past the load limit on objects, so
the build refused its own entry."""

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

import spmd_aot
from spmd_aot.building.builder import _fake_state
from spmd_aot.entries import read_artifact
from spmd_aot.examples.models import Transformer, train_step
from spmd_aot.options import ParallelOptions
from spmd_aot.parallel.mesh import device_mesh, fake_world
from spmd_aot.store import LocalStore
from spmd_aot.tracing import repeated
from spmd_aot.tracing.stamp import signature
from spmd_aot.tracing.trace import trace_step


class Stack(nn.Module):
    def __init__(self, layers: int, width: int = 8):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


def _step(model, optim, batch):
    loss = model(batch).square().mean()
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def test_shard_rows_stored_as_runs_so_a_large_world_layout_stays_within_load_limits(tmp_path):
    # 40 layers x (weight, bias) x (param, exp_avg, exp_avg_sq) = 240 sharded inputs; at world
    # 8192, one number per rank would decode to ~2 million objects, past the 1 million limit
    world = 8192
    job = spmd_aot.Job(step=_step, model=lambda: Stack(40),
                       optimizer=lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3),
                       batch=lambda: torch.randn(world, 8), global_batch=True)
    built = spmd_aot.build(job, world_size=world, placement="shard", cache_dir=tmp_path)
    layout = read_artifact(LocalStore(tmp_path), built.digest).layout["inputs"]
    sharded = [s for s in layout if s["shard_rows"]]
    assert len(sharded) == 240
    for s in sharded:
        runs = s["shard_rows"]
        assert all(count > 0 for _, count in runs) and len(runs) <= 3
        assert sum(count for _, count in runs) == world  # one run entry covers every rank
        assert sum(rows * count for rows, count in runs) == s["global_shape"][0]  # real rows, no padding
        assert all(a[0] != b[0] for a, b in zip(runs, runs[1:]))  # maximal runs
    weight = next(s for s in sharded if s["fqn"] == "layers.0.weight")
    assert weight["shard_rows"] == [[1, 8], [0, world - 8]]  # 8 rows over 8192 ranks, padded to 1 each


def test_row_runs_expand_to_each_shards_rows():
    from types import SimpleNamespace

    from spmd_aot.format.artifact import _row_runs
    from spmd_aot.parallel.layout import TensorLayout

    for shards in (1, 2, 3, 4, 7, 1024):
        for n in (0, 1, 2, 5, 8, 1023, 1024, 1025, 4099):
            chunk = -(-n // shards)  # dim 0 padded up to a multiple of the shard count, as FSDP2 pads
            layout = SimpleNamespace(sharded=True, local_shape=(chunk, 3), gathered_shape=(n, 3), shards=shards)
            runs = _row_runs(layout)
            assert [rows for rows, count in runs for _ in range(count)] == TensorLayout.shard_rows(layout), \
                (shards, n, runs)
            assert all(count > 0 for _, count in runs) and len(runs) <= 3
    assert _row_runs(SimpleNamespace(sharded=False)) == []


# ---------------------------------------------------------------------------- repeated blocks
class Scaled(Stack):
    """A stack whose own forward depends on its depth: stamping from three blocks would be wrong."""

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x)) / len(self.layers)
        return x


class Indexed(nn.Module):
    """A block that knows its index, as transformers' ``layer_idx``, and treats the last block apart."""

    def __init__(self, layer_idx: int, layers: int):
        super().__init__()
        self.linear, self.layer_idx, self.last = nn.Linear(8, 8), layer_idx, layers - 1

    def forward(self, x):
        x = torch.relu(self.linear(x))
        return x * 2 if self.layer_idx == self.last else x


class LastApart(Stack):
    def __init__(self, layers: int):
        super().__init__(0)
        self.layers = nn.ModuleList(Indexed(i, layers) for i in range(layers))


def _adamw(m):
    return torch.optim.AdamW(m.parameters(), lr=1e-3)


def _mlp(depth):
    return spmd_aot.Job(step=_step, model=lambda: Stack(depth), optimizer=_adamw, batch=lambda: torch.randn(4, 8))


def _clipped_step(model, optim, batch):
    loss = model(batch).square().mean()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # a norm over every block's gradients
    optim.step()
    optim.zero_grad()
    return loss


def _mlp_clipped(depth):
    return spmd_aot.Job(step=_clipped_step, model=lambda: Stack(depth), batch=lambda: torch.randn(4, 8),
                        optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9))


def _lm(depth):
    return spmd_aot.Job(step=train_step, model=lambda: Transformer(n_layers=depth, d_model=16, n_heads=2, max_len=8),
                        optimizer=_adamw, batch=lambda: (torch.randint(0, 64, (2, 8)), torch.randint(0, 64, (2, 8))))


def _llama(depth):
    from support import corpus

    return spmd_aot.Job(step=corpus.hf_step, optimizer=_adamw, batch=corpus.lm_batch,
                        model=lambda: corpus._decoder("LlamaConfig", "LlamaForCausalLM", num_hidden_layers=depth))


def _traced(job, placement: str, by_blocks: bool, world: int = 4, **options):
    plan = ParallelOptions(placement=placement, **options).plan(world, "cpu")
    fake_mode = FakeTensorMode()
    state = _fake_state(job, plan, fake_mode)
    with fake_world(world):
        mesh = device_mesh(state.plan)
        with fake_mode:
            inputs = state.graph_inputs()
        return trace_step(job.step, state, state.plan, mesh, inputs, by_blocks=by_blocks)


@pytest.fixture
def low_threshold(monkeypatch):
    monkeypatch.setattr(repeated, "MIN_BLOCKS", 5)  # stamp small stacks, so the full trace stays cheap


# tensor parallel inside each block (its all-reduces and gathers are the block's nodes), on
# FSDP x TP, HSDP x TP and transformers' own plan on DDP x TP (each also covers its DP placement)
_LM_TP = {"tp_plan": {"blocks.*.mlp.0": "colwise", "blocks.*.mlp.2": "rowwise"}}
_MESHES = {"": ({}, 4), "fsdp_tp": ({**_LM_TP, "mesh_shape": (2, 2)}, 4),
           "hsdp_tp": ({**_LM_TP, "mesh_shape": (2, 2, 2)}, 8), "hf_tp": ({"tp_plan": "hf", "mesh_shape": (2, 2)}, 4)}


@pytest.mark.parametrize("model,depth,placement,mesh", [  # each case traces 3 + 4 + depth blocks
    ("mlp", 5, "shard", ""), ("mlp", 6, "shard", ""), ("mlp", 6, "replicate", ""), ("mlp_clipped", 5, "shard", ""),
    ("lm", 5, "shard", "fsdp_tp"), ("lm", 5, "shard", "hsdp_tp"), ("llama", 5, "replicate", "hf_tp")])
def test_a_stamped_stack_is_node_for_node_the_full_trace(low_threshold, model, depth, placement, mesh):
    job = {"mlp": _mlp, "mlp_clipped": _mlp_clipped, "lm": _lm, "llama": _llama}[model](depth)
    options, world = _MESHES[mesh]
    stamped = _traced(job, placement, True, world, **options)
    full = _traced(job, placement, False, world, **options)
    assert stamped.blocks["stamped"] == depth and full.blocks == {}
    a, b = signature(stamped.gm), signature(full.gm)
    assert len(a) == len(b)
    assert next((x for x, y in zip(a, b) if x != y), None) is None  # names, ops, arguments, values, labels
    assert stamped.gradient_collectives == full.gradient_collectives
    assert (stamped.group_names, stamped.groups, stamped.axis_budget) == (full.group_names, full.groups, full.axis_budget)
    assert (stamped.out_spec, stamped.out_constants) == (full.out_spec, full.out_constants)
    # its code, generated with the graph's node index set aside, is FX's; the index is intact after
    graph = stamped.gm.graph
    assert stamped.gm.code == graph.python_code(root_module="self").src
    for op, target in {(n.op, n.target) for n in graph.nodes}:
        assert graph.find_nodes(op=op, target=target) == [n for n in graph.nodes if (n.op, n.target) == (op, target)]


def test_blocks_that_differ_or_a_forward_that_counts_them_are_traced_whole(low_threshold):
    def widths(depth):  # one block wider than the others: not identical
        model = Stack(depth)
        model.layers[2] = nn.Linear(8, 8, bias=False)
        return model

    job = spmd_aot.Job(step=_step, model=lambda: widths(6), optimizer=_adamw, batch=lambda: torch.randn(4, 8))
    assert _traced(job, "shard", True).blocks == {"full_trace": "block layers.2 differs from block layers.0 (fingerprint)"}
    job = spmd_aot.Job(step=_step, model=lambda: Scaled(6), optimizer=_adamw, batch=lambda: torch.randn(4, 8))
    scaled = _traced(job, "shard", True)
    assert "four-block graph stamped from three differs from its trace" in scaled.blocks["full_trace"]
    assert signature(scaled.gm) == signature(_traced(job, "shard", False).gm)


def test_a_forward_that_reads_its_blocks_index_past_the_first_ones_is_traced_whole(low_threshold):
    """Blocks that differ only by their own index stamp alike, so the check trace gives its blocks
    the last blocks' indices: a last-layer special case differs there and the stack is traced whole."""
    job = spmd_aot.Job(step=_step, model=lambda: LastApart(6), optimizer=_adamw, batch=lambda: torch.randn(4, 8))
    traced = _traced(job, "shard", True)
    assert "four-block graph stamped from three differs from its trace" in traced.blocks["full_trace"]
    assert signature(traced.gm) == signature(_traced(job, "shard", False).gm)  # indices restored after the check


def test_a_stamped_build_passes_the_load_check_and_says_so(tmp_path):
    job = spmd_aot.Job(step=_step, model=lambda: Stack(repeated.MIN_BLOCKS), optimizer=_adamw,
                       batch=lambda: torch.randn(4, 8))
    built = spmd_aot.build(job, world_size=4, placement="shard", cache_dir=tmp_path)  # checks as a load does
    assert built.stats["blocks"] == {"stamped": repeated.MIN_BLOCKS, "traced": [3, 4], "prefix": "layers."}


def test_a_tp_plan_that_treats_one_block_apart_is_traced_whole(low_threshold):
    plan = {"blocks.3.mlp.0": "colwise", "blocks.3.mlp.2": "rowwise"}  # block 3 alone split
    traced = _traced(_lm(5), "shard", True, 4, tp_plan=plan, mesh_shape=(2, 2))
    assert traced.blocks == {"full_trace": "the tp_plan treats block blocks.3 apart: module blocks.3.mlp.0 takes "
                                           "style 'colwise', its counterpart in block blocks.0 None"}
    assert any("tp blocks.3.mlp.2" in repr(n.meta.get("comm")) for n in traced.gm.graph.nodes)

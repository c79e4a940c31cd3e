"""Builds for large worlds: what the stored layout costs does not grow with the world size.

A sharded input's real rows per rank are stored as ``[rows, ranks]`` runs; one number per rank
made an 80-layer AdamW step's layout at world 1024 decode past the load limit on objects, so
the build refused its own entry."""

import torch
from torch import nn

import spmd_aot
from spmd_aot.entries import read_artifact
from spmd_aot.store import LocalStore


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

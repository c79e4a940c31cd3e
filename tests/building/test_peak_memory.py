"""Peak live tensor bytes: the estimate from a graph and the measurement of an eager run agree."""

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from spmd_aot.building.peak_memory import PeakMemory, graph_peak_bytes


def _step(x):
    a = x + 1  # 4000 B
    b = a * 2  # 4000 B, a still alive while b is computed
    v = b.view(10, 100)  # a view: no new storage
    c = v[:, :10].clone()  # 400 B; a is gone by now
    return c * 3


def test_measured_peak_counts_live_storages_and_views_once():
    x = torch.zeros(1000)
    with PeakMemory([x]) as m:
        _step(x)
    assert m.baseline == 4000
    assert m.peak == 3 * 4000 + 2 * 400  # x, a, b, c and c * 3: eager Python keeps its locals alive


def test_graph_estimate_matches_the_measurement():
    x = torch.zeros(1000)
    gm = make_fx(_step, tracing_mode="fake")(x)
    with PeakMemory([x]) as m:
        gm(x)
    assert graph_peak_bytes(gm) == m.peak == 12000  # the graph frees a after its last use


def test_a_storage_lives_until_its_last_view_dies():
    def step(x):
        a = x + 1
        v = a[:10]  # keeps a's whole storage alive
        b = x * 2
        return v + b[:10]

    x = torch.zeros(1000)
    gm = make_fx(step, tracing_mode="fake")(x)
    with PeakMemory([x]) as m:
        gm(x)
    assert graph_peak_bytes(gm) == m.peak == 3 * 4000 + 40  # x, a, b and the result

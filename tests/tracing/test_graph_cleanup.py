"""Graph cleanup passes: fewer op calls per step, the same values."""

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from spmd_aot.passes import fold_views

aten = torch.ops.aten


def _views(gm) -> int:
    return sum(1 for n in gm.graph.nodes if n.target in (aten.view.default, aten._unsafe_view.default))


def _step(w, x):
    w1 = w.view(w.shape).view(w.shape)  # what the DTensor boundary leaves: identity views
    h = x.view(4, 3).view(12).view(2, 6)  # a chain on a contiguous tensor
    t = w.t().contiguous().t()  # non-contiguous: its identity view must keep the strides
    return (w1 * 2).sum() + h.sum(), t.view(t.shape) + 1, h.view(2, 6)


def test_fold_views_drops_identity_views_and_chains_and_keeps_values():
    w, x = torch.randn(3, 4), torch.randn(12)
    gm = make_fx(_step, tracing_mode="fake")(w, x)
    before = _views(gm)
    expected = gm(w, x)
    removed = fold_views(gm)
    gm.graph.lint()
    gm.recompile()
    assert removed >= 4 and _views(gm) == before - removed
    got = gm(w, x)
    for e, g in zip(expected, got):
        assert torch.equal(e, g) and e.shape == g.shape and e.stride() == g.stride()


def test_fold_views_keeps_a_returned_view():
    def step(w):
        return w.view(w.shape)

    gm = make_fx(step, tracing_mode="fake")(torch.randn(3))
    assert fold_views(gm) == 0
    w = torch.randn(3)
    gm.recompile()
    out = gm(w)
    assert out is not w and torch.equal(out, w)

"""Python's cyclic garbage collector paused while an entry is decoded and checked: a stored
step's load, ``spmd-aot verify``, and a build's encoding and check of the graph it traced.

Why: loading decodes the graph, layout and schema into tens of thousands of small acyclic
containers. Their allocations trigger the collector's full (generation 2) passes, and each pass
scans the whole heap: after ``import torch`` and a model, ~300k objects, 60-180 ms a pass on a
2-core machine, and a hit's first call met one or two of them, more than all its own work. They
free nothing a load made: its containers are acyclic, and reference counting frees every
temporary as before. What a load keeps (~14k objects for a 12-layer model) is a few percent of
the heap, far below the quarter of it that makes the collector run a full pass later, so the
pass is skipped, not postponed.

A trace (a miss) runs with the collector on: FX graphs and fake tensors are full of cycles, and a
long trace must not grow without bound. ``spmd-aot verify``, which decodes every stored graph,
pauses it the same way, and so does a build once its graph is traced: its statistics, encoding
and the load check it runs on its own entry make the same acyclic containers, and the full
passes they triggered over a deep model's traced heap were a fifth of an 80-layer build.
"""

from __future__ import annotations

import contextlib
import gc

__all__ = ["paused", "resumed"]


@contextlib.contextmanager
def _switched(on: bool):
    """The collector on (or off) for the block, then back as the caller had it."""
    was_on = gc.isenabled()
    gc.enable() if on else gc.disable()
    try:
        yield
    finally:
        gc.enable() if was_on else gc.disable()


def paused():
    """The collector off for the block, then back as it was (a caller that disabled it keeps it off)."""
    return _switched(False)


def resumed():
    """Inside ``paused``: the collector on for a block that builds cyclic garbage (a trace)."""
    return _switched(True)

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

A build also sets aside (``set_aside``, ``keep``) what exists when it starts and what it keeps
to its end (the fake model, the traced or stamped graph): left out of the collector's passes
while it runs (``gc.freeze``), returned to the oldest generation when it ends. The passes the
trace still needs (it makes cyclic garbage) then scan what the trace made, not each time
torch's ~300k objects from import, the fake model and the stamped graph as well. The
70B-shaped 80-layer build spent 1.6-2.2 CPU-s in the collector, 0.45 with them set aside (a
full pass right after the stamp alone cost ~0.5), and went from 11.3 to 9.4-9.6 CPU-s.
"""

from __future__ import annotations

import contextlib
import gc
import threading

__all__ = ["paused", "resumed", "set_aside", "keep"]

_holder = threading.local()  # ``active`` while this thread runs a build that set objects aside


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


@contextlib.contextmanager
def set_aside():
    """For one build: what exists now, and what ``keep`` adds while the block runs, is left out
    of the collector's passes (``gc.freeze``); when the block ends it all returns to the oldest
    generation (``gc.unfreeze``), where the next full pass scans it as before.

    Garbage cycles among the objects set aside (a trace's graphs, once the build is past them)
    wait for that pass: at most what one build makes, as long as it runs. Where objects are
    frozen already (the process froze its own, e.g. before forking workers, or another
    thread's build holds them) nothing is done, since ending the block would unfreeze theirs."""
    if gc.get_freeze_count() or getattr(_holder, "active", False):
        yield
        return
    gc.freeze()
    _holder.active = True
    try:
        yield
    finally:
        _holder.active = False
        gc.unfreeze()


def keep() -> None:
    """Inside this thread's ``set_aside``: what exists now joins the objects set aside (a build
    calls it once it has made what it keeps to its end: the fake model, the traced or stamped
    graph). Elsewhere nothing is done."""
    if getattr(_holder, "active", False):
        gc.freeze()

"""Device meshes over the default process group: fake ones at build time, live ones at job start.

Its own module because both the expansion (``expand.py``) and the tracer (``trace.py``) need
meshes, and the runtime and builder create them; keeping them here keeps imports one-way.
"""

from __future__ import annotations

import atexit
import contextlib
import sys
from typing import Any

import torch
# torch.distributed.nn.functional binds ``group=group.WORLD`` as default arguments when it is
# first imported. Imported while a process group is up (torch._dynamo imports it lazily, and a
# load or a trace imports torch._dynamo), those defaults keep that group and its gloo worker
# threads alive past ``destroy_process_group()``, until interpreter teardown destroys them
# mid-finalization and the process now and then aborts with "terminate called without an
# active exception" (1 run in 60 of tools/stress_ranks.py --plain-ranks). Imported here, with
# the package and before any group exists, the defaults are None: the default group at call
# time, which is what they mean. ``_release_meshes_at_exit`` covers a package imported later.
import torch.distributed.nn.functional  # noqa: F401,E402

from .plan import Plan

__all__ = ["device_mesh", "fake_world"]

_MESHES: dict[tuple, Any] = {}


def device_mesh(plan: Plan):
    """The mesh over the default process group (fake at build time, live at job start).

    One mesh per shape and default group per process: a new mesh means new process groups
    (collective calls on every rank), and DTensor caches decisions across equal meshes.
    """
    if plan.world_size == 1:
        return None
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    key = (plan.device_type, plan.mesh_shape, id(dist.group.WORLD), dist.group.WORLD.group_name)
    if key not in _MESHES:
        ranks = torch.arange(plan.world_size).reshape(plan.mesh_shape)
        _MESHES[key] = DeviceMesh(plan.device_type, ranks)
    return _MESHES[key]


@contextlib.contextmanager
def fake_world(world_size: int):
    """A fake default process group of ``world_size`` ranks, so a CPU box can build for 64."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("spmd-aot build needs no process group; one is already initialized")
    excepthook = sys.excepthook  # init_process_group wraps it (a "[rank0]:" prefix) every time
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        _forget_meshes()
        dist.destroy_process_group()
        sys.excepthook = excepthook


def _forget_meshes() -> None:
    """Drop every reference to the fake groups about to be destroyed: our meshes and DTensor's
    caches of sharding and redistribution decisions, which hold meshes (and so their groups)
    and would hand a later build a destroyed group for an equal mesh."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor import _redistribute

    _MESHES.clear()
    propagator = DTensor._op_dispatcher.sharding_propagator
    propagator.propagate_op_sharding.cache_clear()
    type(propagator)._propagate_tensor_meta_cached.cache_clear()
    _redistribute.clear_redistribute_planner_cache()
    _redistribute._gen_transform_infos.cache_clear()


def _unpin_destroyed_groups() -> None:
    """Point default arguments of ``torch.distributed.nn.functional`` that still hold a
    process group back to None once no group is up (see the import at the top)."""
    import torch.distributed as dist

    functional = sys.modules.get("torch.distributed.nn.functional")
    if functional is None or dist.is_initialized():
        return
    for fn in list(vars(functional).values()):
        defaults = getattr(fn, "__defaults__", None)
        if isinstance(defaults, tuple) and any(isinstance(d, dist.ProcessGroup) for d in defaults):
            fn.__defaults__ = tuple(None if isinstance(d, dist.ProcessGroup) else d for d in defaults)


@atexit.register
def _release_meshes_at_exit() -> None:
    """Drop every reference spmd-aot (or torch on its behalf) keeps to process groups the job
    has destroyed: our meshes, DTensor's cached decisions holding them, stale default
    arguments. Then a destroyed group really goes, while the interpreter is whole; left to
    finalization, its gloo worker threads are torn down mid-teardown and abort the process
    ("terminate called without an active exception"). Processes that end with ``os._exit``
    (multiprocessing workers) never get here, and never tear anything down either."""
    with contextlib.suppress(Exception):
        _forget_meshes()
    with contextlib.suppress(Exception):
        _unpin_destroyed_groups()


"""Device meshes over the default process group: fake ones at build time, live ones at job start.

Its own module because both the expansion (``expand.py``) and the tracer (``trace.py``) need
meshes, and the runtime and builder create them; keeping them here keeps imports one-way.
"""

from __future__ import annotations

import contextlib
import math
import sys
from typing import Any

import torch

from .plan import Plan

__all__ = ["device_mesh", "flat_mesh", "fake_world"]

_MESHES: dict[tuple, Any] = {}


def device_mesh(plan: Plan):
    """The mesh over the default process group (fake at build time, live at job start).

    One mesh per shape and default group per process: a new mesh means new process groups
    (collective calls on every rank), and DTensor caches decisions across equal meshes.
    """
    return _mesh(plan.device_type, plan.mesh_shape) if plan.world_size > 1 else None


def flat_mesh(plan: Plan):
    """The 1-D mesh of every rank (one collective over the world where a gradient averages over
    every data-parallel dimension); the plan's own mesh when it is 1-D."""
    return _mesh(plan.device_type, (plan.world_size,)) if plan.world_size > 1 else None


def _mesh(device_type: str, shape: tuple[int, ...]):
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    key = (device_type, shape, id(dist.group.WORLD), dist.group.WORLD.group_name)
    if key not in _MESHES:
        _MESHES[key] = DeviceMesh(device_type, torch.arange(math.prod(shape)).reshape(shape))
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
        forget_meshes()
        dist.destroy_process_group()
        sys.excepthook = excepthook


def forget_meshes() -> None:
    """Drop every reference spmd-aot keeps to meshes (and so to their process groups): ours and
    DTensor's caches of sharding and redistribution decisions. Before a fake group is destroyed
    (they would hand a later build a destroyed group for an equal mesh) and at exit
    (``teardown.py``). A process that never imported DTensor has none of its caches to clear,
    and importing it only to clear them cost a world-1 hit's exit 0.6 s."""
    _MESHES.clear()
    if "torch.distributed.tensor" not in sys.modules:
        return
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor import _redistribute

    propagator = DTensor._op_dispatcher.sharding_propagator
    propagator.propagate_op_sharding.cache_clear()
    type(propagator)._propagate_tensor_meta_cached.cache_clear()
    _redistribute.clear_redistribute_planner_cache()
    _redistribute._gen_transform_infos.cache_clear()

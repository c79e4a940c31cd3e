"""Turn a live model and optimizer into the sharded form a ``shard`` (or tensor-parallel)
artifact runs on.

After this, as after FSDP2's ``fully_shard`` (and ``parallelize_module``), every parameter is an
``nn.Parameter`` holding a DTensor (``Shard(0)``, Replicate for parameters kept whole; under
TP also split over the TP dimension as its style says), and optimizer state shaped like a
parameter is a DTensor of the same placement; ``p.full_tensor()`` gives the full value. Each
such DTensor's local tensor is a view into a *padded* storage (dim 0 rounded up to a multiple
of the shard count), which is what the graph reads and updates in place: the same graph then
serves every rank even when dim 0 does not divide.
"""

from __future__ import annotations

import torch
from torch.utils.weak import WeakIdKeyDictionary

from ..errors import SpmdAotError
from .layout import TensorLayout

__all__ = ["shard_model_and_optimizer", "sharded_zeros", "ensure_sharded_state", "STORAGE_ATTR"]

STORAGE_ATTR = "_spmd_aot_storage"  # padded local storage behind a DTensor
LAYOUT_ATTR = "_spmd_aot_layout"
# plain parameter -> the sharded one that replaced it in its model, for as long as something
# (an optimizer built before a forward-only step sharded the model) still holds the plain one
_REPLACED_BY = WeakIdKeyDictionary()


def _to_dtensor(full: torch.Tensor, layout: TensorLayout, mesh) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    tp_local = full
    if layout.ep_split:  # this rank's experts: its even slice of dim 0 over the ep dimension
        tp_local = tp_local.chunk(layout.ep, 0)[mesh.get_local_rank(layout.ep_mesh_dim)]
    if layout.tp_dim is not None:  # this rank's even slice over the TP dimension
        tp_local = tp_local.chunk(layout.tp, layout.tp_dim)[mesh.get_local_rank(layout.tp_mesh_dim)]
    if layout.sharded:
        index = mesh.get_local_rank(layout.shard_mesh_dim)
        chunk, rows = layout.local_shape[0], layout.shard_rows()[index]
        storage = torch.zeros(layout.local_shape, dtype=full.dtype, device=full.device)
        storage[:rows].copy_(tp_local[index * chunk: index * chunk + rows])
        local = storage[:rows]
    else:
        storage = tp_local.detach().clone()
        local = storage.view_as(storage)
    dt = DTensor.from_local(local, mesh, layout.dtensor_placements(), run_check=False, shape=full.shape,
                            stride=full.stride())
    return dt, storage


def _tag(t: torch.Tensor, storage: torch.Tensor, layout: TensorLayout) -> torch.Tensor:
    setattr(t, STORAGE_ATTR, storage)
    setattr(t, LAYOUT_ATTR, layout)
    return t


def shard_model_and_optimizer(model: torch.nn.Module, optim: torch.optim.Optimizer | None, plan, mesh) -> None:
    """Replace parameters (and existing optimizer state) by sharded DTensors, in place, each
    laid out as ``plan.layout_for`` says.

    ``optim`` is None for a forward-only step; an optimizer that still holds the plain
    parameters of a model sharded that way is pointed at the sharded ones by a later call."""
    from torch.distributed.tensor import DTensor

    names_of: dict[int, list[str]] = {}
    params: dict[int, torch.nn.Parameter] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(p), []).append(name)
        params[id(p)] = p
    for pid, p in params.items():
        if isinstance(p, DTensor):
            if getattr(p, STORAGE_ATTR, None) is None:
                raise SpmdAotError(
                    f"parameter {names_of[pid][0]} is already a DTensor (from fully_shard or "
                    "another tool); spmd-aot shards plain parameters itself: pass the unsharded model"
                )
            continue
        layout = plan.layout_for(names_of[pid][0], p.shape)
        with torch.no_grad():
            dt, storage = _to_dtensor(p.detach(), layout, mesh)
        new = _tag(torch.nn.Parameter(dt, requires_grad=p.requires_grad), storage, layout)
        for name in names_of[pid]:
            owner, _, attr = name.rpartition(".")
            setattr(model.get_submodule(owner), attr, new)
        _REPLACED_BY[p] = new
    if optim is None:
        return
    for owner in getattr(optim, "members", [optim]):  # several optimizers: each keeps its own state
        for group in owner.param_groups:
            news = [_REPLACED_BY.get(p, p) for p in group["params"]]
            for old, new in zip(group["params"], news):
                if new is not old and old in owner.state:
                    owner.state[new] = owner.state.pop(old)
            group["params"] = news
    ensure_sharded_state(optim)


def sharded_zeros(param, shape, dtype, device) -> torch.Tensor:
    """``make_zeros`` for ``initialize_optimizer_state``: state shaped like a sharded
    parameter is created sharded, never at full size."""
    layout = getattr(param, LAYOUT_ATTR, None)
    if layout is None or tuple(shape) != tuple(param.shape):
        return torch.zeros(shape, dtype=dtype, device=device)
    from torch.distributed.tensor import DTensor

    storage = torch.zeros(layout.local_shape, dtype=dtype, device=device)
    rows = param.to_local().shape[0] if layout.sharded else None
    local = storage[:rows] if rows is not None else storage.view_as(storage)
    dt = DTensor.from_local(local, param.device_mesh, param.placements, run_check=False,
                            shape=param.shape, stride=param.stride())
    return _tag(dt, storage, layout)


def ensure_sharded_state(optim: torch.optim.Optimizer) -> None:
    """Give every state tensor of a sharded parameter its padded storage.

    ``optim.load_state_dict`` replaces state tensors with new ones (full tensors or DTensors);
    this re-homes them, so the graph keeps reading and updating what the optimizer holds.
    """
    from torch.distributed.tensor import DTensor

    for group in optim.param_groups:
        for p in group["params"]:
            layout = getattr(p, LAYOUT_ATTR, None)
            if layout is None:
                continue
            entries = optim.state.get(p, {})
            for key, t in entries.items():
                if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(p.shape) or \
                        getattr(t, STORAGE_ATTR, None) is not None:
                    continue
                full = t.full_tensor() if isinstance(t, DTensor) else t
                with torch.no_grad():
                    dt, storage = _to_dtensor(full.to(p.device), layout, p.device_mesh)
                entries[key] = _tag(dt, storage, layout)

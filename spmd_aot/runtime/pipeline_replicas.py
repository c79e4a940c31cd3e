"""How a pipeline stage lies over its data-parallel replicas, and how their gradients meet.

With a world of ``stages x dp`` ranks the mesh is ``(pp, dp)`` in row-major order: stage ``s``
runs on ranks ``s*dp .. s*dp+dp-1``, each replica on its own batch. The stage graphs are the same
for every replica (they compute on whole parameters and one replica's micro-batch); what differs
is where the parameters live between steps and how the gradients are combined after the last
micro-batch:

- ``replicate`` (DDP under pipelining): whole parameters on every replica; the gradients are
  divided by ``dp`` and summed in one flat all_reduce.
- ``shard`` (FSDP2 under pipelining, ``fully_shard`` on the stage): parameters are ``Shard(0)``
  DTensors over the replicas (uneven shards as DTensor splits them); each step gathers them whole
  once, before the first action, and frees them after the last; each gradient, divided by
  ``dp``, is reduce-scattered into a ``Shard(0)`` DTensor gradient, and the optimizer steps on
  the shards.

With tensor parallel inside the stages (a last ``tp`` mesh dimension, ``(pp, dp, tp)``), every
parameter of the stage becomes a DTensor over the stage's ``(dp, tp)`` ranks at the first call,
laid out as ``parallelize_module`` then ``fully_shard`` lay it out: split over TP as its style
says (``Shard(d)``, or ``Replicate()`` for unplanned parameters), then, under ``shard``, its
TP-local tensor split on dim 0 over the replicas (``_StridedShard(0)`` over ``dp`` when TP
splits dim 0 too, as FSDP2 writes it). The stage graphs take the TP-local tensor (the replicas'
shards all_gathered) and return the TP-local gradient, which is averaged over the replicas as
without TP (all_reduce, or reduce_scatter into this rank's shard); the TP collectives are in the
graphs.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..errors import SpmdAotError

__all__ = ["Replicas"]


class Replicas:
    def __init__(self, plan: dict, device_type: str, tp_plan=()):
        """Collective when a stage has several ranks: every rank makes the ``(pp, dp, tp)`` mesh
        (the dimensions it has)."""
        roles = plan["mesh_roles"]
        self.per_stage = plan["world_size"] // plan["mesh_shape"][0]  # ranks running one stage
        self.tp = plan["mesh_shape"][-1] if roles[-1] == "tp" else 1
        self.dp = self.per_stage // self.tp
        self.sharded = self.dp > 1 and "dp_shard" in roles
        self.tp_plan = tuple(tp_plan)
        self.mesh = self.stage_mesh = self.tp_mesh = None
        self.groups: list[str] = []  # the live process-group name of each mesh dimension
        self._tp_dims: dict[str, int | None] = {}  # parameter FQN -> its dimension split over TP
        self._planned: dict[int, bool] = {}  # id(DTensor parameter) -> its module is in the tp_plan
        if self.per_stage > 1:
            from torch.distributed.device_mesh import init_device_mesh

            names = ("pp",) + (("dp",) if self.dp > 1 else ()) + (("tp",) if self.tp > 1 else ())
            mesh = init_device_mesh(device_type, tuple(plan["mesh_shape"]), mesh_dim_names=names)
            self.groups = [mesh.get_group(d).group_name for d in range(mesh.ndim)]
            self.mesh = mesh["dp"] if self.dp > 1 else None  # this rank's stage replicas
            self.stage_mesh = mesh[names[1:]] if len(names) > 2 else mesh[names[1]]  # the stage's ranks
            self.tp_mesh = mesh["tp"] if self.tp > 1 else None

    # ------------------------------------------------------------------ parameters
    def shard(self, model, optim, fqns: list[str]) -> None:
        """Turn the stage's parameters into ``Shard(0)`` DTensors over the replicas, in place in
        the model and in ``optim``'s parameter groups (as ``fully_shard`` does before the optimizer
        exists); idempotent. Optimizer state already present is sharded the same way."""
        from torch.distributed.tensor import DTensor, Shard, distribute_tensor

        if self.tp > 1:
            return self._split(model, optim, fqns)
        if not self.sharded:
            return
        swapped: dict[int, torch.nn.Parameter] = {}
        for fqn in fqns:
            owner_name, _, name = fqn.rpartition(".")
            owner = model.get_submodule(owner_name)
            old = getattr(owner, name)
            if isinstance(old, DTensor):
                continue
            new = torch.nn.Parameter(distribute_tensor(old.detach(), self.mesh, [Shard(0)]),
                                     requires_grad=old.requires_grad)
            setattr(owner, name, new)
            swapped[id(old)] = new
        if optim is None or not swapped:
            return
        for group in optim.param_groups:
            group["params"] = [swapped.get(id(p), p) for p in group["params"]]
        for old_id, new in swapped.items():
            old = next((p for p in list(optim.state) if id(p) == old_id), None)
            if old is not None:
                optim.state[new] = {k: distribute_tensor(v, self.mesh, [Shard(0)])
                                    if isinstance(v, torch.Tensor) and v.shape == new.shape else v
                                    for k, v in optim.state.pop(old).items()}

    def _split(self, model, optim, fqns: list[str]) -> None:
        """``shard`` under TP, as ``parallelize_module`` then ``fully_shard`` leave the stage
        module: a planned module's parameters DTensors over TP (then over the stage's ``(dp, tp)``
        ranks under ``shard``); the others plain, or ``Shard(0)`` over the replicas under ``shard``."""
        from torch.distributed.tensor import DTensor

        from ..parallel.tp_plan import split_dim

        swapped: dict[int, torch.nn.Parameter] = {}
        for fqn in fqns:
            owner_name, _, name = fqn.rpartition(".")
            owner = model.get_submodule(owner_name)
            old = getattr(owner, name)
            found = split_dim(self.tp_plan, fqn)  # None: its module is unplanned
            if isinstance(old, DTensor) or (found is None and not self.sharded):
                continue
            planned = found is not None
            self._tp_dims[fqn] = found[1] if planned else None
            new = torch.nn.Parameter(self._laid_out(old.detach(), fqn, planned), requires_grad=old.requires_grad)
            setattr(owner, name, new)
            self._planned[id(new)] = planned
            swapped[id(old)] = (new, fqn, planned)
        if optim is None or not swapped:
            return
        for group in optim.param_groups:
            group["params"] = [swapped[id(p)][0] if id(p) in swapped else p for p in group["params"]]
        for old_id, (new, fqn, planned) in swapped.items():
            old = next((p for p in list(optim.state) if id(p) == old_id), None)
            if old is not None:
                optim.state[new] = {k: self._laid_out(v, fqn, planned)
                                    if isinstance(v, torch.Tensor) and v.shape == new.shape else v
                                    for k, v in optim.state.pop(old).items()}

    def _laid_out(self, full: torch.Tensor, fqn: str, planned: bool):
        """``full`` as a DTensor over the stage's ranks: this rank's TP slice, then its replica shard."""
        from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
        from torch.distributed.tensor.placement_types import _StridedShard

        if not planned:  # fully_shard alone: Shard(0) over the replicas (uneven shards as DTensor splits them)
            return distribute_tensor(full, self.mesh, [Shard(0)])
        dim = self._tp_dims[fqn]
        local = full.chunk(self.tp, dim)[self.tp_mesh.get_local_rank()] if dim is not None else full
        placements = [Shard(dim) if dim is not None else Replicate()]
        mesh = self.tp_mesh
        if self.sharded:
            if local.shape[0] % self.dp:
                raise SpmdAotError(
                    f"{fqn} is {list(local.shape)} on each TP rank, and dim 0 does not split into {self.dp} equal "
                    "shards; under tensor parallel, placement='shard' needs a TP-local dim 0 that divides by the "
                    "replicas: change its size or leave it out of the tp_plan")
            local = local.chunk(self.dp, 0)[self.mesh.get_local_rank()]
            # dim 0 already split over TP: the replicas' shards interleave with those (FSDP2's form)
            placements.insert(0, _StridedShard(0, split_factor=self.tp) if dim == 0 else Shard(0))
            mesh = self.stage_mesh
        return DTensor.from_local(local.detach().clone(), mesh, placements, run_check=False,
                                  shape=full.shape, stride=full.stride())

    def whole(self, live):
        """What a stage graph takes for a live parameter: itself, or gathered whole (under TP,
        the TP-local tensor, the replicas' shards gathered)."""
        from torch.distributed.tensor import DTensor

        if not isinstance(live, DTensor):
            return live
        if self.tp == 1 or not self._planned.get(id(live), False):
            return live.full_tensor()
        local = live.to_local()
        if not self.sharded:
            return local
        out = local.new_empty((local.shape[0] * self.dp, *local.shape[1:]))
        dist.all_gather_into_tensor(out, local.contiguous(), group=self.mesh.get_group())
        return out

    # ------------------------------------------------------------------ gradients
    def set_gradients(self, params_and_grads: list[tuple[torch.nn.Parameter, torch.Tensor]]) -> None:
        """Each parameter's ``.grad`` from its whole gradient on this replica (already divided by
        the micro-batch count): the mean over replicas, whole or as its ``Shard(0)`` part."""
        if self.tp > 1:
            return self._tp_gradients(params_and_grads)
        if self.dp == 1:
            for param, grad in params_and_grads:
                param.grad = grad
            return
        if self.sharded:
            from torch.distributed.tensor import DTensor, Partial, Shard

            for param, grad in params_and_grads:
                partial = DTensor.from_local(grad.div_(self.dp), self.mesh, [Partial("sum")], run_check=False)
                param.grad = partial.redistribute(self.mesh, [Shard(0)])
            return
        grads = [g for _, g in params_and_grads]
        flat = torch.cat([g.reshape(-1) for g in grads]).div_(self.dp)
        dist.all_reduce(flat, group=self.mesh.get_group())
        offset = 0
        for (param, grad) in params_and_grads:
            param.grad = flat[offset:offset + grad.numel()].view_as(grad)
            offset += grad.numel()

    def _tp_gradients(self, params_and_grads) -> None:
        """``set_gradients`` under TP: each TP-local gradient averaged over the replicas, in the
        form of its parameter (a plain tensor, or a DTensor over TP and the replicas)."""
        from torch.distributed.tensor import DTensor, Partial, Shard

        if self.dp > 1 and not self.sharded:  # one flat all_reduce, as without TP
            grads = [g for _, g in params_and_grads]
            flat = torch.cat([g.reshape(-1) for g in grads]).div_(self.dp)
            dist.all_reduce(flat, group=self.mesh.get_group())
            params_and_grads = [(p, flat[o:o + g.numel()].view_as(g)) for (p, g), o in
                                zip(params_and_grads, _offsets(grads))]
        for param, grad in params_and_grads:
            if not isinstance(param, DTensor):
                param.grad = grad
            elif not self._planned[id(param)]:  # Shard(0) over the replicas: reduce_scattered
                partial = DTensor.from_local(grad.div_(self.dp), self.mesh, [Partial("sum")], run_check=False)
                param.grad = partial.redistribute(self.mesh, [Shard(0)])
            else:
                if self.sharded:
                    local = grad.new_empty((grad.shape[0] // self.dp, *grad.shape[1:]))
                    dist.reduce_scatter_tensor(local, grad.div_(self.dp).contiguous(), group=self.mesh.get_group())
                    grad = local
                param.grad = DTensor.from_local(grad, param.device_mesh, param.placements, run_check=False,
                                                shape=param.shape, stride=param.stride())


def _offsets(tensors) -> list[int]:
    out, at = [], 0
    for t in tensors:
        out.append(at)
        at += t.numel()
    return out

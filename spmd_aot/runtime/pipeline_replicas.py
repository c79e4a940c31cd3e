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
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["Replicas"]


class Replicas:
    def __init__(self, plan: dict, device_type: str):
        """Collective when the stage has replicas: every rank makes the ``(pp, dp)`` mesh."""
        self.dp = plan["world_size"] // plan["mesh_shape"][0]
        self.sharded = self.dp > 1 and plan["mesh_roles"][-1] == "dp_shard"
        self.mesh = None
        if self.dp > 1:
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh(device_type, tuple(plan["mesh_shape"]), mesh_dim_names=("pp", "dp"))
            self.mesh = mesh["dp"]  # this rank's stage replicas

    # ------------------------------------------------------------------ parameters
    def shard(self, model, optim, fqns: list[str]) -> None:
        """Turn the stage's parameters into ``Shard(0)`` DTensors over the replicas, in place in
        the model and in ``optim``'s parameter groups (as ``fully_shard`` does before the optimizer
        exists); idempotent. Optimizer state already present is sharded the same way."""
        from torch.distributed.tensor import DTensor, Shard, distribute_tensor

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

    def whole(self, live):
        """What a stage graph takes for a live parameter: itself, or gathered whole."""
        from torch.distributed.tensor import DTensor

        return live.full_tensor() if isinstance(live, DTensor) else live

    # ------------------------------------------------------------------ gradients
    def set_gradients(self, params_and_grads: list[tuple[torch.nn.Parameter, torch.Tensor]]) -> None:
        """Each parameter's ``.grad`` from its whole gradient on this replica (already divided by
        the micro-batch count): the mean over replicas, whole or as its ``Shard(0)`` part."""
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

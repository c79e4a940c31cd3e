"""Communication groups under ``shard`` (and HSDP): parameters gathered and reduced together.

FSDP2 communicates per ``fully_shard`` module, not per parameter: one all_gather of the
group's shards into a flat buffer (copy-in, then copy-out into each parameter), and one
reduce_scatter of the group's gradients. Per-parameter collectives cost a launch and a
latency each (28 small all_reduces took 14x one flat one on gloo, see README).

Which parameters form a group (``assign_groups``): the first ``Plan.shard_groups`` pattern
(fnmatch on the FQN) a parameter matches; without patterns, one group per *block*: each child
of an ``nn.ModuleList``/``nn.Sequential``/``nn.ModuleDict`` (a child that is itself such a
container is split into its own children), as ``fully_shard`` applied to every transformer
block. ModuleDict counts because torchtitan-style models keep their layers in one
(``self.layers = nn.ModuleDict({str(i): Block() ...})``, so checkpoints keep their keys when
layers are dropped); without it such a model was one group, gathered whole at once. A
ModuleDict is also a namespace for different submodules (a text and a vision tower, several
heads): only one whose children share a class is a stack of blocks; another is looked into,
as any module. Parameters in
no block or pattern form the *root* group. Only sharded parameters join groups; parameters
kept whole keep their all_reduce.

How a group communicates inside the traced step (``GroupGather``): an autograd function whose
forward all-gathers and whose backward reduce-scatters (plus, under HSDP, one all_reduce over
the replica dimension). With ``reshard_after_forward`` the tensors autograd saves for
backward that live in a group's gathered storage are replaced (saved-tensor hooks) by a
re-gather in backward, so the forward's gathered parameters are freed when forward is done
with them, as FSDP2's ``reshard_after_forward=True``; the root group stays gathered, as
FSDP2's root does (it is needed again as soon as backward starts).

Every collective made here carries ``node.meta["comm"] = {"label", "params", "phase"}``,
which the prefetch pass (``passes/prefetch.py``) and the statistics read.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import logging
import math
from collections.abc import Sequence

import torch
from torch import nn

from ..passes.collectives import label_collective
from .plan import Plan

__all__ = ["ParamGroup", "assign_groups", "block_prefixes", "GroupGather", "resharding", "ROOT"]

log = logging.getLogger(__name__)

ROOT = "root"  # label of the group of parameters in no block (or matching no pattern)


@dataclasses.dataclass(frozen=True)
class ParamGroup:
    label: str
    fqns: tuple[str, ...]  # first FQN of each parameter, in slot order
    reshard: bool  # gathered again in backward (freed after forward)


def block_prefixes(model: nn.Module) -> list[str]:
    """FQN prefixes of the default blocks: children of every ModuleList/Sequential/ModuleDict."""
    containers = (nn.ModuleList, nn.Sequential, nn.ModuleDict)
    out: list[str] = []

    def stack(module: nn.Module) -> bool:
        """Whether ``module``'s children are blocks (a ModuleDict only when they share a class)."""
        if isinstance(module, nn.ModuleDict):
            return len({type(child) for child in module.children()}) == 1
        return isinstance(module, containers)

    def visit(module: nn.Module, prefix: str) -> None:
        for name, child in module.named_children():
            path = prefix + name
            if stack(module) and not isinstance(child, containers):
                out.append(path)
            else:
                visit(child, path + ".")

    visit(model, "")
    return out


def assign_groups(model: nn.Module, plan: Plan, params: Sequence[tuple[str, str]]) -> list[ParamGroup]:
    """Groups of the sharded parameters ``params`` = [(fqn, dtype)], in first-parameter order.

    A group mixing dtypes is split per dtype (one flat buffer has one dtype), labelled
    ``label:dtype``. Under expert parallel an expert module's parameters form their own group,
    labelled ``label:experts`` (their gradients are not averaged over ``ep``, the others' are).
    """
    if plan.shard_groups:
        def label_of(fqn: str) -> str:
            return next((p for p in plan.shard_groups if fnmatch.fnmatchcase(fqn, p)), ROOT)
    else:
        prefixes = block_prefixes(model)

        def label_of(fqn: str) -> str:
            return next((p for p in prefixes if fqn.startswith(p + ".")), ROOT)

    members: dict[str, list[tuple[str, str]]] = {}
    for fqn, dtype in params:
        label = label_of(fqn)
        members.setdefault(f"{label}:experts" if plan.ep and plan.is_expert_param(fqn) else label,
                           []).append((fqn, dtype))
    unused = [p for p in plan.shard_groups if p not in members and f"{p}:experts" not in members]
    if unused:
        log.warning("shard_groups pattern(s) %s match no sharded parameter", unused)
    groups = []
    for label, entries in members.items():
        dtypes = list(dict.fromkeys(d for _, d in entries))
        for dtype in dtypes:
            name = label if len(dtypes) == 1 else f"{label}:{dtype}"
            fqns = tuple(f for f, d in entries if d == dtype)
            groups.append(ParamGroup(name, fqns, plan.reshard_after_forward and label.removesuffix(":experts") != ROOT))
    return groups


# ---------------------------------------------------------------------------- trace time
class GroupGather:
    """One group inside the traced step: its forward gather, backward re-gather and reduce."""

    def __init__(self, group: ParamGroup, leaves: list[torch.Tensor], layouts, mesh, policy=None):
        self.group = group
        self.policy = policy  # a MixedPrecisionPolicy: gather in param_dtype, reduce in reduce_dtype
        self.leaves = leaves
        self.layouts = layouts
        self.world = layouts[0].shards
        self.shard_group = mesh.get_group(layouts[0].shard_mesh_dim).group_name
        # HSDP's replica dimension and context parallel's: the gradient averaged over each
        self.replica_groups = [mesh.get_group(d).group_name for d in layouts[0].replica_mesh_dims]
        self.numels = [_numel(layout.local_shape) for layout in layouts]
        self._shards: list[torch.Tensor] | None = None
        self._forward: dict[int, torch.Tensor] | None = None  # id(leaf) -> compute tensor
        self.registry: dict = {}  # storage id -> (group, parameter index), shared by a step's groups
        self._backward: list[torch.Tensor] | None = None
        self._storages: list = []
        self.accumulation = None  # gradient accumulation (accumulation.py): reduce at sync points only
        self._pending: list[torch.Tensor | None] | None = None  # unsharded gradients accumulated

    def comm(self, phase: str) -> dict:
        return {"label": self.group.label, "params": list(self.group.fqns), "phase": phase}

    def compute(self, leaf: torch.Tensor) -> torch.Tensor:
        """The compute tensor of ``leaf``; the first access gathers the whole group."""
        if self._forward is not None and [lf._version for lf in self.leaves] != self._versions:
            from ..errors import UnsupportedError

            raise UnsupportedError(
                f"a parameter of shard group {self.group.label!r} is read by a module's forward after it "
                "was updated in place in the same step (an EMA copy's forward after its no_grad update, or "
                "the model's after optim.step()); under shard the group was gathered before the update, so "
                "the forward would read the old values. Run that forward before the update (the next step "
                "sees the updated values), or use placement='replicate'"
            )
        if self._forward is None:
            self._versions = [lf._version for lf in self.leaves]
            if self._shards is None:
                # the local shard of each leaf; its gradient returns to the leaf as Shard(0)
                self._shards = [lf.to_local(grad_placements=lf.placements) for lf in self.leaves]
            outs = _GatherGroup.apply(self, *self._shards)
            self._forward = {id(lf): out for lf, out in zip(self.leaves, outs)}
            self._backward = None
            if self.group.reshard:
                self._storages = [_storage_id(out) for out in outs]
                self.registry.update({sid: (self, i) for i, sid in enumerate(self._storages)})
        return self._forward[id(leaf)]

    # -- collectives -------------------------------------------------------------------
    def gather(self, shards, phase: str) -> list[torch.Tensor]:
        """One all_gather of the flattened shards, copied out into one tensor per parameter."""
        c10d = torch.ops._c10d_functional
        if self.policy is not None:  # FSDP2 casts each shard before the all_gather
            shards = [s.to(self.policy.compute_dtype(s.dtype)) for s in shards]
        flat = torch.cat([s.reshape(-1) for s in shards]) if len(shards) > 1 else shards[0].reshape(-1)
        gathered = c10d.all_gather_into_tensor(flat, self.world, self.shard_group)
        label_collective(gathered, self.comm(phase))
        gathered = c10d.wait_tensor(gathered).view(self.world, -1)
        parts = torch.ops.aten.split_with_sizes_copy(gathered, self.numels, 1)
        outs = []
        for part, layout in zip(parts, self.layouts):
            full = part.view((self.world * layout.local_shape[0],) + tuple(layout.local_shape[1:]))
            rows = layout.gathered_shape[0]
            outs.append(full.narrow(0, 0, rows) if full.shape[0] != rows else full)
        return outs

    def reduce(self, grads, needed) -> list[torch.Tensor | None]:
        """One reduce_scatter (avg) of every gradient present; None where there is none. Under a
        mixed-precision policy gradients are accumulated and reduced in ``reduce_dtype`` and
        returned in their shard's dtype (the fp32 master), as FSDP2 does."""
        c10d = torch.ops._c10d_functional
        out: list[torch.Tensor | None] = [None] * len(grads)
        if self.policy is not None:
            grads = [g if g is None else g.to(self.policy.gradient_dtype(s.dtype))
                     for g, s in zip(grads, self._shards)]
        if self.accumulation is not None and self.accumulation.deferred:
            pending = self._pending or [None] * len(grads)
            grads = [p if g is None else g if p is None else p + g for p, g in zip(pending, grads)]
            if not self.accumulation.syncing:  # kept unsharded until the sync point's backward
                self._pending = grads
                return out
            self._pending = None
        present = [i for i, (g, need) in enumerate(zip(grads, needed)) if g is not None and need]
        if not present:
            return out
        pieces = []
        for i in present:
            layout = self.layouts[i]
            g = grads[i].reshape(layout.gathered_shape[0], -1)
            pad = self.world * layout.local_shape[0] - g.shape[0]
            if pad:
                g = torch.nn.functional.pad(g, (0, 0, 0, pad))
            pieces.append(g.reshape(self.world, -1))
        buffer = torch.cat(pieces, dim=1) if len(pieces) > 1 else pieces[0]
        reduced = c10d.reduce_scatter_tensor(buffer.reshape(-1), "avg", self.world, self.shard_group)
        label_collective(reduced, self.comm("backward"))
        reduced = c10d.wait_tensor(reduced)
        for replica_group in self.replica_groups:
            reduced = c10d.all_reduce(reduced, "avg", replica_group)
            label_collective(reduced, self.comm("backward"))
            reduced = c10d.wait_tensor(reduced)
        offset = 0
        for i in present:
            n = self.numels[i]
            out[i] = reduced[offset: offset + n].view(self.layouts[i].local_shape).to(self._shards[i].dtype)
            offset += n
        return out

    # -- reshard after forward ---------------------------------------------------------------
    def regathered(self, index: int) -> torch.Tensor:
        if self._backward is None:
            with torch.no_grad():
                self._backward = self.gather([s.detach() for s in self._shards], "backward")
            self._forward = None  # a later forward (another micro-batch) gathers again
            for sid in self._storages:
                self.registry.pop(sid, None)
        return self._backward[index]


@dataclasses.dataclass
class _Regathered:
    owner: GroupGather
    index: int
    size: tuple
    stride: tuple
    offset: int

    def unpack(self) -> torch.Tensor:
        """The saved view, rebuilt on the re-gathered parameter: itself, its transpose (what
        ``linear`` saves), a reshape of it (a broadcast view such as ``D[None, :, None]``),
        else the same strides via ``as_strided`` (admitted with a contract that checks the view
        against the parameter's storage)."""
        base = self.owner.regathered(self.index)
        size, stride = tuple(base.shape), tuple(base.stride())
        if self.offset == base.storage_offset():
            if (self.size, self.stride) == (size, stride):
                return base
            if base.dim() == 2 and (self.size, self.stride) == (size[::-1], stride[::-1]):
                return base.t()
            if base.is_contiguous() and math.prod(self.size) == base.numel():
                reshaped = base.view(self.size)
                if tuple(reshaped.stride()) == self.stride:
                    return reshaped
        return torch.as_strided(base, self.size, self.stride, self.offset)


class _GatherGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, owner: GroupGather, *shards):
        ctx.owner = owner
        ctx.set_materialize_grads(False)
        outs = owner.gather(shards, "forward")
        ctx.mark_non_differentiable(*[o for o, s in zip(outs, shards) if not s.requires_grad])
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        return (None, *ctx.owner.reduce(grads, ctx.needs_input_grad[1:]))


@contextlib.contextmanager
def resharding(gathers: Sequence[GroupGather]):
    """Saved-tensor hooks that free resharded groups after forward (see module docstring)."""
    registry: dict = {}
    for g in gathers:
        g.registry = registry
    if not any(g.group.reshard for g in gathers):
        yield
        return

    def pack(tensor):
        """A saved tensor in a resharded group's forward storage becomes a recipe for backward."""
        if tensor.__class__ is not torch.Tensor and not isinstance(tensor, torch._subclasses.FakeTensor):
            return tensor  # wrapper subclasses (DTensor) hold no group storage
        entry = registry.get(_storage_id(tensor))
        if entry is None:
            return tensor
        return _Regathered(*entry, tuple(tensor.shape), tuple(tensor.stride()), tensor.storage_offset())

    def unpack(saved):
        return saved.unpack() if isinstance(saved, _Regathered) else saved

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield


def _storage_id(tensor: torch.Tensor):
    try:
        return tensor.untyped_storage()._cdata
    except Exception:  # tensors without storage (wrapper subclasses)
        return None


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n

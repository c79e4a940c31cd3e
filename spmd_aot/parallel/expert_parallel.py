"""Expert parallelism: the experts of each mixture-of-experts layer split over an ``ep`` mesh
dimension, tokens sent to their experts' ranks with all-to-all and back, on static shapes.

What an expert module is. transformers' MoE layers (Mixtral, Qwen2-MoE, OLMoE, ...) keep their
experts in one module whose parameters are stacked on dim 0 (``gate_up_proj [E, 2I, H]``,
``down_proj [E, H, I]``), with a ``num_experts`` attribute, called as
``experts(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]`` after the
router: ``out[t] = sum_j top_k_weights[t, j] * expert[top_k_index[t, j]](hidden_states[t])``.
Any module with that contract can be split (``Plan.expert_parallel``: FQN patterns, or
``"auto"``: every module with a ``num_experts`` whose own parameters all have that many rows,
stacked matrices among them; a router's ``[num_experts, hidden]`` weight alone is not one).
The router, shared experts and every other parameter stay where the data-parallel axes put them.

Layout. Rank ``r`` of ``ep`` holds experts ``[r * E/ep, (r + 1) * E/ep)`` (``layout.py``:
``ep_split``; under ``shard`` that slice is then sharded over ``dp_shard`` as FSDP2 would).
``ep`` ranks take different batches: every non-expert gradient is averaged over ``ep`` as over
a data-parallel dimension; an expert's gradient is averaged only over the data-parallel
dimensions (the ranks holding the same experts). The rank holding an expert receives the
tokens of every ``ep`` rank, so its gradient is the sum of their losses' gradients; it is
scaled by ``1/ep`` in backward, so that the result equals the unsplit model's average over all
ranks.

The step (while tracing, the expert module's forward is swapped for ``_ExpertForward``):

1. the ``T * k`` (token, choice) pairs, choice-major (every token's first choice, then every
   second: GShard's priority), each get a *slot* in a send buffer ``[ep, C, H]``: the block of
   their expert's rank, at their position among the pairs sent there;
2. one ``all_to_all_single`` with equal splits (``C`` rows per rank) sends each block to its
   rank, with each row's local expert id packed as one extra column (0: an empty slot);
3. the local experts run the module's own forward on the ``ep * C`` received rows, with the
   parameters of this rank's experts, ``num_experts = E/ep``, one choice per row and weight 1
   (0 for empty slots, whose outputs are exact zeros);
4. one ``all_to_all_single`` returns each row to its sender's slot; each token's output is
   the sum of its pairs' outputs times their routing weights.

Backward mirrors it (two more ``all_to_all_single``: the same equal exchange). A stored graph
cannot depend on how routing falls, so ``C`` is fixed when tracing:

- default: ``C = T * min(k, E/ep)``, the most pairs one rank can send to one rank's experts
  (every token's choices are distinct experts). No pair is ever dropped, and results equal
  the unsplit model's (to float rounding); the buffers are ``ep`` times the busiest case.
- ``expert_capacity_factor=f`` (opt in): each expert takes at most
  ``c = max(1, ceil(f * T * k / E))`` pairs from each rank (Switch Transformer / GShard
  expert capacity, per sending rank), ``C = (E/ep) * c``. Pairs past their expert's capacity,
  in choice-major order, are *dropped*: they contribute zero to their token's output (the
  remaining weights are not renormalized, as in Switch; a token all of whose choices are
  dropped passes through the layer's residual connection only).
"""

from __future__ import annotations

import fnmatch
import math

import torch
from torch import nn

from ..errors import UnsupportedError
from ..passes.collectives import label_collective
from .axis_interface import Axis

__all__ = ["expert_modules", "planned_experts", "ExpertParallel", "capacity", "AXIS"]


def expert_modules(model: nn.Module) -> list[str]:
    """FQNs of ``model``'s expert modules (``expert_parallel="auto"``): modules with an integer
    ``num_experts`` whose own parameters all have ``num_experts`` rows, one of them a stack of
    matrices (3-d; a router's ``[num_experts, hidden]`` weight is not an expert module)."""
    found = []
    for fqn, module in model.named_modules():
        n = getattr(module, "num_experts", None)
        own = list(module.parameters(recurse=False))
        if isinstance(n, int) and n > 0 and own and all(p.dim() >= 1 and p.shape[0] == n for p in own) and \
                any(p.dim() >= 3 for p in own):
            found.append(fqn)
    if not found:
        raise UnsupportedError(
            f"expert_parallel='auto' found no expert module in {type(model).__qualname__}: an expert module "
            "has a num_experts attribute and parameters stacked on dim 0 (one row per expert), and is called "
            "experts(hidden_states, top_k_index, top_k_weights); name yours with FQN patterns instead")
    return found


def planned_experts(model: nn.Module, patterns) -> list[tuple[str, nn.Module]]:
    """(FQN, module) of every module ``patterns`` names, checked against the expert contract."""
    found, used = [], set()
    for fqn, module in model.named_modules():
        match = next((p for p in patterns if fnmatch.fnmatchcase(fqn, p)), None)
        if match is None:
            continue
        used.add(match)
        n = getattr(module, "num_experts", None)
        own = list(module.named_parameters(recurse=False))
        if not isinstance(n, int) or not own or any(p.dim() < 1 or p.shape[0] != n for _, p in own):
            shapes = ", ".join(f"{name} {list(p.shape)}" for name, p in own) or "no parameters of its own"
            raise UnsupportedError(
                f"expert_parallel names {fqn} ({type(module).__qualname__}), but it is not an expert module: "
                f"num_experts={n!r}, {shapes}; an expert module has an integer num_experts and every parameter "
                "of its own stacked on dim 0, one row per expert (transformers' MixtralExperts, Qwen2MoeExperts)")
        if "forward" in vars(module):
            raise UnsupportedError(f"expert_parallel names {fqn}, but its forward is replaced on the instance; "
                                   "name modules that run their class's forward")
        found.append((fqn, module))
    unused = [p for p in patterns if p not in used]
    if unused:
        raise UnsupportedError(
            f"expert_parallel pattern(s) {unused} match no module of {type(model).__qualname__}; patterns match "
            "module FQNs (fnmatch), e.g. 'model.layers.*.mlp.experts', or pass expert_parallel='auto'")
    return found


def capacity(tokens: int, top_k: int, experts: int, ep: int, factor: float | None) -> tuple[int, int | None]:
    """``(C, c)``: rows each rank sends to each rank, and each expert's capacity per sending
    rank (None: no capacity, nothing dropped). See the module docstring."""
    local = experts // ep
    if factor is None:
        return tokens * min(top_k, local), None
    per_expert = max(1, math.ceil(factor * tokens * top_k / experts))
    return local * per_expert, per_expert


class ExpertParallel:
    """While active (tracing), every planned expert module runs ``_ExpertForward``; ``budget()``
    is the all-to-alls their calls added."""

    def __init__(self, model: nn.Module, plan, mesh):
        self.modules = planned_experts(model, plan.expert_parallel)
        dim = plan.mesh_dim("ep")
        self.group = mesh.get_group(dim).group_name
        self.size = mesh.size(dim)
        self.factor = plan.expert_capacity_factor
        self.exchanges = 0  # all_to_all_single calls issued, forward and backward
        for fqn, module in self.modules:
            if module.num_experts % self.size:
                raise UnsupportedError(
                    f"{fqn} has {module.num_experts} experts, which do not split evenly over {self.size} ep ranks; "
                    "choose an ep size that divides the number of experts")

    def budget(self) -> dict[str, int]:
        return {"all_to_all_single": self.exchanges}

    def __enter__(self):
        for fqn, module in self.modules:
            module.forward = _ExpertForward(self, fqn, module)
        return self

    def __exit__(self, *exc):
        for _, module in self.modules:
            vars(module).pop("forward", None)

    def exchange(self, t: torch.Tensor, fqn: str, what: str) -> torch.Tensor:
        """``t``'s ``ep`` equal blocks of dim 0 exchanged: block ``i`` goes to rank ``i``, and
        block ``i`` of the result came from rank ``i``."""
        c10d = torch.ops._c10d_functional
        splits = [t.shape[0] // self.size] * self.size
        out = c10d.all_to_all_single(t.contiguous(), splits, splits, self.group)
        label_collective(out, {"label": f"ep {fqn} {what}", "params": []})
        self.exchanges += 1
        return c10d.wait_tensor(out)


class _Exchange(torch.autograd.Function):
    """The equal all-to-all in forward; the same exchange of the gradient in backward (equal
    blocks: the exchange is its own inverse)."""

    @staticmethod
    def forward(ctx, x, ep, fqn, what):
        ctx.ep, ctx.fqn, ctx.what = ep, fqn, what
        return ep.exchange(x, fqn, what)

    @staticmethod
    def backward(ctx, grad):
        return ctx.ep.exchange(grad, ctx.fqn, f"{ctx.what} gradient"), None, None, None


class _ScaledGrad(torch.autograd.Function):
    """Identity in forward; the gradient times ``scale`` in backward."""

    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


class _ExpertForward:
    """An expert module's forward while tracing (an instance attribute, removed after)."""

    def __init__(self, ep: ExpertParallel, fqn: str, module: nn.Module):
        self.ep, self.fqn, self.module = ep, fqn, module

    def __call__(self, hidden_states, top_k_index, top_k_weights, *args, **kwargs):
        if args or kwargs or hidden_states.dim() != 2 or top_k_index.dim() != 2 or \
                top_k_weights.shape != top_k_index.shape or top_k_index.shape[0] != hidden_states.shape[0]:
            shapes = [list(a.shape) if isinstance(a, torch.Tensor) else type(a).__name__
                      for a in (hidden_states, top_k_index, top_k_weights, *args, *kwargs.values())]
            raise UnsupportedError(
                f"expert_parallel splits {self.fqn}, called with {shapes}; "
                "an expert module is called experts(hidden_states [tokens, hidden], top_k_index [tokens, k], "
                "top_k_weights [tokens, k])")
        ep, module = self.ep, self.module
        tokens, hidden = hidden_states.shape
        top_k = top_k_index.shape[1]
        experts = module.num_experts
        local = experts // ep.size
        rows, per_expert = capacity(tokens, top_k, experts, ep.size, ep.factor)
        device = hidden_states.device
        exact = round(2 / torch.finfo(hidden_states.dtype).eps)  # integers the dtype holds exactly (bf16: 256)
        if local + 1 > exact:
            raise UnsupportedError(
                f"{self.fqn} has {local} experts per ep rank, but their ids travel in a {hidden_states.dtype} "
                f"column, exact only up to {exact}; use more ep ranks (or fewer experts per rank)")

        # 1. each (token, choice) pair's slot, choice-major; dropped pairs go to a dump row
        index = top_k_index.t().reshape(-1).to(torch.int64)  # [P], P = k * T
        dest = torch.div(index, local, rounding_mode="floor")
        local_id = index - dest * local
        if per_expert is None:
            onehot = dest.unsqueeze(1) == torch.arange(ep.size, device=device)
            position = (onehot.cumsum(0) * onehot).sum(1) - 1  # among the pairs sent to that rank
            slot = dest * rows + position
        else:
            onehot = index.unsqueeze(1) == torch.arange(experts, device=device)
            position = (onehot.cumsum(0) * onehot).sum(1) - 1  # among the pairs sent to that expert
            slot = torch.where(position < per_expert, dest * rows + local_id * per_expert + position,
                               ep.size * rows)
        tag = (local_id + 1).to(hidden_states.dtype).unsqueeze(1)  # 0 marks an empty slot
        payload = torch.cat([hidden_states.repeat(top_k, 1), tag], 1)  # [P, H + 1]
        send = hidden_states.new_zeros(ep.size * rows + 1, hidden + 1)
        send = torch.index_put(send, (slot,), payload, accumulate=True)[:-1]

        # 2. to the experts' ranks
        received = _Exchange.apply(send, ep, self.fqn, "dispatch")
        x, tag = received[:, :hidden], received[:, hidden].detach()
        present = tag > 0.5
        ids = (tag - 1).clamp(min=0).to(torch.int64).unsqueeze(1)

        # 3. this rank's experts, by the module's own forward
        out = self._local_experts(x, ids, present.to(hidden_states.dtype).unsqueeze(1), local)

        # 4. back to the senders' slots; each token's pairs weighted and summed
        back = _Exchange.apply(out.to(hidden_states.dtype), ep, self.fqn, "combine")
        back = torch.cat([back, back.new_zeros(1, hidden)])  # the dump row: dropped pairs give zero
        pairs = back[slot] * top_k_weights.t().reshape(-1, 1).to(back.dtype)
        return pairs.view(top_k, tokens, hidden).sum(0).to(hidden_states.dtype)

    def _local_experts(self, x, ids, weights, local: int):
        """The module's class forward on this rank's experts: its parameters are this rank's
        rows (the compute tensors), their gradients scaled by ``1/ep``, ``num_experts`` local."""
        module = self.module
        names = [n for n, _ in module.named_parameters(recurse=False)]
        shadow = vars(module)  # instance attributes win over nn.Module.__getattr__'s parameters
        saved = shadow.get("num_experts")
        scale = 1.0 / self.ep.size
        shadow.update({n: _ScaledGrad.apply(getattr(module, n), scale) for n in names})
        shadow["num_experts"] = local
        try:
            return type(module).forward(module, x, ids, weights)
        finally:
            for n in names:
                shadow.pop(n, None)
            if saved is None:
                shadow.pop("num_experts", None)
            else:
                shadow["num_experts"] = saved


class ExpertParallelAxis(Axis):
    """The ``ep`` mesh dimension: planned expert modules exchange tokens with all-to-all while the
    step is traced; their calls bound the all-to-alls (``ExpertParallel.budget``)."""

    name = "expert_parallel"
    roles = ("ep",)

    def tracing(self, plan, model, mesh):
        return ExpertParallel(model, plan, mesh)


AXIS = ExpertParallelAxis()

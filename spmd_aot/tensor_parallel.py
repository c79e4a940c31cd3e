"""Tensor parallelism (Megatron style) on the last mesh dimension, in the vocabulary of
``torch.distributed.tensor.parallel.parallelize_module``.

A plan maps module FQN patterns (fnmatch, first match wins) to a style, e.g.
``{"blocks.*.attn.q": "colwise", "blocks.*.attn.o": "rowwise"}``. One class per style owns
its text form (``name``), which tensor dimension of each of the module's parameters is split
over the TP ranks (``param_dims``), the collectives one call of the module needs (``budget``)
and the module's forward on local tensors while the step is traced.

As everywhere in spmd-aot the model computes on local tensors; a planned ``nn.Linear`` reads
its TP-local weight and bias (``_ComputeOnAccess`` in ``trace.py``), and its forward is
swapped, while tracing only, for the style's:

- ``colwise`` (``ColwiseParallel``): weight and bias split on dim 0 (output features). The
  input is *copied to the TP region*: identity in forward, ``all_reduce(sum)`` of its gradient
  over the TP ranks in backward; modules reading the same input tensor (``q``, ``k``, ``v``)
  share one copy, hence one all_reduce. The output is the local slice of the features
  (``use_local_output=True``).
- ``rowwise`` (``RowwiseParallel``): weight split on dim 1 (input features), bias whole. The
  input is the local slice of the features (a colwise output); the product is a partial sum,
  ``all_reduce(sum)`` over the TP ranks in forward (identity in backward), then the bias is
  added once.

A module that splits heads must use its local head count: compute it from the local tensor
(``n_heads = q.shape[-1] // self.head_dim``, as torchtitan's ``n_local_heads``), not from
``self.q.out_features`` or a global ``n_heads`` attribute. Parameters of unplanned modules
are whole on every TP rank; their gradients agree across TP ranks because colwise inputs and
rowwise outputs are whole.
"""

from __future__ import annotations

import fnmatch
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from .errors import UnsupportedError
from .passes.collectives import label_collective

__all__ = ["TP_STYLES", "TPStyle", "Colwise", "Rowwise", "TensorParallel", "planned_modules"]

TP_STYLES: dict[str, "TPStyle"] = {}  # name -> style object, in definition order


class TPStyle:
    """The interface of a style; a style holds no state."""

    name: ClassVar[str]
    summary: ClassVar[str]
    # parameter of the module -> tensor dimension split over TP (None: whole on every TP rank)
    param_dims: ClassVar[dict[str, int | None]]
    # the most collectives of each kind one call of the module adds to the step
    budget: ClassVar[dict[str, int]]

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        TP_STYLES[cls.name] = cls()

    def forward(self, tp: "TensorParallel", fqn: str, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class Colwise(TPStyle):
    name = "colwise"
    summary = "nn.Linear split on output features; input copied to the TP region, output local"
    param_dims = {"weight": 0, "bias": 0}
    budget = {"all_reduce": 1}

    def forward(self, tp, fqn, module, x):
        return F.linear(tp.copied_in(x, fqn), module.weight, module.bias)


class Rowwise(TPStyle):
    name = "rowwise"
    summary = "nn.Linear split on input features; partial output all_reduced over TP, bias added once"
    param_dims = {"weight": 1, "bias": None}
    budget = {"all_reduce": 1}

    def forward(self, tp, fqn, module, x):
        out = _ReduceFromTP.apply(F.linear(x, module.weight), tp, [fqn])
        bias = module.bias
        return out if bias is None else out + bias


def style_for(tp_plan, fqn: str) -> TPStyle | None:
    """The style of module ``fqn`` under ``tp_plan`` ((pattern, style name) pairs), or None."""
    for pattern, name in tp_plan:
        if fnmatch.fnmatchcase(fqn, pattern):
            return TP_STYLES[name]
    return None


def planned_modules(model: nn.Module, tp_plan) -> list[tuple[str, nn.Module, TPStyle]]:
    """(FQN, module, style) of every module the plan names; refuses patterns that match no
    module and modules a style cannot split."""
    found, used = [], set()
    for fqn, module in model.named_modules():
        for pattern, name in tp_plan:
            if fnmatch.fnmatchcase(fqn, pattern):
                used.add(pattern)
                found.append((fqn, module, TP_STYLES[name]))
                break
    unused = [pattern for pattern, _ in tp_plan if pattern not in used]
    if unused:
        raise UnsupportedError(
            f"tp_plan pattern(s) {unused} match no module of {type(model).__qualname__}; patterns "
            "match module FQNs (fnmatch), e.g. 'blocks.*.attn.q' (see model.named_modules())")
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    for fqn, module, style in found:
        if not isinstance(module, nn.Linear) or type(module).forward is not nn.Linear.forward \
                or "forward" in vars(module):
            raise UnsupportedError(
                f"tp_plan puts {fqn} ({type(module).__qualname__}) {style.name}; {style.name} splits "
                "nn.Linear modules (with nn.Linear's own forward) only")
        for attr, dim in style.param_dims.items():
            param = getattr(module, attr, None)
            if dim is not None and param is not None and len(names.get(id(param), [])) > 1:
                raise UnsupportedError(
                    f"tp_plan splits {fqn}.{attr} {style.name}, but it is tied to "
                    f"{', '.join(n for n in names[id(param)] if n != f'{fqn}.{attr}')}; a tied parameter "
                    "cannot be split for one of its modules only: leave it out of the tp_plan")
    return found


class TensorParallel:
    """While active (tracing), every planned module runs its style's forward on local tensors.

    ``budget()`` is the most collectives of each kind the planned modules' calls may add."""

    def __init__(self, model: nn.Module, tp_plan, mesh):
        self.modules = planned_modules(model, tp_plan)
        self.group = mesh.get_group(mesh.ndim - 1).group_name
        self.calls: dict[str, int] = {}
        self._copies: dict[int, tuple[torch.Tensor, torch.Tensor, list[str]]] = {}

    def budget(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for fqn, _, style in self.modules:
            for kind, n in style.budget.items():
                out[kind] = out.get(kind, 0) + n * self.calls.get(fqn, 0)
        return out

    def __enter__(self):
        for fqn, module, style in self.modules:
            module.forward = _PlannedForward(self, fqn, module, style)
        return self

    def __exit__(self, *exc):
        for _, module, _ in self.modules:
            vars(module).pop("forward", None)
        self._copies.clear()

    def copied_in(self, x: torch.Tensor, fqn: str) -> torch.Tensor:
        """``x`` copied to the TP region; one copy per input tensor, shared by its readers."""
        entry = self._copies.get(id(x))
        if entry is None or entry[0] is not x:
            readers: list[str] = []  # the modules sharing the copy, named by its all_reduce
            entry = self._copies[id(x)] = (x, _CopyToTP.apply(x, self, readers), readers)  # holds x: ids stay unique
        entry[2].append(fqn)
        return entry[1]

    def all_reduce(self, t: torch.Tensor, modules: list[str], what: str) -> torch.Tensor:
        """``all_reduce(sum)`` over the TP dimension, labelled with the modules it serves."""
        c10d = torch.ops._c10d_functional
        reduced = c10d.all_reduce(t.contiguous(), "sum", self.group)
        label_collective(reduced, {"label": f"tp {modules[0]} {what}", "params": [f"{m}.weight" for m in modules]})
        return c10d.wait_tensor(reduced)


class _PlannedForward:
    """A planned module's forward while tracing (an instance attribute, removed after)."""

    def __init__(self, tp, fqn, module, style):
        self.tp, self.fqn, self.module, self.style = tp, fqn, module, style

    def __call__(self, x):
        self.tp.calls[self.fqn] = self.tp.calls.get(self.fqn, 0) + 1
        return self.style.forward(self.tp, self.fqn, self.module, x)


class _CopyToTP(torch.autograd.Function):
    """Identity in forward; the gradient summed over the TP ranks in backward."""

    @staticmethod
    def forward(ctx, x, tp, readers):
        ctx.tp, ctx.readers = tp, readers
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return ctx.tp.all_reduce(grad, ctx.readers, "input gradient"), None, None


class _ReduceFromTP(torch.autograd.Function):
    """The partial sums of the TP ranks added up in forward; identity in backward."""

    @staticmethod
    def forward(ctx, partial, tp, modules):
        return tp.all_reduce(partial, modules, "output")

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None

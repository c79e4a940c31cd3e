"""Tensor parallelism inside pipeline stages: the TP autograd functions kept whole across the cut.

A pipeline's forward is traced once as a whole (``stages.py``) and each stage's piece is traced
again by AOTAutograd to get its backward. A plain forward trace records what a TP autograd
function (``parallel/tp_autograd.py``) *does* in forward, not what it is: ``CopyToTP`` becomes a
view, whose derivative AOTAutograd would take as the identity, where its backward is an
all_reduce over the TP ranks; ``ReduceFromTP`` becomes an all_reduce, which has no derivative.

So while the whole forward is traced, every call of a TP autograd function is noted: the
function, its arguments, and the graph nodes its forward made (``TPCalls``). Before the graph
is cut, each such run of nodes is replaced by one node calling the function again
(``rewrite``). When AOTAutograd runs a stage's piece, that node applies the function itself, so
the stage's forward graph gets its forward collectives and the stage's backward graph the
backward ones (the collectives' group is the mesh's TP dimension; ``encode_graph`` stores it as
that dimension's index).

Parameters enter the trace TP-local (``local_shape``), as the whole-step build gives them to
the model: each stage's graphs compute on this TP rank's slice, the same graphs for every TP
rank.
"""

from __future__ import annotations

import dataclasses

import torch

from ..errors import UnsupportedError
from ..parallel import tp_autograd
from ..parallel.tp_plan import split_dim

__all__ = ["StageTP", "TPCalls", "local_shape"]

_FUNCTIONS = tuple(getattr(tp_autograd, name) for name in tp_autograd.__all__)


#: the TP group's name in a traced stage graph: fake tensors never communicate, so no process
#: group is needed to trace (``encode_graph`` stores it as the mesh's TP dimension)
GROUP = "pipeline_stage_tp"


@dataclasses.dataclass(frozen=True)
class StageTP:
    """What tracing a stage under TP needs: the plan ((pattern, style) pairs), the TP size and
    the TP dimension of the pipeline's mesh."""

    tp_plan: tuple[tuple[str, str], ...]
    size: int
    mesh_dim: int
    group_name: str = GROUP

    @property
    def mesh(self) -> _TracingMesh:
        """What ``TensorParallel`` asks a mesh (its TP group's name and size), without a process group."""
        return _TracingMesh(self)


@dataclasses.dataclass(frozen=True)
class _TracingMesh:
    tp: StageTP

    def get_group(self, dim: int) -> StageTP:
        return self.tp

    def size(self, dim: int) -> int:
        return self.tp.size


def local_shape(tp_plan, fqn: str, shape: tuple[int, ...], tp: int) -> tuple[int, ...]:
    """Parameter ``fqn``'s shape on one TP rank: its planned dimension divided by ``tp``."""
    found = split_dim(tp_plan, fqn)
    if found is None or found[1] is None:
        return tuple(shape)
    style, dim = found
    if shape[dim] % tp:
        raise UnsupportedError(
            f"tp_plan splits {fqn} ({style}) on dim {dim} of {list(shape)} over {tp} TP ranks, which does not "
            f"divide; pipeline stages split evenly: use sizes that are multiples of {tp} or leave it out of the plan")
    out = list(shape)
    out[dim] //= tp
    return tuple(out)


@dataclasses.dataclass
class _Call:
    function: type
    args: tuple  # the call's arguments, each tensor replaced by its graph node
    made: list  # the nodes its forward added, in order
    outputs: list  # the node of each tensor it returned (a tuple when it returned several)
    single: bool


class TPCalls:
    """While active (around ``make_fx``), each call of a TP autograd function is noted."""

    def __init__(self):
        self.calls: list[_Call] = []
        self._saved: list = []

    def __enter__(self):
        for fn in _FUNCTIONS:
            self._saved.append((fn, vars(fn).get("apply")))
            fn.apply = classmethod(self._noting(fn, fn.apply))
        return self

    def __exit__(self, *exc):
        for fn, original in self._saved:
            if original is None:
                del fn.apply
            else:
                fn.apply = original
        self._saved.clear()

    def _noting(self, fn, apply):
        calls = self.calls

        def noted(cls, *args):
            from torch.fx.experimental.proxy_tensor import get_proxy_mode, get_proxy_slot

            mode = get_proxy_mode()
            if mode is None:
                return apply(*args)
            graph = mode.tracer.graph
            before = len(graph.nodes)

            def node_of(a):
                if not isinstance(a, torch.Tensor):
                    return a
                slot = get_proxy_slot(a, mode.tracer, None)
                if slot is None:
                    raise UnsupportedError(f"{fn.__name__} got a tensor the trace does not know (a constant)")
                return slot.proxy.node
            inputs = tuple(node_of(a) for a in args)
            out = apply(*args)
            made = list(graph.nodes)[before:]
            single = isinstance(out, torch.Tensor)
            outputs = [node_of(t) for t in ((out,) if single else out)]
            calls.append(_Call(fn, inputs, made, outputs, single))
            return out
        return noted


def rewrite(gm: torch.fx.GraphModule, calls: list[_Call]) -> dict:
    """Replace each noted call's nodes by one node applying its function again; returns each
    removed node -> the node standing for its call (a stage boundary noted at one of them moves
    there)."""
    graph = gm.graph
    moved: dict = {}
    alive = set(graph.nodes)
    for call in calls:
        if not call.made or not all(n in alive for n in call.made):
            raise UnsupportedError(f"the trace dropped part of {call.function.__name__}'s forward; a TP layer's "
                                   "output must be used")
        node_args = tuple(a for a in call.args if isinstance(a, torch.fx.Node))
        with graph.inserting_before(call.made[0]):
            node = graph.call_function(_replay(call.function, call.args), node_args)
        node.meta["val"] = call.outputs[0].meta.get("val") if call.single else \
            tuple(o.meta.get("val") for o in call.outputs)
        if call.single:
            call.outputs[0].replace_all_uses_with(node)
        else:
            with graph.inserting_after(node):
                for i, out in enumerate(call.outputs):
                    item = graph.call_function(_item, (node, i))
                    item.meta["val"] = out.meta.get("val")
                    out.replace_all_uses_with(item)
        for made in reversed(call.made):
            if made.users:
                raise UnsupportedError(f"a value made inside {call.function.__name__}'s forward is read outside it")
            graph.erase_node(made)
            alive.discard(made)
            moved[made] = node
    graph.lint()
    gm.recompile()
    return moved


def _item(values, i: int):
    return values[i]


def _replay(function: type, args: tuple):
    """A function of the call's tensor inputs that applies ``function`` with its other arguments
    as they were (the tracing ``TensorParallel``, module names, ops)."""
    tensor_at = [i for i, a in enumerate(args) if isinstance(a, torch.fx.Node)]

    def replay(*tensors):
        full = list(args)
        for i, t in zip(tensor_at, tensors):
            full[i] = t
        return function.apply(*full)
    replay.__name__ = f"replay_{function.__name__}"
    replay.__qualname__ = replay.__name__
    return replay

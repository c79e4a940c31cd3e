"""A model's forward and loss, cut into pipeline stages, each traced into a forward and a
backward graph.

Why one whole trace first: a stage boundary in real models is not one tensor. A transformers
decoder hands each layer the residual stream *and* the rotary position embeddings and the
causal mask computed once at the top; torch's ``pipeline()`` finds them by exporting the model
and splitting the graph. Here the forward and the loss are traced once with ``make_fx`` on fake
tensors, a forward pre-hook on each split-point module notes where in the graph its stage
begins, and every value made before a boundary and read after it becomes a stage output there
(relayed stage to stage, so each stage talks only to its neighbours).

Each stage's piece is then traced again through AOTAutograd (``aot_function`` with the default
partition: what the backward reads is what the forward saves, as eager autograd keeps it), which
gives two graphs: ``forward(inputs) -> (outputs, saved)`` and ``backward(saved, output grads)
-> input grads``. The schedule's runtime calls them per micro-batch, holding ``saved`` in
between, so activations of in-flight micro-batches live exactly as long as they do in eager
pipelining.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any
from collections.abc import Callable

import torch
import torch._guards
import torch.utils._pytree as pytree
from torch.fx.experimental.proxy_tensor import make_fx
from torch.nn.utils import stateless

from ..errors import UnsupportedError
from .stage_tp import TPCalls, local_shape, rewrite

__all__ = ["StageGraphs", "Port", "trace_stages"]


@dataclasses.dataclass
class Port:
    """One tensor crossing a stage boundary or entering a stage: what it is and its metadata."""

    name: str  # "param:<fqn>", "buffer:<fqn>", "batch:<i>", "act:<node>"
    shape: tuple[int, ...]
    dtype: torch.dtype
    grad: bool  # a gradient flows back through it

    def to_dict(self) -> dict:
        return {"name": self.name, "shape": list(self.shape), "dtype": str(self.dtype).removeprefix("torch."),
                "grad": self.grad}


@dataclasses.dataclass
class StageGraphs:
    index: int
    inputs: list[Port]  # forward graph inputs: parameters, buffers, received activations, batch leaves
    outputs: list[Port]  # sent to the next stage; on the last stage the one loss
    saved: list[Port]  # what the forward keeps for the backward
    forward: torch.fx.GraphModule  # inputs -> outputs + saved
    backward: torch.fx.GraphModule  # saved + grads of outputs with grad -> grads of inputs with grad
    stats: dict = dataclasses.field(default_factory=dict)  # filled by the build (nodes, bytes)


def trace_stages(model: torch.nn.Module, loss_fn: Callable, batch: tuple,
                 split_points: tuple[str, ...], tp=None) -> list[StageGraphs]:
    """``model(*batch[:-1])`` then ``loss_fn(output, batch[-1])``, on one micro-batch of fake
    tensors, as ``len(split_points) + 1`` stages. ``tp``: a ``stage_tp.StageTP`` when the stages
    are tensor parallel (the graphs then compute on TP-local parameters, TP collectives in them)."""
    params = _unique(model.named_parameters(remove_duplicate=False))
    buffers = _unique(model.named_buffers(remove_duplicate=False))
    sharded = [names[0] for names, p in params if hasattr(p, "device_mesh")]
    if sharded:  # a job-start miss after a Pipeline(placement="shard") step sharded them in place
        raise UnsupportedError(
            f"{sharded[0]} and {len(sharded) - 1} other parameter(s) are DTensors (a pipeline step with "
            "placement='shard' shards them at its first call), and a pipeline is traced from whole parameters: "
            "build this configuration ahead of time with spmd_aot.build_pipeline, or trace it before the first step")
    leaves, spec = pytree.tree_flatten(tuple(batch))
    if not isinstance(batch, (tuple, list)) or len(batch) < 2 or not all(isinstance(t, torch.Tensor) for t in leaves):
        raise UnsupportedError("a pipeline step's batch is a tuple of tensors (model inputs..., target): the model "
                               "is called as model(*batch[:-1]) and the loss as loss_fn(output, batch[-1])")
    names = [f"param:{names[0]}" for names, _ in params] + [f"buffer:{names[0]}" for names, _ in buffers] + \
            [f"batch:{i}" for i in range(len(leaves))]
    flat = [p for _, p in params] + [b for _, b in buffers] + leaves
    if tp is not None:  # each parameter as one TP rank holds it
        flat[:len(params)] = [p.new_empty(local_shape(tp.tp_plan, names[0], tuple(p.shape), tp.size))
                              .requires_grad_(p.requires_grad) for names, p in params]
    gm, marks = _whole_trace(model, loss_fn, params, buffers, spec, flat, split_points, tp)
    return _cut(gm, marks, names, params)


def _unique(named) -> list[tuple[tuple[str, ...], torch.Tensor]]:
    by_id: dict[int, tuple[list[str], torch.Tensor]] = {}
    for name, t in named:
        by_id.setdefault(id(t), ([], t))[0].append(name)
    return [(tuple(names), t) for names, t in by_id.values()]


def _whole_trace(model, loss_fn, params, buffers, spec, flat, split_points, tp=None):
    """The forward and loss as one aten graph, and the last node before each stage boundary;
    under ``tp`` the planned modules run their TP styles, each TP autograd function one node
    (``stage_tp.rewrite``)."""
    modules = dict(model.named_modules())
    missing = [p for p in split_points if p not in modules]
    if missing:
        raise UnsupportedError(f"split point {missing[0]!r} names no module of {type(model).__name__}; "
                               f"split points are module FQNs such as {next(iter(_block_names(model)), 'layers.1')!r}")
    marks: dict[str, Any] = {}

    def noting(fqn):
        def hook(module, args):
            from torch.fx.experimental.proxy_tensor import get_proxy_mode

            if fqn in marks:
                raise UnsupportedError(f"split point {fqn!r} runs twice in one forward; pick a module that runs once")
            mode = get_proxy_mode()
            marks[fqn] = list(mode.tracer.graph.nodes)[-1] if mode is not None else None
        return hook

    n_params, n_buffers = len(params), len(buffers)

    def whole(*xs):
        bindings = {}
        for (names, _), x in zip(params + buffers, xs[:n_params + n_buffers]):
            bindings.update(dict.fromkeys(names, x))
        batch = pytree.tree_unflatten(list(xs[n_params + n_buffers:]), spec)
        with stateless._reparametrize_module(model, bindings):
            loss = loss_fn(model(*batch[:-1]), batch[-1])
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            raise UnsupportedError("a pipeline's loss_fn returns one scalar tensor (the micro-batch's loss)")
        return loss

    handles = [modules[p].register_forward_pre_hook(noting(p)) for p in split_points]
    calls = TPCalls()
    try:
        with torch.enable_grad(), _tensor_parallel(model, tp), calls if tp is not None else contextlib.nullcontext():
            gm = make_fx(whole, tracing_mode="fake")(*flat)
    except UnsupportedError:
        raise
    except Exception as exc:
        raise UnsupportedError(f"tracing the pipeline's forward and loss failed: {type(exc).__name__}: "
                               f"{str(exc).splitlines()[0] if str(exc) else ''}") from exc
    finally:
        for h in handles:
            h.remove()
    moved = rewrite(gm, calls.calls) if calls.calls else {}
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    traced_marks = [moved.get(marks.get(p), marks.get(p)) for p in split_points]
    for p, m in zip(split_points, traced_marks):
        if m is None:
            raise UnsupportedError(
                f"split point {p!r} never ran in the model's forward; name a module the forward calls")
    positions = [order[m] for m in traced_marks]
    if positions != sorted(positions):
        raise UnsupportedError(f"split points {list(split_points)} run in another order in the forward; list "
                               "them in the order the forward runs them")
    return gm, positions


def _tensor_parallel(model, tp):
    """The planned modules running their TP styles (``parallel/tensor_parallel.py``), or nothing."""
    if tp is None:
        return contextlib.nullcontext()
    from ..parallel.tensor_parallel import TensorParallel

    return TensorParallel(model, tp.tp_plan, tp.mesh, tp.mesh_dim)


def _block_names(model):
    for fqn, m in model.named_modules():
        if isinstance(m, (torch.nn.ModuleList, torch.nn.Sequential)):
            yield from (f"{fqn}.{c}" if fqn else c for c, _ in list(m.named_children())[1:2])


def _cut(gm, marks: list[int], names: list[str], params) -> list[StageGraphs]:
    nodes = list(gm.graph.nodes)
    stage_of: dict[torch.fx.Node, int] = {}
    for i, node in enumerate(nodes):
        if node.op in ("call_function", "get_attr"):
            stage_of[node] = sum(1 for m in marks if i > m)
    n_stages = len(marks) + 1
    placeholders = [n for n in nodes if n.op == "placeholder"]
    name_of = dict(zip(placeholders, names))
    _refuse_mutated_inputs(nodes, name_of)
    readers: dict[torch.fx.Node, set[int]] = {}
    for node in nodes:
        if node.op in ("call_function",):
            for used in node.all_input_nodes:
                readers.setdefault(used, set()).add(stage_of[node])
    for ph in placeholders:
        stages = readers.get(ph, set())
        if name_of[ph].startswith(("param:", "buffer:")) and len(stages) > 1:
            raise UnsupportedError(
                f"{name_of[ph].split(':', 1)[1]} is read by stages {sorted(stages)}: each stage owns its parameters "
                "and buffers (tied weights, such as an embedding shared with the output head, cannot be split); "
                "untie them or move the split points so one stage holds every reader")
    output_node = nodes[-1]
    loss = output_node.args[0]
    # values made on stage < s and read on stage >= s cross boundary s - 1 -> s (relayed)
    crossing: list[list[torch.fx.Node]] = [[] for _ in range(n_stages)]
    for node, made in stage_of.items():
        last_reader = max(readers.get(node, {made}))
        for s in range(made + 1, last_reader + 1):
            crossing[s].append(node)
    trainable = {f"param:{names[0]}" for names, p in params if p.requires_grad}
    return _stage_graphs(gm, nodes, stage_of, name_of, readers, crossing, loss, n_stages, trainable)


def _refuse_mutated_inputs(nodes, name_of) -> None:
    for node in nodes:
        target = node.target
        if node.op == "call_function" and isinstance(target, torch._ops.OpOverload) and target._schema.is_mutable:
            for arg in node.all_input_nodes:
                if arg in name_of:
                    raise UnsupportedError(
                        f"the forward updates {name_of[arg].split(':', 1)[1]} in place ({node.target}): a pipeline "
                        "stage's graphs take parameters and buffers as inputs and return no updated buffers, so "
                        "modules that update buffers in forward (BatchNorm in training) are not supported; use "
                        "LayerNorm/RMSNorm or eval-mode BatchNorm")


def _stage_graphs(gm, nodes, stage_of, name_of, readers, crossing, loss, n_stages, trainable) -> list[StageGraphs]:
    out = []
    for s in range(n_stages):
        graph = torch.fx.Graph()
        env: dict[torch.fx.Node, torch.fx.Node] = {}
        inputs: list[torch.fx.Node] = []
        own_placeholders = [p for p in name_of if s in readers.get(p, set())]
        params_first = sorted(own_placeholders, key=lambda p: (not name_of[p].startswith("param:"),
                                                               not name_of[p].startswith("buffer:")))
        ports_in = []
        for p in [p for p in params_first if not name_of[p].startswith("batch:")]:
            env[p] = graph.placeholder(_safe(name_of[p]))
            inputs.append(p)
        for node in crossing[s]:
            env[node] = graph.placeholder(f"recv_{node.name}")
            inputs.append(node)
        for p in [p for p in params_first if name_of[p].startswith("batch:")]:
            env[p] = graph.placeholder(_safe(name_of[p]))
            inputs.append(p)
        for node in nodes:
            if stage_of.get(node) == s:
                env[node] = graph.node_copy(node, env.__getitem__)
        if s == n_stages - 1:
            results = [loss]
        else:
            results = crossing[s + 1]
        outs = []
        for node in results:
            value = env[node]
            if value.op == "placeholder" or _is_view(node):  # a stage output owns its memory
                value = graph.call_function(torch.ops.aten.clone.default, (value,))
            outs.append(value)
        graph.output(tuple(outs))
        stage_gm = torch.fx.GraphModule(gm, graph)
        for node in inputs:
            meta = node.meta["val"]
            name = name_of.get(node, f"act:{node.name}")
            ports_in.append((name, meta))
        ports_out = [(f"act:{n.name}" if s < n_stages - 1 else "loss", n.meta["val"]) for n in results]
        out.append((stage_gm, ports_in, ports_out))
    return _forward_backward(out, trainable)


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name)


def _is_view(node) -> bool:
    t = node.target
    return isinstance(t, torch._ops.OpOverload) and any(r.alias_info is not None for r in t._schema.returns)


def _forward_backward(pieces, trainable: set[str]) -> list[StageGraphs]:
    """Each stage's piece through AOTAutograd, in stage order on fake tensors, so which received
    activations carry a gradient is known from what the previous stage returned."""
    from torch._functorch.aot_autograd import aot_function
    from torch._functorch.partitioners import default_partition

    stages = []
    carried: list[torch.Tensor] = []  # the previous stage's fake outputs
    for s, (stage_gm, ports_in, ports_out) in enumerate(pieces):
        captured: dict[str, torch.fx.GraphModule] = {}

        def capture(name, captured=captured):
            def compiler(g, _example):
                from torch._functorch.aot_autograd import make_boxed_func

                captured[name] = g
                return make_boxed_func(g)
            return compiler

        fn = aot_function(stage_gm, fw_compiler=capture("forward"), bw_compiler=capture("backward"),
                          partition_fn=default_partition)
        args, received = [], iter(carried)
        for name, meta in ports_in:
            if name.startswith("act:"):
                prev = next(received)
                x = torch.empty_like(meta).requires_grad_(prev.requires_grad)
            else:
                x = torch.empty_like(meta).requires_grad_(name in trainable)
            args.append(x)
        # real constants the whole trace made (a causal mask) meet fake inputs here
        fake_mode = torch._guards.detect_fake_mode(args)
        allowed = fake_mode.allow_non_fake_inputs
        fake_mode.allow_non_fake_inputs = True
        try:
            outs, backward_ran = _run_fake(fn, args)
        finally:
            fake_mode.allow_non_fake_inputs = allowed
        if not backward_ran or "backward" not in captured:
            raise UnsupportedError(f"pipeline stage {s} has no gradient to compute (none of its inputs needs one)")
        n_saved = _count_outputs(captured["forward"]) - len(outs)
        fw_out = _output_metas(captured["forward"])
        inputs = [Port(name, tuple(meta.shape), meta.dtype, a.requires_grad) for (name, meta), a in zip(ports_in, args)]
        outputs = [Port(name, tuple(o.shape), o.dtype, o.requires_grad) for (name, _), o in zip(ports_out, outs)]
        saved = [Port(f"saved:{i}", tuple(v.shape), v.dtype, False) for i, v in enumerate(fw_out[len(outs):])]
        assert len(saved) == n_saved
        stages.append(StageGraphs(s, inputs, outputs, saved, captured["forward"], captured["backward"]))
        carried = [o.detach().requires_grad_(o.requires_grad) for o in outs]
    return stages


def _run_fake(fn, args):
    """The stage's forward and backward on fake tensors (what makes AOTAutograd trace both)."""
    with torch.enable_grad():
        outs = fn(*args)
        outs = list(outs) if isinstance(outs, (tuple, list)) else [outs]
        with_grad = [o for o in outs if o.requires_grad]
        if with_grad:
            torch.autograd.backward(with_grad, [torch.ones_like(o) for o in with_grad])
    return outs, bool(with_grad)


def _count_outputs(gm) -> int:
    return len(next(n for n in gm.graph.nodes if n.op == "output").args[0])


def _output_metas(gm) -> list:
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    return [n.meta["val"] for n in out]

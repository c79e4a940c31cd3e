"""A backward pass run in Python, for tracing CUDA steps on a machine whose torch sees no GPU.

Why: building for ``--device cuda`` traces on fake CUDA tensors. Torch's C++ autograd engine
cannot run a backward over them in a process without a CUDA device (torch 2.13 and 2.14 alike):
``FakeTensorMode`` swaps the CUDA device guard for a no-op one that reports one device, so
``Engine::compute_dependencies`` stashes the current streams of "device 0" and
``CUDAHooks::hasPrimaryContext(0)`` fails with "hasPrimaryContext expects a valid device
index, but got device_index=0" (the forward traces fine). Every ``loss.backward()`` of a CUDA
build on a GPU-less CI box failed there.

What: while ``python_backward()`` is active, ``torch.autograd``'s call into the C++ engine
(``_engine_run_backward``: ``Tensor.backward``, ``torch.autograd.backward`` and ``.grad``) runs
this engine instead. It walks the same autograd graph and calls the same nodes (each node's
backward kernels dispatch as in eager, so the traced graph holds the same ops), in the C++
engine's order for one thread: a ready node with the highest sequence number first
(``AccumulateGrad`` before all), gradients summed per input and fitted to the input's metadata
(shape reduced with ``sum_to_size``, dtype and device converted) as ``validate_outputs`` does.
Hooks that torch keeps in Python run as the engine runs them: tensor hooks
(``Tensor.register_hook``, on leaves and, registered while the context is active, on
intermediate tensors) before the gradient is used, post-accumulate-grad hooks by
``AccumulateGrad`` itself. Not supported (an ``UnsupportedError`` where it can be detected):
``create_graph=True`` (higher-order gradients), ``backward(inputs=...)``, and hooks registered
on autograd nodes (``grad_fn.register_hook``/``register_prehook``, which ``nn.Module`` full
backward hooks use): ``builder.py`` refuses models with module backward hooks when it uses this
engine.

On a machine where torch sees a CUDA device the C++ engine traces as usual (``needed()``).
"""

from __future__ import annotations

import contextlib
import heapq
import itertools

import torch
import torch.autograd
import torch.autograd.graph

from ..errors import UnsupportedError

__all__ = ["needed", "python_backward", "run_backward", "gpu_less_cuda_tracing"]


def needed(device_type: str) -> bool:
    """True when tracing for ``device_type`` needs this engine: CUDA, and torch sees no device."""
    return device_type == "cuda" and not torch.cuda.is_available()


_NONLEAF_HOOKS: dict | None = None  # (grad_fn, output_nr) -> the tensor's _backward_hooks dict
_TENSOR_INPUTS: dict | None = None  # autograd.Function node -> which forward arguments were tensors


def _edge(t):
    if isinstance(t, torch.autograd.graph.GradientEdge):
        return t.node, t.output_nr
    if not t.requires_grad:
        raise RuntimeError("element 0 of tensors does not require grad and does not have a grad_fn")
    # A leaf's AccumulateGrad is reached through a view (torch's own way from Python): not traced
    from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing

    with disable_proxy_modes_tracing():
        return torch.autograd.graph._get_grad_fn_or_grad_acc(t), t.output_nr


def _fit(g: torch.Tensor, meta) -> torch.Tensor:
    """Fit ``g`` to an input's metadata as the C++ engine's ``validate_outputs`` does."""
    shape = torch.Size(meta.shape)
    if g.shape != shape:
        try:
            g = g.sum_to_size(shape)
        except RuntimeError:
            raise RuntimeError(f"autograd: a gradient of shape {list(g.shape)} does not fit its input's "
                               f"shape {list(shape)}") from None
    if g.dtype != meta.dtype:
        g = g.to(meta.dtype)
    if g.device != meta.device:
        g = g.to(meta.device)
    return g


def _apply_hooks(hooks, g):
    for hook in list((hooks or {}).values()):
        out = hook(g)
        if out is not None:
            g = out
    return g


def _dense(t: torch.Tensor) -> bool:
    from torch._prims_common import is_non_overlapping_and_dense_or_false

    return is_non_overlapping_and_dense_or_false(t)


def _obeys_layout_contract(g: torch.Tensor, var: torch.Tensor) -> bool:
    """torch's gradient layout contract (``utils::obeys_layout_contract``), for dense tensors."""
    if _dense(var):
        return g.stride() == var.stride() or all(
            n <= 1 or a == b for n, a, b in zip(var.shape, g.stride(), var.stride()))
    return g.is_contiguous()


def _accumulate(var: torch.Tensor, g: torch.Tensor) -> None:
    """``AccumulateGrad::accumulateGrad`` without grad mode: the first gradient is taken as it is
    when its layout obeys the contract (the C++ engine steals its buffer; a Python caller would
    hold a second reference and make it copy), else copied into the parameter's layout; a later
    one is added in place. Then the post-accumulate-grad hooks run."""
    if var.grad is None:
        if not _obeys_layout_contract(g, var):
            g = (g.new_empty_strided(var.shape, var.stride()).copy_(g) if _dense(var)
                 else g.contiguous())
        var.grad = g.detach()
    else:
        var.grad += g
    for hook in list((getattr(var, "_post_accumulate_grad_hooks", None) or {}).values()):
        hook(var)


def _call(node, grads: list):
    if isinstance(node, torch.autograd.function.BackwardCFunction):  # a Python autograd.Function
        if getattr(node, "materialize_grads", True):
            grads = [g if g is not None else torch.zeros(m.shape, dtype=m.dtype, device=m.device)
                     for g, m in zip(grads, node._input_metadata)]
        out = node.apply(*grads)
        out = out if isinstance(out, tuple) else (out,)
        mask = _TENSOR_INPUTS.get(node) if _TENSOR_INPUTS is not None else None
        if mask is not None and len(out) == len(mask):  # drop the non-tensor arguments' (None) gradients
            out = tuple(g for g, is_tensor in zip(out, mask) if is_tensor)
        return out
    out = node(*grads)
    return out if isinstance(out, tuple) else (out,)


def run_backward(t_outputs, grad_tensors, retain_graph=None, create_graph=False, inputs=(),
                 allow_unreachable=True, accumulate_grad=True):
    """``Variable._execution_engine.run_backward``'s contract, in Python (see the module docstring)."""
    if create_graph:
        raise UnsupportedError("building for cuda on a machine without a GPU runs the backward in Python "
                               "(spmd_aot/tracing/python_autograd.py), which does not record higher-order "
                               "gradients (create_graph=True)")
    if inputs and accumulate_grad:
        raise UnsupportedError("building for cuda on a machine without a GPU: backward(inputs=...) is not "
                               "supported by the Python backward (spmd_aot/tracing/python_autograd.py)")
    roots = [_edge(t) for t in t_outputs]
    wanted = [_edge(t) for t in inputs] if not accumulate_grad else []

    deps: dict = {}
    seen, stack = set(), [n for n, _ in roots]
    for n in stack:
        seen.add(n)
    while stack:
        node = stack.pop()
        for nxt, _ in node.next_functions:
            if nxt is None:
                continue
            deps[nxt] = deps.get(nxt, 0) + 1
            if nxt not in seen:
                seen.add(nxt)
                stack.append(nxt)

    with torch.set_grad_enabled(False):  # the C++ engine runs nodes with grad mode = create_graph
        return _execute(roots, grad_tensors, deps, seen, wanted, allow_unreachable, accumulate_grad)


def _execute(roots, grad_tensors, deps, seen, wanted, allow_unreachable, accumulate_grad):
    captured: dict = {}
    buffers: dict = {}

    def add(node, nr, g):
        slot = buffers.setdefault(node, {})
        if g is None:
            return
        slot[nr] = g if slot.get(nr) is None else slot[nr] + g

    for (node, nr), g in zip(roots, grad_tensors):
        add(node, nr, g)
    order = itertools.count()
    ready = []
    for node in dict.fromkeys(n for n, _ in roots):
        if deps.get(node, 0) == 0:
            heapq.heappush(ready, (-node._sequence_nr(), next(order), node))
    while ready:
        _, _, node = heapq.heappop(ready)
        slot = buffers.pop(node, {})
        grads = [slot.get(i) for i in range(len(node._input_metadata))]
        for i in range(len(grads)):
            if (node, i) in wanted:
                captured[(node, i)] = grads[i]
        if type(node).__name__ == "AccumulateGrad":
            if accumulate_grad and grads[0] is not None:
                _accumulate(node.variable, _apply_hooks(getattr(node.variable, "_backward_hooks", None), grads[0]))
            continue
        if _NONLEAF_HOOKS:
            grads = [_apply_hooks(_NONLEAF_HOOKS.get((node, i)), g) if g is not None else g
                     for i, g in enumerate(grads)]
        outputs = _call(node, grads)
        edges = node.next_functions
        if len(outputs) != len(edges):
            raise RuntimeError(f"autograd: {node.name()} returned {len(outputs)} gradients for "
                               f"{len(edges)} inputs")
        for (nxt, nr), g in zip(edges, outputs):
            if nxt is None:
                continue
            if g is not None:
                g = _fit(g, nxt._input_metadata[nr])
            add(nxt, nr, g)
            deps[nxt] -= 1
            if deps[nxt] == 0:
                heapq.heappush(ready, (-nxt._sequence_nr(), next(order), nxt))
    if accumulate_grad:
        return ()
    out = tuple(captured.get(e) for e in wanted)
    if not allow_unreachable and any(g is None for g in out):
        raise RuntimeError("One of the differentiated Tensors appears to not have been used in the graph. "
                           "Set allow_unused=True if this is the desired behavior.")
    return out


@contextlib.contextmanager
def python_backward():
    """While active, every backward runs in ``run_backward`` (see the module docstring)."""
    global _NONLEAF_HOOKS, _TENSOR_INPUTS
    original_run = torch.autograd.graph._engine_run_backward
    original_hook = torch.Tensor.register_hook
    original_apply = torch.autograd.Function.__dict__["apply"]
    previous = _NONLEAF_HOOKS, _TENSOR_INPUTS

    def engine_run_backward(t_outputs, *args, **kwargs):
        return run_backward(t_outputs, *args, **kwargs)

    def register_hook(self, hook):
        handle = original_hook(self, hook)
        if self.grad_fn is not None and _NONLEAF_HOOKS is not None:
            _NONLEAF_HOOKS[(self.grad_fn, self.output_nr)] = self._backward_hooks
        return handle

    def apply(cls, *args, **kwargs):
        # The C++ engine drops the gradients a Function's backward returns for non-tensor
        # arguments; its record of which arguments were tensors is not reachable from Python.
        out = original_apply.__get__(None, cls)(*args, **kwargs)  # a classmethod (2.13) or a C one (2.14)
        mask = tuple(isinstance(a, torch.Tensor) for a in args)
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            fn = getattr(t, "grad_fn", None) if isinstance(t, torch.Tensor) else None
            if isinstance(fn, torch.autograd.function.BackwardCFunction) and _TENSOR_INPUTS is not None:
                _TENSOR_INPUTS[fn] = mask
        return out

    _NONLEAF_HOOKS, _TENSOR_INPUTS = {}, {}
    torch.autograd.graph._engine_run_backward = engine_run_backward
    torch.autograd._engine_run_backward = engine_run_backward
    torch.Tensor.register_hook = register_hook
    torch.autograd.Function.apply = classmethod(apply)
    try:
        yield
    finally:
        torch.autograd.graph._engine_run_backward = original_run
        torch.autograd._engine_run_backward = original_run
        torch.Tensor.register_hook = original_hook
        torch.autograd.Function.apply = original_apply
        _NONLEAF_HOOKS, _TENSOR_INPUTS = previous


@contextlib.contextmanager
def gpu_less_cuda_tracing():
    """What tracing for CUDA needs where torch sees no GPU: the Python backward, and no real
    constants. ``make_fx`` keeps a real copy of every tensor of at most one element made from
    constants (``torch.tensor([], device="cuda")`` in transformers' KV cache) to answer a later
    ``.item()``; making it on CUDA needs a driver ("Found no NVIDIA driver"). Without that copy
    such a read is a data-dependent error at build time, never a wrong value."""
    from torch.fx.experimental import proxy_tensor

    limit = proxy_tensor.CONSTANT_NUMEL_LIMIT
    proxy_tensor.CONSTANT_NUMEL_LIMIT = -1
    try:
        with python_backward():
            yield
    finally:
        proxy_tensor.CONSTANT_NUMEL_LIMIT = limit

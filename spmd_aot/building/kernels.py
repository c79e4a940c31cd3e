"""Compiled kernels in the artifact: the per-rank graph compiled by Inductor at build time.

Why: a loaded step runs op by op through ``program.Program``; Inductor fuses the pointwise ops
of forward, backward and optimizer into a few generated C++ loops. The build compiles the very
graph it stores (decoded back from the graph blob, so kernels and interpreter run the same
graph) with ``torch._inductor.standalone_compile`` and Inductor's C++ wrapper (``cpp_wrapper``).
The graph is first cut into segments (``kernel_segments``: a repeated block is one segment,
compiled once and called per block, so the compile does not grow with depth); each distinct
segment, kernels and the calls between them, becomes one C++ Python extension library. The
``kernels`` blob (``format/kernels_blob.py``) stores the libraries and the calls that run the
step, once ``kernel_library.plain_call`` has shown a bare call of each is its whole segment (no
AOTAutograd or Inductor Python around it); so a job loads them with ``dlopen`` and never imports Inductor
(``runtime/kernel_load.py``). It also records what built it: torch's full release, the C++
compiler, the CPU capability, the options.

Why ``standalone_compile`` and not AOTInductor: AOTInductor compiles an exported forward (or
forward+backward) and cannot hold the optimizer's in-place update; ``standalone_compile`` takes
any ATen graph with input mutations, collectives included (``_c10d_functional`` ops are lowered
and kept with their group name as a string, resolved when they run).

Input mutation: the stored graph updates parameters and optimizer state in place. Plain
``copy_`` into an input is fine (AOTAutograd keeps it as a final write); the fused optimizer
steps (``_fused_adamw_`` ...) have no functionalization rule that accepts graph inputs, so they
are rewritten to their functional form plus ``copy_`` before compiling (``_functional_steps``).

Group names: the graph names mesh dimension ``d`` ``spmd_aot.kernels.d<d>``, and on a mesh of
several dimensions the world group (every rank: the gradient of a parameter kept whole under
HSDP averages over both data-parallel dimensions at once) ``spmd_aot.kernels.world``; on a 1-D mesh the world is
dimension 0. A load registers the live group of each dimension, and the default group, under
those names (``kernel_load``), as the interpreter binds the same stored dimensions to the same
live groups; so one artifact serves every rank and job.

The blob is native code: it loads only from a signed entry or a cache the user trusts
(``kernel_load``). This module only builds it; its format and check as data are
``format/kernels_blob.py``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import operator
import pathlib
import tempfile
import time

import msgpack
import torch

from ..errors import UnsupportedError
from ..format.kernels_blob import ENTRY, INDUCTOR_SETTINGS, KERNELS_FORMAT, WORLD_GROUP, group_name
from . import kernel_collectives, kernel_library, kernel_list_ops, kernel_segments

__all__ = ["kernel_parts", "compile_graph", "KernelsUnavailable"]

log = logging.getLogger(__name__)

class KernelsUnavailable(UnsupportedError):
    """Inductor cannot compile this graph here; the entry is stored with the interpreted graph alone."""


def inductor_settings():
    """``INDUCTOR_SETTINGS`` applied to Inductor's config for a block (the build)."""
    from torch._inductor import config

    return config.patch(INDUCTOR_SETTINGS)


def kernel_parts(blobs: dict[str, bytes], plan, requested: dict) -> tuple[dict[str, bytes], dict]:
    """(parts, stats) to add to the entry of ``blobs``: ``{"kernels": blob}``; or, when Inductor
    cannot compile the graph here, no part and the reason in ``stats["kernels"]`` (logged: the
    entry then runs interpreted)."""
    start = time.perf_counter()
    try:
        data = compile_graph(blobs["graph"], blobs["constants"], blobs["layout"], plan, requested)
    except KernelsUnavailable as exc:
        log.warning("no compiled kernels for %s: %s; the entry holds the interpreted graph alone",
                    plan.describe(), exc)
        return {}, {"kernels": f"none: {exc}"}
    seconds = round(time.perf_counter() - start, 3)
    log.info("compiled kernels for %s in %.1f s (%d bytes)", plan.describe(), seconds, len(data))
    return {"kernels": data}, {"kernels": "compiled", "kernel_seconds": seconds}


def compile_graph(graph: bytes, constants: bytes, layout: bytes, plan, requested: dict) -> bytes:
    """The ``kernels`` blob for one stored graph (``KernelsUnavailable`` when it cannot be had)."""
    from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

    from ..format.fused_meta import registered

    device = torch.device(plan.device_type)
    if device.type != "cpu":
        raise KernelsUnavailable(
            f"stored kernels are CPU kernels: for {device.type}, Inductor's C++ wrapper loads Triton kernels "
            "from files by path, which the kernels blob does not hold (and Inductor's CUDA lowering needs the "
            "GPU at build time)")
    groups = [group_name(d) for d in range(len(plan.mesh_shape))] if plan.world_size > 1 else []
    world = WORLD_GROUP if len(groups) > 1 else None  # 1-D: the world is dimension 0
    gm = compilable_graph(graph, constants, groups, world, device)
    _probe_vector_isa()
    # Inductor's cache pointed at a fresh directory: every kernel is built there (none reused from
    # the user's cache), so all that the compile built can be collected
    with tempfile.TemporaryDirectory(prefix="spmd-aot-inductor-") as cache_dir, temporary_cache_dir(cache_dir), \
            registered(), _build_groups(plan, groups, world), inductor_settings():
        try:
            parts, fake = segmented(gm, layout, device)
        except Exception as exc:  # torch's fake run or the cut: the entry keeps its interpreted graph, as for Inductor's
            raise KernelsUnavailable(f"the graph could not be cut into segments: {type(exc).__name__}: "
                                     f"{str(exc).splitlines()[0][:300] if str(exc) else ''}") from exc
        try:
            libraries = _compile_libraries(parts, pathlib.Path(cache_dir), fake, requested, plan)
        except KernelsUnavailable as exc:
            if len(parts.modules) == 1:
                raise
            # a segment Inductor cannot compile plainly: the whole step as one library, as it compiles
            log.warning("kernels for %s: segmented compile failed (%s); compiling the step whole",
                        plan.describe(), exc)
            parts = kernel_segments.partition(gm, whole=True)
            libraries = _compile_libraries(parts, pathlib.Path(cache_dir), fake, requested, plan)
    doc = {"format": KERNELS_FORMAT, "requested": requested, "groups": groups, "cxx": _compiler(),
           "entry": ENTRY, "inputs": parts.n_inputs, "constants": parts.constants, "libraries": libraries,
           "calls": [[c.library, c.inputs] for c in parts.calls], "outputs": parts.outputs}
    if world is not None:  # only then: blobs of 1-D meshes keep the fields they always had
        doc["world"] = world
    return msgpack.packb(doc, use_bin_type=True)


def compilable_graph(graph: bytes, constants: bytes, groups: list[str], world: str | None,
                     device: torch.device) -> torch.fx.GraphModule:
    """The stored graph decoded (as a load decodes it), with the rewrites Inductor needs: fused
    optimizer steps and in-place collectives functional, collectives callable from C++."""
    from safetensors.torch import load as load_safetensors

    from ..format.serialize import decode_graph, to_fx_graph

    nodes = decode_graph(graph, groups=groups, device=device, world=world or (groups[0] if groups else None))
    root = torch.nn.Module()
    for name, tensor in load_safetensors(constants).items():
        root.register_buffer(name, tensor.to(device))
    gm = torch.fx.GraphModule(root, to_fx_graph(nodes))
    _functional_steps(gm)
    _out_of_place_collectives(gm)
    _shimmable_collectives(gm)
    return gm


def slots_of(layout: bytes) -> list[dict]:
    """The stored layout's input slots (the step's inputs, in order)."""
    from ..format.bounded import unpack as unpack_bounded
    from ..format.limits import load_limits

    return unpack_bounded(layout, "layout", objects=load_limits().objects)["inputs"]


def segmented(gm: torch.fx.GraphModule, layout: bytes, device: torch.device):
    """(``kernel_segments.Partition``, its fake mode): ``gm`` run on fake inputs shaped as the
    layout's slots (every node's ``meta["val"]``), its optimizer's list ops split per block, then
    cut into segments. Collectives need the build's groups bound (``_build_groups``)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    fake = FakeTensorMode(shape_env=ShapeEnv())
    with fake:
        example = [torch.empty(s["local_shape"], dtype=getattr(torch, s["dtype"]), device=device)
                   for s in slots_of(layout)]
    FakeTensorProp(gm, fake).propagate_dont_convert_inputs(*example)
    for node in gm.graph.nodes:  # a constant is a library's input: its example is fake too
        if node.op == "get_attr":
            node.meta["val"] = fake.from_tensor(getattr(gm, node.target))
    kernel_list_ops.split_per_block(gm)
    return kernel_segments.partition(gm), fake


def _compile_libraries(parts, cache_dir: pathlib.Path, fake, requested: dict, plan) -> list[dict]:
    log.info("kernels for %s: %s", plan.describe(), parts.describe())
    libraries = []
    for i, (module, inputs) in enumerate(zip(parts.modules, parts.examples)):
        start = time.perf_counter()
        libraries.append(_compile_library(module, inputs, cache_dir, fake, requested))
        log.info("compiled kernels: library %d of %d (%d nodes, called %d times) in %.1f s", i + 1,
                 len(parts.modules), len(module.graph.nodes), sum(c.library == i for c in parts.calls),
                 time.perf_counter() - start)
    return libraries


def _probe_vector_isa() -> None:
    """Inductor's probes of the CPU's vector instruction sets (small C++ programs it compiles and
    loads, about 7 CPU-s, once per process), run in Inductor's own cache directory, where they
    persist from one build to the next, not in the fresh one each build's libraries are collected
    from. What they find is keyed (``kernels_blob.ingredient``: the CPU capability)."""
    from torch._inductor.cpu_vec_isa import valid_vec_isa_list

    valid_vec_isa_list()


def _compile_library(module: torch.fx.GraphModule, example: list, cache_dir: pathlib.Path, fake,
                     requested: dict) -> dict:
    """One segment compiled into its library: ``{"library": bytes, "inputs": n, "outputs": m,
    "strides": each input's strides, as the library asserts them, "written": the inputs it updates}``."""
    before = {p for p in cache_dir.rglob("*") if p.is_file()}
    try:
        torch._inductor.standalone_compile(
            module, example, dynamic_shapes="from_example_inputs", options=dict(requested["options"]),
            fake_mode=fake)
    except Exception as exc:  # Inductor's own failures: an op it cannot lower, a compiler error
        raise KernelsUnavailable(f"Inductor could not compile the graph: {type(exc).__name__}: "
                                 f"{str(exc).splitlines()[0][:300] if str(exc) else ''}") from exc
    n_inputs = len(example)
    try:
        outputs, written = kernel_library.plain_call(cache_dir, n_inputs, before)
        native = kernel_library.library(cache_dir, before)
    except kernel_library.NotPlain as exc:
        raise KernelsUnavailable(str(exc)) from exc
    return {"library": native, "inputs": n_inputs, "outputs": outputs,
            "strides": [[int(s) for s in t.stride()] for t in example], "written": written}


_OUT_OF_PLACE_COLLECTIVES = {
    torch.ops._c10d_functional.all_reduce_.default: torch.ops._c10d_functional.all_reduce.default,
    torch.ops._c10d_functional.all_reduce_coalesced_.default: torch.ops._c10d_functional.all_reduce_coalesced.default,
}


def _out_of_place_collectives(gm: torch.fx.GraphModule) -> None:
    """In-place collectives (the replicate buckets' ``all_reduce_``) have no functionalization
    rule; their out-of-place twins compute the same result where nothing reads the input (or a
    view of it) after the collective: the graph reads the reduced bucket through ``wait_tensor``."""
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    for node in list(gm.graph.nodes):
        twin = _OUT_OF_PLACE_COLLECTIVES.get(node.target) if node.op == "call_function" else None
        if twin is None:
            continue
        inputs = node.args[0] if isinstance(node.args[0], (list, tuple)) else [node.args[0]]
        for source in inputs:
            late = _read_after(source, order[node], order, skip=node)
            if late is not None:
                raise KernelsUnavailable(f"{node.name} reduces {source.name} in place and {late.name} reads it after")
        node.target = twin
    gm.recompile()


def _read_after(source, position: int, order, skip, depth: int = 0):
    """A node after ``position`` that reads ``source`` or a view of it, or None."""
    for user in source.users:
        if user is skip:
            continue
        if order[user] > position:
            return user
        if depth < 8 and isinstance(user.target, torch._ops.OpOverload) and user.target.is_view:
            late = _read_after(user, position, order, skip, depth + 1)
            if late is not None:
                return late
    return None


def _shimmable_collectives(gm: torch.fx.GraphModule) -> None:
    """All-gathers, reduce-scatters and all-to-alls as ``kernel_collectives``' operators, which the C++ wrapper
    calls through the dispatcher (the functional ones it cannot call: see that module)."""
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in kernel_collectives.REWRITES:
            node.target = kernel_collectives.REWRITES[node.target]
    gm.recompile()


@contextlib.contextmanager
def _build_groups(plan, groups: list[str], world: str | None):
    """While Inductor lowers collectives: each compiled dimension name bound to the build's (fake)
    group of that mesh dimension, and the compiled world name to the build's default group."""
    import torch.distributed as dist
    from torch._C._distributed_c10d import _register_process_group, _unregister_process_group

    from ..parallel.mesh import device_mesh

    if not groups:
        yield
        return
    if not dist.is_initialized():
        raise KernelsUnavailable("collectives are compiled under the build's process group, and none is initialized")
    mesh = device_mesh(plan)
    bound = {name: (mesh.get_group(d) if mesh.ndim > 1 else dist.group.WORLD) for d, name in enumerate(groups)}
    if world is not None:
        bound[world] = dist.group.WORLD
    for name, group in bound.items():
        _register_process_group(name, group)
    try:
        yield
    finally:
        for name in bound:
            _unregister_process_group(name)


_FUNCTIONAL = {torch.ops.aten._fused_adamw_.tensor_lr: (torch.ops.aten._fused_adamw.tensor_lr, (0, 2, 3, 4)),
               torch.ops.aten._fused_adamw_.default: (torch.ops.aten._fused_adamw.default, (0, 2, 3, 4)),
               torch.ops.aten._fused_adam_.tensor_lr: (torch.ops.aten._fused_adam.tensor_lr, (0, 2, 3, 4)),
               torch.ops.aten._fused_adam_.default: (torch.ops.aten._fused_adam.default, (0, 2, 3, 4)),
               torch.ops.aten._fused_sgd_.tensor_lr: (torch.ops.aten._fused_sgd.tensor_lr, (0, 2)),
               torch.ops.aten._fused_sgd_.default: (torch.ops.aten._fused_sgd.default, (0, 2))}


def _functional_steps(gm: torch.fx.GraphModule) -> None:
    """Each in-place fused optimizer step -> pointwise ops (Adam, AdamW: ``_adam_pointwise``,
    which Inductor fuses into one loop per parameter writing it in place) or else its
    functional overload (which clones every list it updates: a copy per tensor per step), then
    ``copy_`` of every updated tensor back into the input it updates (grads are not read after)."""
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in _FUNCTIONAL:
            continue
        if _adam_pointwise(graph, node):
            graph.erase_node(node)
            continue
        functional, written = _FUNCTIONAL[node.target]
        with graph.inserting_before(node):
            call = graph.call_function(functional, node.args, node.kwargs)
            for position in written:
                targets = node.args[position]
                if not targets:
                    continue
                results = graph.call_function(operator.getitem, (call, position))
                for j, target in enumerate(targets):
                    item = graph.call_function(operator.getitem, (results, j))
                    graph.call_function(torch.ops.aten.copy_.default, (target, item))
        graph.erase_node(node)
    graph.lint()
    gm.recompile()


_ADAM = {torch.ops.aten._fused_adamw_.tensor_lr: True, torch.ops.aten._fused_adamw_.default: True,
         torch.ops.aten._fused_adam_.tensor_lr: False, torch.ops.aten._fused_adam_.default: False}


def _adam_pointwise(graph: torch.fx.Graph, node: torch.fx.Node) -> bool:
    """Write fused (W) Adam step ``node`` as the pointwise ops of torch's fused CPU kernel, per
    parameter, before ``node``; False (nothing written) for what it does not cover (amsgrad,
    grad scaling). The scalars the kernel computes in double are tensor ops here: results agree
    to float32 rounding."""
    aten = torch.ops.aten
    if node.target not in _ADAM:
        return False
    params, grads, exp_avgs, exp_avg_sqs, max_sqs, steps = node.args[:6]
    kw = node.kwargs
    if max_sqs or kw.get("amsgrad") or kw.get("grad_scale") is not None or kw.get("found_inf") is not None \
            or len(node.args) != 6:
        return False
    lr, beta1, beta2, wd, eps = kw["lr"], kw["beta1"], kw["beta2"], kw["weight_decay"], kw["eps"]
    op = graph.call_function
    with graph.inserting_before(node):
        for p, g, m, v, step in zip(params, grads, exp_avgs, exp_avg_sqs, steps):
            if kw.get("maximize"):
                g = op(aten.neg.default, (g,))
            new_p = p
            if wd and _ADAM[node.target]:  # AdamW: decoupled decay
                new_p = op(aten.mul.Tensor, (p, op(aten.rsub.Scalar, (op(aten.mul.Tensor, (lr, wd)), 1))))
            elif wd:
                g = op(aten.add.Tensor, (g, p), {"alpha": wd})
            new_m = op(aten.lerp.Scalar, (m, g, 1 - beta1))
            new_v = op(aten.add.Tensor, (op(aten.mul.Tensor, (v, beta2)),
                                         op(aten.mul.Tensor, (op(aten.mul.Tensor, (g, g)), 1 - beta2))))
            bias1 = op(aten.rsub.Scalar, (op(aten.pow.Scalar, (beta1, step)), 1))
            bias2 = op(aten.rsub.Scalar, (op(aten.pow.Scalar, (beta2, step)), 1))
            step_size = op(aten.div.Tensor, (lr, bias1))
            denom = op(aten.add.Tensor, (op(aten.div.Tensor, (op(aten.sqrt.default, (new_v,)),
                                                              op(aten.sqrt.default, (bias2,)))), eps))
            new_p = op(aten.sub.Tensor, (new_p, op(aten.mul.Tensor, (op(aten.div.Tensor, (new_m, denom)),
                                                                      step_size))))
            for target, value in ((p, new_p), (m, new_m), (v, new_v)):
                op(aten.copy_.default, (target, value))
    return True


@functools.cache
def _compiler() -> str:
    """The C++ compiler Inductor used, as its ``--version`` names itself (recorded, not keyed)."""
    import subprocess

    try:
        from torch._inductor.cpp_builder import get_cpp_compiler

        out = subprocess.run([get_cpp_compiler(), "--version"], capture_output=True, text=True, timeout=30)
        return (out.stdout.splitlines() or ["unknown"])[0][:200]
    except Exception as exc:  # recorded for people; never a reason to fail a build
        return f"unknown ({type(exc).__name__})"

"""The cache key: an ordered list of named ingredients, one function each.

In the key: everything that can change the traced graph and is known before tracing: the
artifact format, the torch release, global state that changes the trace (Python version,
default dtype, grad/inference mode, autocast, deterministic algorithms, the backend flags that
choose attention paths, global module and optimizer hooks), spmd-aot's own graph-producing
code (every module of the package but the few listed in ``_NOT_GRAPH_PRODUCING``), the step
and every object it reaches (code, closures, globals, module attributes it reads), the model
classes, a deep fingerprint of every module's attributes and hooks (config objects included,
see ``fingerprint``), parameter/buffer/optimizer-state shapes and dtypes, optimizer class,
hyperparameters (the names of those fed to the step as inputs, ``state.hyperparameter_inputs``,
the values of the others) and hooks, batch structure, world size, mesh, placement,
mixed-precision policy, device type, user transformations.

What only the trace can know (which files' code ran, which real tensors it read) is recorded
while tracing and checked at load (``guards``): a cache hit needs the key *and* the guards.

Left out, on purpose (each would make ranks or machines disagree about one job):
- rank, hostname, pid, wall time, process-group names, device *index*: per process, not per job;
- file paths and module ``__name__`` (``__main__`` vs ``train``): where code lives, not what it is;
- tensor values: parameters are inputs, not constants (real tensors the trace may bake in are
  guarded by value instead);
- torch's local version suffix (``+cpu`` / ``+cu130``): a CPU box builds for CUDA jobs;
- environment variables spmd-aot reads (``ENVIRONMENT_NOT_IN_KEY``): none changes the trace.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import pathlib
import sys
from typing import Any
from collections.abc import Callable, Iterable

import torch
import torch.utils._pytree as pytree

from .fingerprint import Fingerprinter
from ..parallel.plan import Plan
from ..state import TrainState, dtype_name

__all__ = ["CacheKey", "compute_key", "FORMAT_VERSION", "INGREDIENTS", "ENVIRONMENT_NOT_IN_KEY"]

log = logging.getLogger(__name__)

FORMAT_VERSION = 3  # 3: artifact format 3 (signature header, own output-spec format)
_PACKAGE_DIR = pathlib.Path(__file__).parent.parent
# Parts of the package (paths relative to it: a file, or a folder and all below) that never
# decide what graph is stored: they talk to people (messages, hints, the command line), check
# the process, or move bytes. Every other module is hashed, so a new one is in the key by default.
_NOT_GRAPH_PRODUCING = ("__main__.py", "cli", "keying/explain.py", "hints.py", "runtime/device_check.py",
                        "store", "examples")


_LEFT_OUT = frozenset(_NOT_GRAPH_PRODUCING)
_LEFT_OUT_BELOW = tuple(part + "/" for part in _NOT_GRAPH_PRODUCING)


def _graph_producing(rel: str) -> bool:
    """``rel``: a path relative to the package, POSIX form."""
    return rel not in _LEFT_OUT and not rel.startswith(_LEFT_OUT_BELOW)
# Environment variables spmd-aot reads, and why none belongs in the key.
ENVIRONMENT_NOT_IN_KEY = {
    "SPMD_AOT_CACHE_DIR": "where the cache is, not what it holds",
    "SPMD_AOT_LOCAL_CACHE": "where the local copy of a remote cache is",
    "XDG_CACHE_HOME": "where the default cache is",
    "SPMD_AOT_S3_ENDPOINT": "where a remote cache is",
    "AWS_ENDPOINT_URL": "where a remote cache is",
    "SPMD_AOT_SIGNING_KEY": "authenticates manifests (and is a secret); graphs do not depend on it",
    "SPMD_AOT_CRASH_AT": "test-only fault injection in the store",
    "OMP_NUM_THREADS": "set by the quickstart for its ranks: how many threads, not which ops",
    "PYTHONWARNINGS": "the quickstart passes its ranks a filter for torch's no-numpy warning",
    "SPMD_AOT_LOAD_LIMITS": "bounds what a load accepts: it refuses an artifact, never changes one",
    "XDG_STATE_HOME": ("where the per-user records of passed load checks and prepared programs are (verified.py, "
                       "runtime/prepared.py), not what a graph holds"),
    "SPMD_AOT_TRUST_CACHE": "whether a cache others can write is used at all, not what it holds",
    "SPMD_AOT_ALLOW_OPS": "which overloads a build may store and a load accepts: it refuses a graph, never "
                          "changes one (the manifest records the opted-in ops)",
}


@dataclasses.dataclass(frozen=True)
class CacheKey:
    key: str
    ingredients: dict[str, str]  # name -> sha256 of its canonical JSON
    values: dict[str, Any]  # name -> the JSON value itself (kept in the manifest to explain misses)
    # path -> tensor met while fingerprinting (not parameters or buffers): their values are not
    # in the key; a trace records the ones it could have baked in as guards (``guards``).
    tensors: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict, compare=False, repr=False)


def compute_key(step: Callable, state: TrainState, plan: Plan,
                transformations: Iterable[Callable] = (), extra_sources: Iterable[Any] = (),
                kernels: bool = False) -> CacheKey:
    """``kernels``: the entry holds compiled kernels (``kernels.py``); only then is the
    ``kernels`` ingredient (Inductor's release, options, CPU capability) in the key."""
    tensors: dict[str, torch.Tensor] = {}
    inputs = frozenset(id(t) for _, t in state.params + state.buffers)
    values = {name: fn(step=step, state=state, plan=plan, transformations=list(transformations),
                       extra_sources=list(extra_sources), tensors=tensors, inputs=inputs)
              for name, fn in INGREDIENTS}
    if kernels:
        from ..format.kernels_blob import ingredient

        values["kernels"] = ingredient(plan.device_type)
    digests = {name: _digest(value) for name, value in values.items()}
    for name, d in digests.items():
        log.debug("key ingredient %s = %s", name, d)
    key = hashlib.sha256("".join(f"{n}={d}\n" for n, d in digests.items()).encode()).hexdigest()
    return CacheKey(key, digests, values, tensors)


def _digest(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


# ---------------------------------------------------------------------------- ingredients
def format_version(**_) -> int:
    return FORMAT_VERSION


def torch_release(**_) -> str:
    return torch.__version__.split("+")[0]


def global_state(*, state, tensors, inputs, **_) -> dict:
    """Process-wide settings that change what make_fx records.

    A forward-only step is always traced under ``no_grad`` outside inference mode (``trace``),
    so the caller's grad and inference modes cannot change its graph and are not read for it.
    """
    import torch.nn.modules.module as nn_module
    import torch.optim.optimizer as optim_module

    fp = Fingerprinter(tensors, inputs=inputs)
    autocast = {dev: [torch.is_autocast_enabled(dev), dtype_name(torch.get_autocast_dtype(dev))]
                for dev in ("cpu", "cuda")}
    module_hooks = {name: [fp.of(h, f"torch.nn.modules.module.{name}[{i}]")
                           for i, h in enumerate(getattr(nn_module, name).values())]
                    for name in ("_global_forward_pre_hooks", "_global_forward_hooks",
                                 "_global_backward_pre_hooks", "_global_backward_hooks")}
    optimizer_hooks = {name: [fp.of(h, f"torch.optim.optimizer.{name}[{i}]")
                              for i, h in enumerate(getattr(optim_module, name).values())]
                       for name in ("_global_optimizer_pre_hooks", "_global_optimizer_post_hooks")}
    return {
        "python": f"{sys.implementation.name} {sys.version_info.major}.{sys.version_info.minor}",
        "default_dtype": dtype_name(torch.get_default_dtype()),
        "grad_enabled": torch.is_grad_enabled() and not state.forward_only,
        "inference_mode": torch.is_inference_mode_enabled() and not state.forward_only,
        "autocast": autocast,
        "autocast_cache": torch.is_autocast_cache_enabled(),
        "deterministic": [torch.are_deterministic_algorithms_enabled(),
                          torch.is_deterministic_algorithms_warn_only_enabled()],
        # flags that choose between decompositions or attention kernels in the graph
        "backends": {"flash_sdp": torch.backends.cuda.flash_sdp_enabled(),
                     "mem_efficient_sdp": torch.backends.cuda.mem_efficient_sdp_enabled(),
                     "math_sdp": torch.backends.cuda.math_sdp_enabled(),
                     "cudnn_sdp": torch.backends.cuda.cudnn_sdp_enabled(),
                     "cudnn": bool(torch.backends.cudnn.enabled),
                     "cudnn_deterministic": bool(torch.backends.cudnn.deterministic),
                     "mkldnn": bool(torch.backends.mkldnn.enabled),
                     "mha_fastpath": torch.backends.mha.get_fastpath_enabled()},
        "module_hooks": {k: v for k, v in module_hooks.items() if v},
        "optimizer_hooks": {k: v for k, v in optimizer_hooks.items() if v},
    }


def spmd_aot_code(**_) -> str:
    """Every module of the package that can change a stored graph, found by walking it."""
    h = hashlib.sha256()
    for rel, path in _package_sources():
        h.update(rel.encode() + b"\0")
        with open(path, "rb", buffering=0) as f:  # one read of the whole file, no buffer object
            h.update(f.readall())
    from ..format.allowlist import chosen_list  # the op list this release uses (a data file, not *.py)
    h.update(b"format/" + chosen_list().identity())
    return h.hexdigest()


def _package_sources() -> list[tuple[str, str]]:
    """(path relative to the package, in POSIX form; file path) of every graph-producing ``*.py``
    in it (``_graph_producing``), sorted. ``os.walk``, not ``Path.rglob``: this runs on every job
    start and costs half as much; folders left out of the key are not walked at all."""
    out = []
    root = str(_PACKAGE_DIR)
    for folder, subfolders, files in os.walk(root):
        rel = os.path.relpath(folder, root).replace(os.sep, "/")
        prefix = "" if rel == "." else rel + "/"
        subfolders[:] = [d for d in subfolders if d != "__pycache__" and _graph_producing(prefix + d)]
        out.extend((prefix + name, os.path.join(folder, name))
                   for name in files if name.endswith(".py") and _graph_producing(prefix + name))
    return sorted(out)


def step_code(*, step, tensors, inputs, **_) -> dict:
    return Fingerprinter(tensors, inputs=inputs).of(step, "step")


def model_code(*, state, tensors, inputs, **_) -> list:
    """Every model class in full (methods, the globals they read, class attributes)."""
    fp = Fingerprinter(tensors, inputs=inputs)
    classes = {}
    for module in state.model.modules():
        classes.setdefault(id(type(module)), type(module))
    return sorted((fp.of(cls, f"<class {cls.__qualname__}>") for cls in classes.values()),
                  key=lambda c: json.dumps(c, sort_keys=True))


def module_structure(*, state, tensors, inputs, **_) -> list:
    """Per module: FQN, class, train/eval, every attribute (deeply) and its hooks."""
    named = list(state.model.named_modules(remove_duplicate=False))
    fp = Fingerprinter(tensors, {id(m): fqn for fqn, m in reversed(named)}, inputs)
    out = []
    for fqn, module in named:
        path = f"model.{fqn}" if fqn else "model"
        entry = [fqn, type(module).__qualname__, module.training, fp.module_attributes(module, path)]
        hooks = fp.hooks(module, path)
        if hooks:
            entry.append(hooks)
        out.append(entry)
    return out


def parameters(*, state, **_) -> list:
    return [[list(names), list(p.shape), dtype_name(p.dtype), p.requires_grad] for names, p in state.params]


def buffers(*, state, **_) -> list:
    return [[list(names), list(b.shape), dtype_name(b.dtype)] for names, b in state.buffers]


def optimizer(*, state, tensors, inputs, **_) -> dict | None:
    """``None`` for a forward-only step (no optimizer): it is called ``step(model, batch)``."""
    optim = state.optim
    if optim is None:
        return None
    groups = []
    inputs = [sorted({h.name for h in state.hyper_inputs() if h.group == i}) for i in range(len(optim.param_groups))]
    for g, fed in zip(optim.param_groups, inputs):
        # The optimizer's own hyperparameters, less those fed to the step as inputs (their
        # names only: schedulers move them with no rebuild, ``state.hyperparameter_inputs``);
        # keys others add to groups (initial_lr, max_momentum, ...) are not ours.
        hyper = {k: simple if (simple := _simple(g[k])) is not _NOT_SIMPLE else repr(g[k])
                 for k in sorted(optim.defaults) if k in g and k != "params" and k not in fed}
        hyper["inputs"] = fed
        hyper["params"] = [state.param_fqn[id(p)] for p in g["params"]]
        groups.append(hyper)
    fp = Fingerprinter(tensors, inputs=inputs)
    each = getattr(optim, "members", [optim])  # several optimizers: each one's class and hooks
    hooks = [[fp.of(h, f"optimizer.<{kind} hook {i}>") for m in each for i, h in enumerate(table(m).values())]
             for kind, table in (("step_pre", lambda m: m._optimizer_step_pre_hooks),
                                 ("step_post", lambda m: m._optimizer_step_post_hooks))]
    classes = [fp.of(type(m), "<optimizer class>") for m in each]
    out = {"class": classes[0] if len(classes) == 1 and each[0] is optim else classes, "groups": groups,
           "state": state.optimizer_state_structure()}
    if each[0] is not optim:
        out["container"] = optim.structure
        out["group_counts"] = [len(m.param_groups) for m in each]
    if any(hooks):
        out["hooks"] = hooks
    return out


def batch(*, state, **_) -> dict:
    return {"spec": pytree.treespec_dumps(state.batch_spec),
            "leaves": [[list(t.shape), dtype_name(t.dtype)] for t in state.batch_leaves]}


def parallel(*, plan, **_) -> dict:
    # the device and the mixed-precision policy are their own ingredients
    return {k: v for k, v in plan.to_dict().items() if k not in ("device_type", "mixed_precision")}


def mixed_precision(*, plan, **_) -> dict | None:
    """The dtypes of compute, gradient reduction and outputs; None without a policy."""
    return plan.mixed_precision.to_dict() if plan.mixed_precision else None


def device_type(*, plan, **_) -> str:
    return plan.device_type


def transformations(*, transformations, extra_sources, tensors, inputs, **_) -> list:
    fp = Fingerprinter(tensors, inputs=inputs)
    return ([fp.of(t, f"transformations[{i}]") for i, t in enumerate(transformations)]
            + [fp.of(s, f"extra_sources[{i}]") for i, s in enumerate(extra_sources)])


INGREDIENTS: list[tuple[str, Callable[..., Any]]] = [
    ("format_version", format_version),
    ("torch_release", torch_release),
    ("global_state", global_state),
    ("spmd_aot_code", spmd_aot_code),
    ("step_code", step_code),
    ("model_code", model_code),
    ("module_structure", module_structure),
    ("parameters", parameters),
    ("buffers", buffers),
    ("optimizer", optimizer),
    ("batch", batch),
    ("parallel", parallel),
    ("mixed_precision", mixed_precision),
    ("device_type", device_type),
    ("transformations", transformations),
]


# ---------------------------------------------------------------------------- helpers
_NOT_SIMPLE = object()


def _simple(v):
    """JSON form of a plain config value, or ``_NOT_SIMPLE`` (tensors, modules, callables)."""
    if v is None or isinstance(v, (bool, int, str)):
        return v
    if isinstance(v, float):
        return repr(v)  # exact, and JSON has no inf/nan
    if isinstance(v, (tuple, list)):
        items = [_simple(x) for x in v]
        return _NOT_SIMPLE if any(x is _NOT_SIMPLE for x in items) else items
    if isinstance(v, (torch.dtype, torch.device)):
        return str(v) if isinstance(v, torch.dtype) else v.type
    return _NOT_SIMPLE

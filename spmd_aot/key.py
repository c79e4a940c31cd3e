"""The cache key: an ordered list of named ingredients, one function each.

In the key: everything that changes the traced graph (code of the step, the model classes and
the optimizer, module structure and attributes, parameter/buffer/optimizer-state shapes and
dtypes, optimizer hyperparameters, batch structure, world size, mesh, placement, device type,
torch release, artifact format, spmd-aot's own graph-producing code, user transformations).

Left out, on purpose (each would make ranks or machines disagree about one job):
- rank, hostname, pid, wall time, process-group names, device *index*: per process, not per job;
- file paths and module ``__name__`` (``__main__`` vs ``train``): where code lives, not what it is;
- tensor values: parameters are inputs, not constants;
- torch's local version suffix (``+cpu`` / ``+cu130``): a CPU box builds for CUDA jobs.

Source code is hashed per *file* (the whole file defining the step, each model class and a
custom optimizer), so an edit to a helper in the same file changes the key too. Code in other
files that the model calls is not hashed: list such functions in ``extra_sources``.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import inspect
import json
import logging
import pathlib
from typing import Any, Callable, Iterable

import torch
import torch.utils._pytree as pytree

from .plan import Plan
from .state import TrainState, dtype_name, lr_is_input

__all__ = ["CacheKey", "compute_key", "FORMAT_VERSION", "INGREDIENTS"]

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
_PACKAGE_DIR = pathlib.Path(__file__).parent
# spmd-aot's own modules whose code decides what graph gets stored.
_GRAPH_PRODUCING_MODULES = ("trace.py", "expand.py", "state.py", "serialize.py", "passes", "override.py",
                            "pipeline.py", "sharding.py", "groups.py", "memory.py")


@dataclasses.dataclass(frozen=True)
class CacheKey:
    key: str
    ingredients: dict[str, str]  # name -> sha256 of its canonical JSON
    values: dict[str, Any]  # name -> the JSON value itself (kept in the manifest to explain misses)


def compute_key(step: Callable, state: TrainState, plan: Plan,
                transformations: Iterable[Callable] = (), extra_sources: Iterable[Any] = ()) -> CacheKey:
    values = {name: fn(step=step, state=state, plan=plan, transformations=list(transformations),
                       extra_sources=list(extra_sources))
              for name, fn in INGREDIENTS}
    digests = {name: _digest(value) for name, value in values.items()}
    for name, d in digests.items():
        log.debug("key ingredient %s = %s", name, d)
    key = hashlib.sha256("".join(f"{n}={d}\n" for n, d in digests.items()).encode()).hexdigest()
    return CacheKey(key, digests, values)


def _digest(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


# ---------------------------------------------------------------------------- ingredients
def format_version(**_) -> int:
    return FORMAT_VERSION


def torch_release(**_) -> str:
    return torch.__version__.split("+")[0]


def spmd_aot_code(**_) -> str:
    h = hashlib.sha256()
    for name in _GRAPH_PRODUCING_MODULES:
        path = _PACKAGE_DIR / name
        for f in sorted(path.rglob("*.py")) if path.is_dir() else [path]:
            h.update(f.relative_to(_PACKAGE_DIR).as_posix().encode())
            h.update(f.read_bytes())
    return h.hexdigest()


def step_code(*, step, **_) -> dict:
    return code_identity(step)


def model_code(*, state, **_) -> list:
    classes = {}
    for module in state.model.modules():
        for cls in type(module).__mro__:
            if cls is torch.nn.Module or cls is object:
                break
            classes.setdefault(f"{cls.__module__}.{cls.__qualname__}", cls)
    return sorted((code_identity(cls) for cls in classes.values()), key=lambda c: json.dumps(c, sort_keys=True))


def module_structure(*, state, **_) -> list:
    out = []
    for fqn, module in state.model.named_modules(remove_duplicate=False):
        attrs = {k: simple for k, v in sorted(vars(module).items())
                 if not k.startswith("_") and k != "training" and (simple := _simple(v)) is not _NOT_SIMPLE}
        out.append([fqn, type(module).__qualname__, module.training, attrs])
    return out


def parameters(*, state, **_) -> list:
    return [[list(names), list(p.shape), dtype_name(p.dtype), p.requires_grad] for names, p in state.params]


def buffers(*, state, **_) -> list:
    return [[list(names), list(b.shape), dtype_name(b.dtype)] for names, b in state.buffers]


def optimizer(*, state, **_) -> dict:
    optim = state.optim
    groups = []
    for g in optim.param_groups:
        # The optimizer's own hyperparameters, less the learning rate (a graph input, so
        # schedulers need no rebuild); keys others add to groups (initial_lr, ...) are not ours.
        hyper = {k: simple if (simple := _simple(g[k])) is not _NOT_SIMPLE else repr(g[k])
                 for k in sorted(optim.defaults) if k in g and k not in ("params", "lr")}
        hyper["lr_is_input"] = lr_is_input(g.get("lr"))
        hyper["params"] = [state.param_fqn[id(p)] for p in g["params"]]
        groups.append(hyper)
    return {"class": code_identity(type(optim)), "groups": groups, "state": state.optimizer_state_structure()}


def batch(*, state, **_) -> dict:
    return {"spec": pytree.treespec_dumps(state.batch_spec),
            "leaves": [[list(t.shape), dtype_name(t.dtype)] for t in state.batch_leaves]}


def parallel(*, plan, **_) -> dict:
    return {k: v for k, v in plan.to_dict().items() if k != "device_type"}  # device: its own ingredient


def device_type(*, plan, **_) -> str:
    return plan.device_type


def transformations(*, transformations, extra_sources, **_) -> list:
    return [code_identity(t) for t in transformations] + [code_identity(s) for s in extra_sources]


INGREDIENTS: list[tuple[str, Callable[..., Any]]] = [
    ("format_version", format_version),
    ("torch_release", torch_release),
    ("spmd_aot_code", spmd_aot_code),
    ("step_code", step_code),
    ("model_code", model_code),
    ("module_structure", module_structure),
    ("parameters", parameters),
    ("buffers", buffers),
    ("optimizer", optimizer),
    ("batch", batch),
    ("parallel", parallel),
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


def code_identity(obj) -> dict:
    """What a piece of user code is: qualified name, defining file's hash, and its own code.

    The file hash catches edits to helpers beside it; the object's own bytecode (and a
    function's defaults and closure values) tells apart two lambdas or closures from one file,
    and covers code with no source file (a REPL, ``python -c``, a notebook). Classes and
    functions from torch itself are identified by name only: the torch release is its own
    ingredient.
    """
    obj = inspect.unwrap(obj) if callable(obj) else obj
    if isinstance(obj, functools.partial):
        return {"partial": code_identity(obj.func), "args": _values(obj.args),
                "kwargs": _values(sorted(obj.keywords.items()))}
    if not isinstance(obj, type) and not inspect.isroutine(obj):  # a callable instance
        return {"instance": code_identity(type(obj)), "state": _values(sorted(vars(obj).items()))
                if hasattr(obj, "__dict__") else repr(obj)}
    qualname = getattr(obj, "__qualname__", type(obj).__qualname__)
    module = getattr(obj, "__module__", "") or ""
    if module == "torch" or module.startswith("torch."):
        return {"name": f"{module}.{qualname}"}
    return {"name": qualname, "file": _file_digest(obj), "code": _own_code_digest(obj)}


def _file_digest(obj) -> str | None:
    try:
        path = inspect.getsourcefile(obj)
    except TypeError:
        return None
    if path and pathlib.Path(path).is_file():
        return hashlib.sha256(pathlib.Path(path).read_bytes()).hexdigest()
    return None


def _own_code_digest(obj) -> str:
    """Source text when there is a file (stable across Python versions), else bytecode."""
    h = hashlib.sha256()
    try:
        h.update(inspect.getsource(obj).encode())
        has_source = True
    except (OSError, TypeError):
        has_source = False
    if isinstance(obj, type):
        if not has_source:
            for name, attr in sorted(vars(obj).items()):
                fn = attr.__func__ if isinstance(attr, (staticmethod, classmethod)) else attr
                fn = fn.fget if isinstance(fn, property) else fn
                h.update(name.encode())
                if hasattr(fn, "__code__"):
                    h.update(_code_bytes(fn.__code__))
                elif _simple(fn) is not _NOT_SIMPLE:
                    h.update(repr(_simple(fn)).encode())
    elif hasattr(obj, "__code__"):
        # names and constants tell apart two lambdas that share a source line
        h.update(_code_bytes(obj.__code__, with_bytecode=not has_source))
        h.update(_values(obj.__defaults__ or ()).encode())
        cells = [c.cell_contents for c in (obj.__closure__ or ()) if _cell_filled(c)]
        h.update(_values(cells).encode())
    return h.hexdigest()


def _cell_filled(cell) -> bool:
    try:
        cell.cell_contents
    except ValueError:
        return False
    return True


def _values(items) -> str:
    """A stable text for captured values: plain ones by value, code by identity, else type."""
    def one(v):
        if (simple := _simple(v)) is not _NOT_SIMPLE:
            return simple
        if isinstance(v, (tuple, list)):
            return [one(x) for x in v]
        if inspect.isroutine(v) or isinstance(v, (type, functools.partial)):
            return code_identity(v)
        return f"<{type(v).__qualname__}>"
    return json.dumps([one(v) for v in items], sort_keys=True, default=str)


def _code_bytes(code, with_bytecode: bool = True) -> bytes:
    parts = [code.co_code if with_bytecode else b"", repr(code.co_names).encode()]
    for const in code.co_consts:
        parts.append(_code_bytes(const, with_bytecode) if inspect.iscode(const) else repr(const).encode())
    return b"\0".join(parts)

"""Deep fingerprints of live Python objects: what a model, a step or a hook *is*, as JSON.

The cache key must change whenever anything the trace reads changes. Forward reads config
objects, closures and module globals as freely as plain attributes, so a fingerprint follows
every reference it can reach: instance ``__dict__`` and ``__slots__``, containers, functions
(code, defaults, closure values and the globals and module attributes their code loads),
bound methods and classes. What it cannot describe stops the key with an error naming the
path and the escape hatch (``register_fingerprint``): a key that silently skipped it could
serve a wrong graph.

Where an object lives decides how deep it goes:
- torch, the standard library and builtins: by qualified name (the torch release and the
  Python version are key ingredients);
- installed distributions: by qualified name (the files that ran while tracing, with the
  distribution's version, are guarded at load; see ``guards``);
- everything else (the user's code, ``spmd_aot.examples``): in full.

Never hashed: tensor values (a tensor is its shape, dtype, device type and ``requires_grad``;
real ones are collected in ``tensors`` so a trace can guard the values it baked in), device
indices, paths and module names (``__main__`` vs ``train``), hook ids.
"""

from __future__ import annotations

import dataclasses
import dis
import enum
import functools
import hashlib
import inspect
import logging
import os
import pathlib
import re
import sys
import types
import weakref
from typing import Any
from collections.abc import Callable

import torch

from ..errors import UnsupportedError

__all__ = ["Fingerprinter", "register_fingerprint", "origin", "file_digest"]

_CUSTOM: dict[type, Callable[[Any], Any]] = {}
_MAX_DEPTH = 60


def register_fingerprint(cls: type, fn: Callable[[Any], Any]) -> None:
    """Describe instances of ``cls`` (and subclasses) for the cache key as ``fn(obj)``.

    ``fn`` returns what the trace can depend on (anything this module can fingerprint: numbers,
    strings, tuples, ...), or ``None`` when nothing about the object changes the traced graph.
    Register it where the class is defined, so the build and the job both see it.
    """
    if not isinstance(cls, type) or not callable(fn):
        raise TypeError("register_fingerprint(cls, fn) takes a class and a callable")
    _CUSTOM[cls] = fn


# ---------------------------------------------------------------------------- where code lives
_TORCH_PACKAGES = ("torch", "torchgen", "functorch")


@functools.cache
def _site_dirs() -> tuple[str, ...]:
    import site
    import sysconfig

    dirs = {sysconfig.get_paths()[k] for k in ("purelib", "platlib")}
    dirs.update(getattr(site, "getsitepackages", lambda: [])())
    return tuple(sorted(str(pathlib.Path(d).resolve()) + "/" for d in dirs if d))


def is_installed_path(path: str) -> bool:
    """A file inside site-packages (or dist-packages) of this interpreter."""
    return path.startswith(_site_dirs()) or "/site-packages/" in path or "/dist-packages/" in path


@functools.lru_cache(maxsize=4096)
def origin(module_name: str | None) -> str:
    """``"torch"``, ``"stdlib"``, ``"spmd_aot"``, ``"installed"`` or ``"user"`` for a module name."""
    name = module_name or ""
    top = name.split(".")[0]
    if top in _TORCH_PACKAGES:
        return "torch"
    if top == "spmd_aot" and not name.startswith("spmd_aot.examples"):
        return "spmd_aot"  # the spmd_aot_code ingredient
    if top in sys.stdlib_module_names or top == "builtins" or not top:
        return "stdlib" if top else "user"
    module = sys.modules.get(name) or sys.modules.get(top)
    path = getattr(module, "__file__", None)
    if path and is_installed_path(str(pathlib.Path(path).resolve())):
        return "installed"
    return "user"


_DIGESTS: dict[str, tuple[tuple, str]] = {}


def file_digest(path: str | None) -> str | None:
    """sha256 of a source file's bytes (None for code without a file: a REPL, ``exec``),
    re-read only when its inode, size, mtime or ctime moved (an edit always moves ctime)."""
    if not path or path.startswith("<"):
        return None
    try:
        st = os.stat(path)
    except OSError:
        return None
    stamp = (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    cached = _DIGESTS.get(path)
    if cached is not None and cached[0] == stamp:
        return cached[1]
    try:
        with open(path, "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()
    except OSError:
        return None
    _DIGESTS[path] = (stamp, digest)
    return digest


# ---------------------------------------------------------------------------- code objects
_CODE_MEMO: dict[types.CodeType, tuple[str, tuple, tuple]] = {}


def _code_facts(code: types.CodeType) -> tuple[str, tuple, tuple]:
    """(digest of the bytecode and constants, global names loaded, (global, attribute chain)
    pairs: ``pkg.config.WINDOW`` is ``("pkg", ("config", "WINDOW"))``).

    Bytecode rather than source text: it covers code without a file, and the Python version
    (which changes bytecode) is in the key anyway. Line numbers are left out.
    """
    facts = _CODE_MEMO.get(code)
    if facts is not None:
        return facts
    h = hashlib.sha256()
    for part in (code.co_code, repr(code.co_names), repr(code.co_varnames), repr(code.co_freevars),
                 repr(code.co_cellvars), repr((code.co_argcount, code.co_posonlyargcount,
                                               code.co_kwonlyargcount, code.co_flags))):
        h.update(part if isinstance(part, bytes) else part.encode())
        h.update(b"\0")
    names, pairs = set(), set()
    chain: list | None = None  # [global, attr, attr, ...] while LOAD_ATTRs follow a global
    for ins in dis.get_instructions(code):
        if ins.opname in ("LOAD_ATTR", "LOAD_METHOD") and chain is not None:
            chain.append(ins.argval)
            continue
        if chain is not None and len(chain) > 1:
            pairs.add((chain[0], tuple(chain[1:])))
        chain = None
        if ins.opname in ("LOAD_GLOBAL", "LOAD_NAME"):
            names.add(ins.argval)
            chain = [ins.argval]
    if chain is not None and len(chain) > 1:
        pairs.add((chain[0], tuple(chain[1:])))
    for const in code.co_consts:
        h.update(_const_text(const).encode())
        h.update(b"\0")
        if inspect.iscode(const):
            _, inner_names, inner_pairs = _code_facts(const)
            names.update(inner_names)
            pairs.update(inner_pairs)
    facts = (h.hexdigest(), tuple(sorted(names)), tuple(sorted(pairs)))
    _CODE_MEMO[code] = facts
    return facts


def _const_text(c) -> str:
    if inspect.iscode(c):
        return "code:" + _code_facts(c)[0]
    if isinstance(c, tuple):
        return "(" + ",".join(_const_text(x) for x in c) + ")"
    if isinstance(c, frozenset):  # its repr's order depends on PYTHONHASHSEED
        return "frozenset(" + ",".join(sorted(_const_text(x) for x in c)) + ")"
    return f"{type(c).__name__}:{c!r}"


# ---------------------------------------------------------------------------- the walker
_DESCRIPTORS = (types.MethodDescriptorType, types.WrapperDescriptorType, types.MethodWrapperType,
                types.ClassMethodDescriptorType, types.GetSetDescriptorType,
                types.MemberDescriptorType)
# Class attributes that are bookkeeping, not behaviour (names, docs, caches of the class's own
# fields, abc's C-level registry); module globals that name a place, not a value.
_CLASS_SKIP = frozenset({"__module__", "__dict__", "__weakref__", "__doc__", "__qualname__",
                         "__annotations__", "__dataclass_fields__", "__dataclass_params__",
                         "__match_args__", "__orig_bases__", "__parameters__",
                         "__abstractmethods__", "_abc_impl", "__firstlineno__",
                         "__static_attributes__", "__slotnames__"})
_GLOBAL_SKIP = frozenset({"__file__", "__name__", "__spec__", "__loader__", "__package__",
                          "__cached__", "__builtins__", "__path__", "__doc__"})


class Fingerprinter:
    """One walk: objects met twice (shared or cyclic) become ``{"ref": first path}``."""

    def __init__(self, tensors: dict[str, torch.Tensor] | None = None,
                 model_modules: dict[int, str] | None = None, inputs: frozenset = frozenset()):
        self.tensors = tensors if tensors is not None else {}
        self.inputs = inputs  # ids of parameters and buffers: graph inputs, never constants
        self.model_modules = model_modules or {}
        self._seen: dict[int, str] = {}
        self._alive: list = []  # keeps walked objects alive so their ids stay unique
        self._files: dict[str, str | None] = {}

    # ------------------------------------------------------------------ entry points
    def of(self, v, path: str, depth: int = 0):
        if v is None or type(v) in (bool, str, int):
            return v
        if depth > _MAX_DEPTH:
            self._refuse(v, path, f"nesting deeper than {_MAX_DEPTH} levels")
        if isinstance(v, enum.Enum):
            return {"enum": f"{type(v).__qualname__}.{v.name}"}
        if isinstance(v, str):
            return {"str": str(v), "type": type(v).__qualname__}
        if isinstance(v, float):
            return {"float": repr(v)}  # exact, and JSON has no inf/nan
        if isinstance(v, int):
            return {"int": int(v), "type": type(v).__qualname__}
        if isinstance(v, (complex, bytes, bytearray)):
            return {type(v).__name__: repr(v) if isinstance(v, complex) else hashlib.sha256(v).hexdigest()}
        if isinstance(v, torch.dtype):
            return {"dtype": str(v).removeprefix("torch.")}
        if isinstance(v, torch.device):
            return {"device": v.type}  # the index is per rank, not per job
        if isinstance(v, torch.Size):
            return {"size": list(v)}
        if isinstance(v, (torch.layout, torch.memory_format, torch.qscheme)):
            return {"torch": str(v)}
        if isinstance(v, torch.Tensor):
            return self._tensor(v, path)
        if isinstance(v, types.ModuleType):
            return {"pymodule": v.__name__}
        if isinstance(v, pathlib.PurePath):
            return {"path": None}  # where a file is, not what it holds
        custom = next((fn for cls in type(v).__mro__ if (fn := _CUSTOM.get(cls)) is not None), None)
        if custom is not None:
            described = custom(v)
            return {"custom": type(v).__qualname__,
                    "value": None if described is None else self.of(described, path, depth + 1)}
        if type(v) in (tuple, frozenset):  # immutable: described by value, whoever shares it
            return self._compound(v, path, depth + 1)  # (a cycle needs a mutable object, met below)
        if id(v) in self._seen:
            return {"ref": self._seen[id(v)]}
        self._seen[id(v)] = path
        self._alive.append(v)
        return self._compound(v, path, depth + 1)

    def module_attributes(self, module: torch.nn.Module, path: str) -> dict:
        """Every attribute in ``module.__dict__`` apart from torch's own bookkeeping."""
        self._seen.setdefault(id(module), path)
        self._alive.append(module)
        return {name: self.of(value, f"{path}.{name}", 1)
                for name, value in sorted(module.__dict__.items()) if name not in _MODULE_BOOKKEEPING}

    def hooks(self, module: torch.nn.Module, path: str) -> dict:
        """Forward and backward hooks in registration order (their ids are per process)."""
        m = module
        out = {}
        for name, table, flags in (
                ("forward_pre", m._forward_pre_hooks, (m._forward_pre_hooks_with_kwargs,)),
                ("forward", m._forward_hooks, (m._forward_hooks_with_kwargs,
                                               getattr(m, "_forward_hooks_always_called", {}))),
                ("backward_pre", m._backward_pre_hooks, ()),
                ("backward", m._backward_hooks, ())):
            if table:
                out[name] = [[self.of(h, f"{path}.<{name} hook {i}>", 1)] + [hid in f for f in flags]
                             for i, (hid, h) in enumerate(table.items())]
        if out and m._is_full_backward_hook is not None:
            out["full_backward"] = bool(m._is_full_backward_hook)
        return out

    # ------------------------------------------------------------------ kinds
    def _tensor(self, t: torch.Tensor, path: str) -> dict:
        """Shape, dtype, device type, requires_grad; the same for a fake, a real and (at job
        start, sharded) a DTensor parameter. Tensors that may be baked in as constants (not
        parameters or buffers, not our DTensors) are collected for value guards."""
        if id(t) not in self.inputs and not hasattr(t, "to_local"):
            self.tensors.setdefault(path, t)
        return {"tensor": list(t.shape), "dtype": str(t.dtype).removeprefix("torch."),
                "device": t.device.type, "requires_grad": bool(t.requires_grad)}

    def _module(self, v: torch.nn.Module, path: str, depth: int) -> dict:
        """A module outside the model (one the step or a config holds) is described whole."""
        if id(v) in self.model_modules:
            return {"module": self.model_modules[id(v)]}
        return {"nn.Module": self.of(type(v), f"{path}.<class>", depth),
                "training": v.training, "attrs": self.module_attributes(v, path),
                "parameters": {k: self.of(p, f"{path}.{k}", depth) for k, p in v._parameters.items()},
                "buffers": {k: self.of(b, f"{path}.{k}", depth) for k, b in v._buffers.items()},
                "children": {k: self.of(c, f"{path}.{k}", depth) for k, c in v._modules.items()},
                "hooks": self.hooks(v, path)}

    def _mapping(self, v: dict, path: str, depth: int) -> dict:
        """A dict, in insertion order (order can change a trace); a subclass names its type."""
        out = {"dict": [[self.of(k, f"{path}.<key>", depth), self.of(x, f"{path}[{k!r}]", depth)]
                        for k, x in v.items()]}
        if type(v) is not dict:
            out["type"] = type(v).__qualname__
            if getattr(v, "default_factory", None) is not None:
                out["default_factory"] = self.of(v.default_factory, f"{path}.default_factory", depth)
        return out

    def _compound(self, v, path: str, depth: int):
        if isinstance(v, torch.nn.Module):
            return self._module(v, path, depth)
        if isinstance(v, (list, tuple)):
            items = [self.of(x, f"{path}[{i}]", depth) for i, x in enumerate(v)]
            if type(v) in (list, tuple):
                return items if type(v) is list else {"tuple": items}
            return {"sequence": type(v).__qualname__, "items": items,
                    "attrs": self._instance_state(v, path, depth)}
        if isinstance(v, dict):
            return self._mapping(v, path, depth)
        if isinstance(v, (set, frozenset)):
            import json

            items = [self.of(x, f"{path}.<item>", depth) for x in v]
            return {"set": sorted(items, key=lambda x: json.dumps(x, sort_keys=True, default=str))}
        if isinstance(v, type):
            return self._class(v, path, depth)
        if isinstance(v, (staticmethod, classmethod)):
            return {type(v).__name__: self.of(v.__func__, path, depth)}
        if isinstance(v, property):
            return {"property": [self.of(f, f"{path}.{n}", depth)
                                 for n, f in (("fget", v.fget), ("fset", v.fset), ("fdel", v.fdel))]}
        if isinstance(v, functools.cached_property):
            return {"cached_property": self.of(v.func, path, depth)}
        if isinstance(v, functools.partial):
            return {"partial": self.of(v.func, f"{path}.func", depth),
                    "args": self.of(list(v.args), f"{path}.args", depth),
                    "kwargs": self.of(dict(v.keywords), f"{path}.keywords", depth)}
        if isinstance(v, types.MethodType):
            return {"method": self.of(v.__func__, f"{path}.__func__", depth),
                    "self": self.of(v.__self__, f"{path}.__self__", depth)}
        if isinstance(v, types.FunctionType):
            return self._function(v, path, depth)
        if isinstance(v, types.BuiltinFunctionType):
            owner = v.__self__
            out = {"builtin": f"{getattr(v, '__module__', None) or ''}.{v.__qualname__}"}
            if owner is not None and not isinstance(owner, types.ModuleType):
                out["self"] = self.of(owner, f"{path}.__self__", depth)
            return out
        if isinstance(v, _DESCRIPTORS):
            owner = getattr(v, "__objclass__", type(getattr(v, "__self__", None)))
            return {"builtin": f"{owner.__module__}.{owner.__qualname__}.{v.__name__}"}
        if isinstance(v, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
            return {"op": str(v)}
        if hasattr(v, "__wrapped__") and not hasattr(v, "__dict__") or type(v).__name__ == "_lru_cache_wrapper":
            return {"wrapper": type(v).__qualname__, "wrapped": self.of(v.__wrapped__, f"{path}.__wrapped__", depth)}
        if isinstance(v, weakref.ref):
            # a tensor behind a weakref is a cache of state keyed elsewhere (``nn.LSTM``'s
            # ``_flat_weight_refs`` point at its parameters, and die when they are swapped for
            # sharded ones at a job's first call): whether it is alive is no ingredient
            target = v()
            return {"weakref": None if target is None or isinstance(target, torch.Tensor)
                    else self.of(target, f"{path}()", depth)}
        if isinstance(v, logging.Logger):
            return {"logger": v.name}
        if isinstance(v, re.Pattern):
            return {"regex": v.pattern if isinstance(v.pattern, str) else repr(v.pattern), "flags": v.flags}
        if isinstance(v, torch.Generator):
            return {"generator": v.device.type}
        if type(v).__module__ in ("typing", "typing_extensions") or isinstance(v, types.GenericAlias):
            return {"typing": repr(v)}
        if type(v) is object:
            return {"object": None}  # a sentinel: identity only
        if isinstance(v, range):
            return {"range": [v.start, v.stop, v.step]}
        if isinstance(v, slice):
            return {"slice": [self.of(x, path, depth) for x in (v.start, v.stop, v.step)]}
        if origin(type(v).__module__) == "spmd_aot":
            return {"spmd_aot": type(v).__qualname__}  # e.g. a CompiledStep the step's module holds
        if hasattr(v, "__dict__") or _slot_names(type(v)):
            return {"object": self.of(type(v), f"{path}.<class>", depth),
                    "attrs": self._instance_state(v, path, depth)}
        self._refuse(v, path)

    def _instance_state(self, v, path: str, depth: int) -> dict:
        skip = _derived_attributes(type(v))
        state = {}
        if dataclasses.is_dataclass(v):
            for f in dataclasses.fields(v):
                state[f.name] = self.of(getattr(v, f.name, None), f"{path}.{f.name}", depth)
        for name, value in sorted(getattr(v, "__dict__", {}).items()):
            if name not in state and name not in skip:
                state[name] = self.of(value, f"{path}.{name}", depth)
        for name in _slot_names(type(v)):
            if name not in state:
                try:
                    value = getattr(v, name)
                except AttributeError:
                    state[name] = {"unset": True}
                    continue
                state[name] = self.of(value, f"{path}.{name}", depth)
        return state

    def _class(self, cls: type, path: str, depth: int) -> dict:
        where = origin(cls.__module__)
        if where != "user":
            return {"class": f"{cls.__module__}.{cls.__qualname__}"}
        attrs = {}
        for name, attr in vars(cls).items():
            if name in _CLASS_SKIP:
                continue
            attrs[name] = self.of(attr, f"{path}.{name}", depth)
        return {"name": cls.__qualname__, "file": self._file_of(cls),
                "bases": [self.of(b, f"{path}.<base {i}>", depth) for i, b in enumerate(cls.__bases__)],
                "code": attrs}

    def _function(self, fn: types.FunctionType, path: str, depth: int) -> dict:
        where = origin(fn.__module__)
        if where != "user":
            return {"function": f"{fn.__module__}.{fn.__qualname__}"}
        code = fn.__code__
        digest, global_names, attr_pairs = _code_facts(code)
        out = {"name": fn.__qualname__, "file": self._file(code.co_filename), "code": digest}
        if fn.__defaults__:
            out["defaults"] = self.of(list(fn.__defaults__), f"{path}.__defaults__", depth)
        if fn.__kwdefaults__:
            out["kwdefaults"] = self.of(dict(fn.__kwdefaults__), f"{path}.__kwdefaults__", depth)
        if fn.__closure__:
            out["closure"] = {name: self._cell(cell, f"{path}.<closure>.{name}", depth)
                              for name, cell in zip(code.co_freevars, fn.__closure__)}
        g = fn.__globals__
        globs = {}
        for name in global_names:
            if name in _GLOBAL_SKIP or name not in g:
                continue  # a builtin, or not defined yet
            value = g[name]
            where_path = f"{path}.<globals>.{name}"
            if isinstance(value, types.ModuleType):
                globs[name] = self._pymodule(value, g, [a for n, a in attr_pairs if n == name], where_path, depth)
            else:
                globs[name] = self.of(value, where_path, depth)
        if globs:
            out["globals"] = globs
        return out

    def _pymodule(self, module, own_globals, attrs, path: str, depth: int) -> dict:
        """A module named by a global: its name (``<own>`` for the function's own module, whose
        name differs between ``__main__`` and an import), and for user modules the attributes
        the code reads from it (``helpers.scale``, ``config.WINDOW``)."""
        name = "<own>" if module.__dict__ is own_globals else module.__name__
        out = {"pymodule": name}
        read = {}
        for chain in attrs:  # follow user modules down the chain; describe what it reaches
            value, where = module, path
            for attr in chain:
                if not (isinstance(value, types.ModuleType) and origin(value.__name__) == "user") \
                        or attr in _GLOBAL_SKIP or not hasattr(value, attr):
                    break
                value, where = getattr(value, attr), f"{where}.{attr}"
            if value is not module:
                read[where[len(path) + 1:]] = self.of(value, where, depth)
        if read:
            out["attrs"] = read
        return out

    def _cell(self, cell, path: str, depth: int):
        try:
            value = cell.cell_contents
        except ValueError:
            return {"empty_cell": True}
        return self.of(value, path, depth)

    def _file_of(self, cls: type):
        module = sys.modules.get(cls.__module__)
        return self._file(getattr(module, "__file__", None))

    def _file(self, path: str | None):
        if path not in self._files:
            self._files[path] = file_digest(path)
        return self._files[path]

    def _refuse(self, v, path: str, why: str | None = None):
        cls = type(v)
        raise UnsupportedError(
            f"{path}: cannot fingerprint {cls.__module__}.{cls.__qualname__}"
            + (f" ({why})" if why else "") + ": the cache key must describe everything the trace "
            f"can read. Describe it with spmd_aot.register_fingerprint({cls.__qualname__}, fn), "
            "where fn(obj) returns the values the step depends on (or None if none), at import "
            "time of the module that defines the model, so the build and the job both see it"
        )


# Attributes that hold a digest of their object's other attributes, which are in the key
# themselves: hashing them again adds nothing, and some are process-random. Each entry:
# (module, class qualname) -> attribute names, with the reason. Any class in the MRO matches.
_DERIVED_ATTRIBUTES: dict[tuple[str, str], frozenset] = {
    # hash() of the config's JSON text: PYTHONHASHSEED makes it differ between processes, so it
    # made every transformers model's key differ between ranks and between build and job.
    ("transformers.generation.configuration_utils", "GenerationConfig"): frozenset({"_original_object_hash"}),
}


@functools.lru_cache(maxsize=1024)
def _derived_attributes(cls: type) -> frozenset:
    names = frozenset()
    for klass in cls.__mro__:
        names |= _DERIVED_ATTRIBUTES.get((klass.__module__, klass.__qualname__), frozenset())
    return names


def _slot_names(cls: type) -> list[str]:
    names = []
    for klass in cls.__mro__:
        slots = klass.__dict__.get("__slots__", ())
        for name in ([slots] if isinstance(slots, str) else slots):
            if name not in ("__dict__", "__weakref__") and name not in names:
                names.append(name)
    return names


# torch.nn.Module's own bookkeeping, each covered elsewhere or irrelevant to the trace:
_MODULE_BOOKKEEPING = frozenset({
    "training",  # module_structure lists it per module
    "_parameters", "_buffers", "_modules",  # the parameters, buffers and module tree ingredients
    "_non_persistent_buffers_set",  # only changes what state_dict saves
    "_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
    "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_backward_hooks",
    "_backward_pre_hooks", "_is_full_backward_hook",  # Fingerprinter.hooks, without hook ids
    "_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",  # checkpointing only
})

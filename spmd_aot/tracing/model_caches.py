"""Empty the memo caches of a model's own code before it is traced.

Why: model code memoizes tensors it computes from Python numbers alone: transformers' BEiT and
Data2Vec-Vision build their relative position index once per window size in a
``functools.lru_cache`` shared by every instance (``compile_compatible_method_lru_cache`` on a
static method). Traced, that tensor is a fake tensor of the trace's ``FakeTensorMode``; the next
trace in the same process (a build's second placement, ``spmd-aot build -p replicate -p shard``)
gets it back from the cache and fails with "Mixing fake modes". Emptying the caches first makes
every trace compute them again; eager code then fills them again with real tensors as before.

Only the caches of the model's own classes (not torch's) are emptied: the ``lru_cache`` wrappers found in the
class dictionaries of the model's modules and in the globals of the Python modules that define
them, directly or one closure deep (a decorator wrapping the cached function). Their results are
recomputed on the next call, so emptying them changes no value, only when it is computed.
"""

from __future__ import annotations

import functools
import sys

from torch import nn

__all__ = ["clear_model_caches"]

_CACHE = functools._lru_cache_wrapper


def _caches_in(value, out: list) -> None:
    """The lru_cache wrappers ``value`` is, wraps (staticmethod / classmethod) or closes over."""
    if isinstance(value, (staticmethod, classmethod)):
        value = value.__func__
    if isinstance(value, _CACHE):
        out.append(value)
        return
    for cell in getattr(value, "__closure__", None) or ():
        try:
            inner = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if isinstance(inner, _CACHE):
            out.append(inner)


def _torchs(module: str) -> bool:
    """Torch's and Python's own classes: their caches hold no tensors of a trace."""
    return module == "builtins" or module == "torch" or module.startswith("torch.")


def clear_model_caches(model: nn.Module) -> int:
    """Empty every lru_cache of ``model``'s module classes (see the module doc); returns how many."""
    classes = {c for m in model.modules() for c in type(m).__mro__ if not _torchs(c.__module__)}
    namespaces = [vars(c) for c in classes]
    namespaces += [vars(sys.modules[c.__module__]) for c in classes if c.__module__ in sys.modules]
    caches: list = []
    seen: set[int] = set()
    for namespace in namespaces:
        if id(namespace) in seen:
            continue
        seen.add(id(namespace))
        for value in list(namespace.values()):
            _caches_in(value, caches)
    for cache in caches:
        cache.cache_clear()
    return len(caches)

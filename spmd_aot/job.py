"""What a user hands to ``spmd-aot build``: a train step plus factories for its live objects.

The factories are called at build time under fake tensors (no parameter memory), so they
must build the model, optimizer and one rank's batch without touching real data.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import importlib.util
import pathlib
import sys
from typing import Any
from collections.abc import Callable, Sequence

from .errors import SpmdAotError, TargetError

__all__ = ["Job", "load_target", "input_placements"]


@dataclasses.dataclass
class Job:
    """One training job to build ahead of time.

    step:      ``step(model, optim, batch) -> Any``; the user's unchanged train step
               (forward, ``loss.backward()``, ``optim.step()``, ``optim.zero_grad()``); or,
               with ``optimizer=None``, a forward-only step ``step(model, batch) -> Any``
               (evaluation, inference), traced and run under ``torch.no_grad()``.
    model:     zero-argument factory returning the ``nn.Module`` (in the train/eval mode the
               step runs it in: the mode is part of the key).
    optimizer: ``optimizer(model) -> torch.optim.Optimizer``, or None for a forward-only step.
    batch:     zero-argument factory returning ONE RANK's batch (a pytree of tensors), or
               with ``global_batch=True`` the whole step's batch, whose dim 0 must divide by
               the world size, or with ``batch_placements`` the whole step's batch as a tuple
               split element by element: ``Replicate()`` reaches every rank whole,
               ``Shard(d)`` is split over the ranks on dim d (DTensor placement objects).
    """

    step: Callable[..., Any]
    model: Callable[[], Any]
    optimizer: Callable[[Any], Any] | None
    batch: Callable[[], Any]
    global_batch: bool = False  # True: ``batch`` returns the GLOBAL batch, split over ranks on dim 0
    batch_placements: Sequence[Any] | None = None  # per batch element: Replicate() or Shard(d)

    def __post_init__(self):
        if self.batch_placements is not None:
            if self.global_batch:
                raise SpmdAotError("Job: pass global_batch=True (every leaf split on dim 0) or "
                                   "batch_placements, not both")
            self.batch_placements = input_placements(self.batch_placements, "Job batch_placements")


def input_placements(placements, what: str) -> tuple:
    """``placements`` as a tuple of ``Replicate()`` / ``Shard(d)``, or an error naming ``what``."""
    from torch.distributed.tensor import Replicate, Shard

    if isinstance(placements, (Replicate, Shard)) or not isinstance(placements, Sequence) \
            or isinstance(placements, str):
        raise SpmdAotError(f"{what} must be a sequence with one placement per input, e.g. "
                           f"(Shard(0), Replicate()); got {placements!r}")
    for i, p in enumerate(placements):
        if type(p) not in (Replicate, Shard):
            raise SpmdAotError(
                f"{what}[{i}] is {p!r}; expected torch.distributed.tensor.Replicate() (every rank "
                "passes the whole input) or Shard(dim) (each rank passes its piece along dim)")
    return tuple(placements)


_EXPECTED = "expected 'pkg.module:job' or 'path/to/file.py:job' naming a spmd_aot.Job or a zero-argument function returning one"


def load_target(target: str) -> Job:
    """Resolve ``pkg.module:attr`` or ``path/to/file.py:attr`` to a ``Job``.

    ``attr`` may be a ``Job`` or a zero-argument callable returning one. Every failure,
    including an exception raised by the user's own module or factory, is a ``TargetError``.
    """
    module_part, sep, attr = target.rpartition(":")
    if not sep or not module_part or not attr:
        raise TargetError(f"TARGET {target!r} is malformed; {_EXPECTED}")
    if module_part.endswith(".py") or "/" in module_part or "\\" in module_part:
        module = _import_file(pathlib.Path(module_part), target)
    else:
        module = _import_module(module_part, target)
    try:
        obj = getattr(module, attr)
    except AttributeError:
        public = sorted(n for n in vars(module) if not n.startswith("_"))
        raise TargetError(
            f"TARGET {target!r}: module {module_part!r} has no attribute {attr!r} "
            f"(it defines: {', '.join(public[:20]) or 'nothing public'}); {_EXPECTED}"
        ) from None
    if isinstance(obj, Job):
        return obj
    if not callable(obj):
        raise TargetError(f"TARGET {target!r} is a {type(obj).__name__}, not a Job; {_EXPECTED}")
    try:
        job = obj()
    except Exception as exc:
        raise TargetError(f"TARGET {target!r}: calling {attr}() raised {type(exc).__name__}: {exc}; "
                          f"{_EXPECTED}") from exc
    if not isinstance(job, Job):
        raise TargetError(f"TARGET {target!r}: {attr}() returned a {type(job).__name__}, not a Job; {_EXPECTED}")
    return job


def _import_module(name: str, target: str):
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name and name != exc.name and not name.startswith(exc.name + "."):
            raise TargetError(f"TARGET {target!r}: importing {name!r} failed: it imports {exc.name!r}, "
                              "which is not installed") from exc
        raise TargetError(f"TARGET {target!r}: module {name!r} not found. Check the name, or pass a "
                          "file path such as 'train.py:job'; " + _EXPECTED) from exc
    except Exception as exc:
        raise TargetError(f"TARGET {target!r}: importing {name!r} raised {type(exc).__name__}: {exc}") from exc


def _import_file(path: pathlib.Path, target: str):
    if not path.is_file():
        raise TargetError(f"TARGET {target!r}: file {str(path)!r} not found; {_EXPECTED}")
    digest = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:8]
    name = f"_spmd_aot_target_{path.stem}_{digest}"  # distinct per path: two train.py files coexist
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    # The file's folder goes on sys.path so its sibling imports work, as under `python file.py`.
    folder = str(path.resolve().parent)
    sys.path.insert(0, folder)
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[name]
        raise TargetError(f"TARGET {target!r}: executing {str(path)!r} raised {type(exc).__name__}: {exc}") from exc
    finally:
        sys.path.remove(folder)
    return module
